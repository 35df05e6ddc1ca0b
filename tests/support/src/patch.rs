//! JSON merge patch (RFC 7386) and the subset of strategic merge patch the fake apiserver
//! needs: lists with a known merge key are merged item by item, `$patch: delete` removes an
//! item, `$patch: replace` replaces a map, `$setElementOrder/<list>` orders a merged list;
//! any other list (an `+listType=atomic` one such as `containerStatuses`) is replaced whole.

use serde_json::{Map, Value};

/// Merge keys of the lists edgehub and the tests patch, as in the Kubernetes API's
/// `patchMergeKey` tags.
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "conditions" | "addresses" => "type",
        // containerStatuses and initContainerStatuses are `+listType=atomic` without a patch
        // strategy in the real API: a patch replaces them whole.
        "containers" | "initContainers" | "env" | "volumes" | "volumeMounts" => "name",
        "ports" => "containerPort",
        "podIPs" | "hostIPs" => "ip",
        _ => return None,
    })
}

pub fn merge_patch(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.shift_remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = strip_nulls(p),
    }
}

fn strip_nulls(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), strip_nulls(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

pub fn strategic_merge_patch(target: &mut Value, patch: &Value) {
    let (Value::Object(t), Value::Object(p)) = (&mut *target, patch) else {
        *target = strip_nulls(patch);
        return;
    };
    if p.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut m = p.clone();
        m.shift_remove("$patch");
        *target = strip_nulls(&Value::Object(m));
        return;
    }
    for (k, v) in p {
        if k.starts_with('$') {
            continue;
        }
        if v.is_null() {
            t.shift_remove(k);
            continue;
        }
        match (merge_key(k), v) {
            (Some(key), Value::Array(items)) => {
                let entry = t.entry(k.clone()).or_insert(Value::Array(vec![]));
                if !entry.is_array() {
                    *entry = Value::Array(vec![]);
                }
                let order = p
                    .get(&format!("$setElementOrder/{k}"))
                    .and_then(Value::as_array)
                    .map(Vec::as_slice);
                if let Value::Array(cur) = entry {
                    merge_list(cur, items, key, order);
                }
            }
            _ => strategic_merge_patch(t.entry(k.clone()).or_insert(Value::Null), v),
        }
    }
}

/// Merges `items` into `cur` by `key`, then orders the result as the apiserver does: the
/// patch's items in the patch's order (or `$setElementOrder`'s), interleaved with the items
/// only the server has, in their old order. An item the server did not have comes before the
/// server-only items it meets, which is why a new pod IP lands in front of the old one.
fn merge_list(cur: &mut Vec<Value>, items: &[Value], key: &str, order: Option<&[Value]>) {
    let original = cur.clone();
    for item in items {
        let Some(id) = item.get(key).cloned() else {
            cur.push(item.clone());
            continue;
        };
        let pos = cur.iter().position(|c| c.get(key) == Some(&id));
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (pos, delete) {
            (Some(i), true) => {
                cur.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => strategic_merge_patch(&mut cur[i], item),
            (None, false) => {
                let mut v = Value::Object(Map::new());
                strategic_merge_patch(&mut v, item);
                cur.push(v);
            }
        }
    }
    let id = |v: &Value| v.get(key).cloned();
    let patch_order: Vec<Value> = match order {
        Some(o) => o.iter().filter_map(id).collect(),
        None => items
            .iter()
            .filter(|i| i.get("$patch").and_then(Value::as_str) != Some("delete"))
            .filter_map(id)
            .collect(),
    };
    let index_in =
        |list: &[Value], v: &Value| id(v).and_then(|k| list.iter().position(|x| *x == k));
    let original_ids: Vec<Value> = original.iter().filter_map(id).collect();
    let (mut from_patch, server_only): (Vec<Value>, Vec<Value>) = std::mem::take(cur)
        .into_iter()
        .partition(|v| items.iter().any(|i| id(i).is_some() && id(i) == id(v)));
    from_patch.sort_by_key(|v| index_in(&patch_order, v).unwrap_or(usize::MAX));
    let (mut l, mut r) = (
        server_only.into_iter().peekable(),
        from_patch.into_iter().peekable(),
    );
    loop {
        let take_left = match (l.peek(), r.peek()) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(a), Some(b)) => matches!(
                (index_in(&original_ids, a), index_in(&original_ids, b)),
                (Some(x), Some(y)) if x < y
            ),
        };
        let next = if take_left { l.next() } else { r.next() };
        cur.extend(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_replaces_lists_and_removes_nulls() {
        let mut t = json!({"a": 1, "b": {"c": 2}, "l": [{"type": "X"}]});
        merge_patch(
            &mut t,
            &json!({"a": null, "b": {"d": 3}, "l": [{"type": "Y"}]}),
        );
        assert_eq!(t, json!({"b": {"c": 2, "d": 3}, "l": [{"type": "Y"}]}));
    }

    #[test]
    fn strategic_merges_conditions_by_type() {
        let mut t = json!({"status": {"conditions": [
            {"type": "Ready", "status": "True"}, {"type": "PodNeedUpgrade", "status": "False"}]}});
        strategic_merge_patch(
            &mut t,
            &json!({"status": {"conditions": [
                {"type": "PodNeedUpgrade", "status": "True", "message": "controllerrevision: h"},
                {"type": "New", "status": "True"}]}}),
        );
        assert_eq!(
            t["status"]["conditions"],
            json!([{"type": "Ready", "status": "True"},
                   {"type": "PodNeedUpgrade", "status": "True", "message": "controllerrevision: h"},
                   {"type": "New", "status": "True"}])
        );
        strategic_merge_patch(
            &mut t,
            &json!({"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]}}),
        );
        assert_eq!(t["status"]["conditions"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn a_new_list_item_goes_in_front_of_the_servers_as_the_apiserver_does() {
        let mut t = json!({"podIPs": [{"ip": "10.0.0.3"}]});
        strategic_merge_patch(&mut t, &json!({"podIPs": [{"ip": "10.0.0.4"}]}));
        assert_eq!(t["podIPs"], json!([{"ip": "10.0.0.4"}, {"ip": "10.0.0.3"}]));
    }

    #[test]
    fn strategic_deletes_and_orders_ips_and_replaces_container_statuses() {
        let mut t = json!({"status": {"podIPs": [{"ip": "10.0.0.3"}],
            "containerStatuses": [{"name": "a", "ready": true}, {"name": "b", "ready": true}]}});
        strategic_merge_patch(
            &mut t,
            &json!({"status": {"$setElementOrder/podIPs": [{"ip": "10.0.0.4"}],
                "podIPs": [{"ip": "10.0.0.4"}, {"ip": "10.0.0.3", "$patch": "delete"}],
                "containerStatuses": [{"name": "b", "ready": false}]}}),
        );
        assert_eq!(t["status"]["podIPs"], json!([{"ip": "10.0.0.4"}]));
        assert_eq!(
            t["status"]["containerStatuses"],
            json!([{"name": "b", "ready": false}])
        );
    }
}

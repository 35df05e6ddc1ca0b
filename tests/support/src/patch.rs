//! JSON merge patch (RFC 7386) and the subset of strategic merge patch the fake apiserver
//! needs: lists with a known merge key are merged item by item, `$patch: delete` removes an
//! item, `$patch: replace` replaces a map; any other list is replaced whole.

use serde_json::{Map, Value};

/// Merge keys of the lists edgehub and the tests patch, as in the Kubernetes API's
/// `patchMergeKey` tags.
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "conditions" | "addresses" => "type",
        "containers"
        | "initContainers"
        | "containerStatuses"
        | "initContainerStatuses"
        | "ephemeralContainerStatuses"
        | "env"
        | "volumes"
        | "volumeMounts" => "name",
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
                if let Value::Array(cur) = entry {
                    merge_list(cur, items, key);
                }
            }
            _ => strategic_merge_patch(t.entry(k.clone()).or_insert(Value::Null), v),
        }
    }
}

fn merge_list(cur: &mut Vec<Value>, items: &[Value], key: &str) {
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
}

//! Building `GET /pods`: a v1 PodList of the cached pods, each byte for byte as the apiserver
//! sent it except for one thing, the `PodNeedUpgrade` condition computed on the device.
//!
//! Re-serializing a parsed pod would reorder fields and change string escaping (Go escapes
//! `<`, `>` and `&`; serde does not), so the condition is spliced into the raw JSON: the pod
//! and its `status` are read as ordered lists of raw fields, and only `status.conditions` is
//! rebuilt.

use crate::revision::Condition;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The fields of a JSON object in document order, values kept raw.
struct Fields<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Fields<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Fields<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, &'de RawValue>()? {
                    out.push((k, v));
                }
                Ok(Fields(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct TypeOnly<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<&'a str>,
}

fn write_fields(out: &mut String, fields: &[(String, String)]) {
    out.push('{');
    for (i, (k, v)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Serializing a String cannot fail.
        out.push_str(&serde_json::to_string(k).unwrap_or_default());
        out.push(':');
        out.push_str(v);
    }
    out.push('}');
}

/// Replaces (or adds) the condition of `condition`'s type in `status.conditions` of `raw`.
pub fn with_condition(raw: &str, condition: &Condition) -> Result<String, serde_json::Error> {
    let ctype = condition.kind;
    let cond = serde_json::to_string(condition)?;
    let pod: Fields = serde_json::from_str(raw)?;
    let mut top: Vec<(String, String)> = Vec::with_capacity(pod.0.len() + 1);
    let mut saw_status = false;
    for (k, v) in pod.0 {
        if k != "status" {
            top.push((k, v.get().to_string()));
            continue;
        }
        saw_status = true;
        let status: Fields = serde_json::from_str(v.get())?;
        let mut st: Vec<(String, String)> = Vec::with_capacity(status.0.len() + 1);
        let mut saw_conditions = false;
        for (sk, sv) in status.0 {
            if sk != "conditions" {
                st.push((sk, sv.get().to_string()));
                continue;
            }
            saw_conditions = true;
            let list: Option<Vec<&RawValue>> = serde_json::from_str(sv.get())?;
            let mut items: Vec<&str> = Vec::new();
            for c in list.unwrap_or_default() {
                let t: TypeOnly = serde_json::from_str(c.get())?;
                if t.kind != Some(ctype) {
                    items.push(c.get());
                }
            }
            items.push(&cond);
            st.push((sk, format!("[{}]", items.join(","))));
        }
        if !saw_conditions {
            st.push(("conditions".into(), format!("[{cond}]")));
        }
        let mut s = String::new();
        write_fields(&mut s, &st);
        top.push((k, s));
    }
    if !saw_status {
        top.push(("status".into(), format!("{{\"conditions\":[{cond}]}}")));
    }
    let mut out = String::with_capacity(raw.len() + cond.len() + 16);
    write_fields(&mut out, &top);
    Ok(out)
}

/// A v1 PodList around already-serialized items.
pub fn pod_list<'a>(resource_version: &str, items: impl Iterator<Item = &'a str>) -> String {
    let mut out = String::from("{\"kind\":\"PodList\",\"apiVersion\":\"v1\",\"metadata\":{");
    if !resource_version.is_empty() {
        out.push_str("\"resourceVersion\":");
        out.push_str(&serde_json::to_string(resource_version).unwrap_or_default());
    }
    out.push_str("},\"items\":[");
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item);
    }
    out.push_str("]}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn cond(status: &'static str) -> Condition {
        Condition {
            kind: "PodNeedUpgrade",
            status,
            reason: "Test",
            message: Some("controllerrevision: abc".into()),
        }
    }

    #[test]
    fn everything_but_the_condition_is_byte_identical() {
        let raw = r#"{"metadata":{"name":"p","annotations":{"x":"a\u0026b\u003c"}},"spec":{"z":1,"a":2},"status":{"phase":"Running","conditions":[{"type":"Ready","status":"True"}],"qosClass":"Burstable"}}"#;
        let out = with_condition(raw, &cond("True")).unwrap();
        assert_eq!(
            out,
            r#"{"metadata":{"name":"p","annotations":{"x":"a\u0026b\u003c"}},"spec":{"z":1,"a":2},"status":{"phase":"Running","conditions":[{"type":"Ready","status":"True"},{"type":"PodNeedUpgrade","status":"True","reason":"Test","message":"controllerrevision: abc"}],"qosClass":"Burstable"}}"#
        );
    }

    #[test]
    fn an_existing_condition_of_the_type_is_replaced() {
        let raw = r#"{"status":{"conditions":[{"type":"PodNeedUpgrade","status":"True"},{"type":"Ready","status":"True"}]}}"#;
        let out: Value =
            serde_json::from_str(&with_condition(raw, &cond("False")).unwrap()).unwrap();
        let conds = out["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 2);
        assert_eq!(conds[0]["type"], "Ready");
        assert_eq!(conds[1]["status"], "False");
    }

    #[test]
    fn missing_status_or_conditions_are_added() {
        let out: Value =
            serde_json::from_str(&with_condition(r#"{"metadata":{}}"#, &cond("True")).unwrap())
                .unwrap();
        assert_eq!(out["status"]["conditions"][0]["type"], "PodNeedUpgrade");
        let out: Value = serde_json::from_str(
            &with_condition(r#"{"status":{"phase":"Pending"}}"#, &cond("True")).unwrap(),
        )
        .unwrap();
        assert_eq!(out["status"]["phase"], "Pending");
        assert_eq!(out["status"]["conditions"][0]["type"], "PodNeedUpgrade");
        let out: Value = serde_json::from_str(
            &with_condition(r#"{"status":{"conditions":null}}"#, &cond("True")).unwrap(),
        )
        .unwrap();
        assert_eq!(out["status"]["conditions"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn recorded_pods_keep_every_other_byte() {
        let text = include_str!("../../tests/fixtures/apiserver/pods_list_node.json");
        let v: Value = serde_json::from_str(text).unwrap();
        for item in v["response"]["body"]["items"].as_array().unwrap() {
            let raw = serde_json::to_string(item).unwrap();
            let out = with_condition(&raw, &cond("True")).unwrap();
            let mut a: Value = serde_json::from_str(&out).unwrap();
            let conds = a["status"]["conditions"].as_array_mut().unwrap();
            assert_eq!(
                conds.pop().unwrap(),
                serde_json::to_value(cond("True")).unwrap()
            );
            assert_eq!(&a, item);
            assert!(out.starts_with(&raw[..raw.find("\"status\"").unwrap()]));
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for raw in [
            "",
            "[]",
            "{",
            r#"{"status":5}"#,
            r#"{"status":{"conditions":{}}}"#,
            r#"{"status":{"conditions":[5]}}"#,
        ] {
            assert!(with_condition(raw, &cond("True")).is_err(), "{raw}");
        }
    }

    #[test]
    fn list_shape() {
        let l = pod_list("42", ["{\"a\":1}", "{\"b\":2}"].into_iter());
        assert_eq!(
            l,
            r#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"42"},"items":[{"a":1},{"b":2}]}"#
        );
        let l = pod_list("", std::iter::empty());
        assert_eq!(
            l,
            r#"{"kind":"PodList","apiVersion":"v1","metadata":{},"items":[]}"#
        );
    }
}

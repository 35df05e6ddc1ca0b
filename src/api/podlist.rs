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

fn push_key(out: &mut String, k: &str) {
    // Serializing a str cannot fail.
    out.push_str(&serde_json::to_string(k).unwrap_or_default());
    out.push(':');
}

/// Replaces (or adds) the condition of `condition`'s type in `status.conditions` of `raw`.
pub fn with_condition(raw: &str, condition: &Condition) -> Result<String, serde_json::Error> {
    let mut out = String::with_capacity(raw.len() + 160);
    write_with_condition(&mut out, raw, condition)?;
    Ok(out)
}

/// [`with_condition`] appending to `out`; on error `out` is left as it was.
pub fn write_with_condition(
    out: &mut String,
    raw: &str,
    condition: &Condition,
) -> Result<(), serde_json::Error> {
    let mark = out.len();
    let r = splice(out, raw, condition);
    if r.is_err() {
        out.truncate(mark);
    }
    r
}

fn splice(out: &mut String, raw: &str, condition: &Condition) -> Result<(), serde_json::Error> {
    let ctype = condition.kind;
    let cond = serde_json::to_string(condition)?;
    let pod: Fields = serde_json::from_str(raw)?;
    out.push('{');
    let mut saw_status = false;
    for (i, (k, v)) in pod.0.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_key(out, k);
        if k != "status" {
            out.push_str(v.get());
            continue;
        }
        saw_status = true;
        let status: Fields = serde_json::from_str(v.get())?;
        out.push('{');
        let mut saw_conditions = false;
        for (j, (sk, sv)) in status.0.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            push_key(out, sk);
            if sk != "conditions" {
                out.push_str(sv.get());
                continue;
            }
            saw_conditions = true;
            let list: Option<Vec<&RawValue>> = serde_json::from_str(sv.get())?;
            out.push('[');
            for c in list.unwrap_or_default() {
                let t: TypeOnly = serde_json::from_str(c.get())?;
                if t.kind != Some(ctype) {
                    out.push_str(c.get());
                    out.push(',');
                }
            }
            out.push_str(&cond);
            out.push(']');
        }
        if !saw_conditions {
            if !status.0.is_empty() {
                out.push(',');
            }
            out.push_str("\"conditions\":[");
            out.push_str(&cond);
            out.push(']');
        }
        out.push('}');
    }
    if !saw_status {
        if !pod.0.is_empty() {
            out.push(',');
        }
        out.push_str("\"status\":{\"conditions\":[");
        out.push_str(&cond);
        out.push_str("]}");
    }
    out.push('}');
    Ok(())
}

/// The start of a v1 PodList; items follow, comma-separated, then [`POD_LIST_END`].
pub const POD_LIST_START: &str =
    "{\"kind\":\"PodList\",\"apiVersion\":\"v1\",\"metadata\":{},\"items\":[";
pub const POD_LIST_END: &str = "]}";

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
        let l = format!("{POD_LIST_START}{{\"a\":1}},{{\"b\":2}}{POD_LIST_END}");
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        assert_eq!(v["kind"], "PodList");
        assert_eq!(v["apiVersion"], "v1");
        assert_eq!(v["items"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn a_failed_splice_leaves_the_buffer_as_it_was() {
        let mut out = String::from("prefix");
        let bad = r#"{"a":1,"status":{"conditions":[5]}}"#;
        assert!(write_with_condition(&mut out, bad, &cond("True")).is_err());
        assert_eq!(out, "prefix");
        write_with_condition(&mut out, "{}", &cond("True")).unwrap();
        assert!(out.starts_with("prefix{\"status\":"));
    }
}

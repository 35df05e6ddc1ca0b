//! Building `GET /pods`: a v1 PodList of the cached pods, each byte for byte as the apiserver
//! sent it except for one thing, the `PodNeedUpgrade` condition computed on the device.
//!
//! Re-serializing a parsed pod would reorder fields and change string escaping (Go escapes
//! `<`, `>` and `&`; serde does not), so the condition is spliced into the raw JSON: the pod
//! and its `status` are walked as raw members ([`rawjson`]), every byte outside
//! `status.conditions` is copied as it is, and only that list is rebuilt.

use super::rawjson::{self, Malformed};
use crate::revision::Condition;

/// What a splice can fail on.
#[derive(Debug, thiserror::Error)]
pub enum SpliceError {
    #[error(transparent)]
    Malformed(#[from] Malformed),
    #[error("the condition does not serialize: {0}")]
    Condition(#[from] serde_json::Error),
}

/// Replaces (or adds) the condition of `condition`'s type in `status.conditions` of `raw`.
pub fn with_condition(raw: &str, condition: &Condition) -> Result<String, SpliceError> {
    let mut out = String::with_capacity(raw.len() + 160);
    write_with_condition(&mut out, raw, condition)?;
    Ok(out)
}

/// [`with_condition`] appending to `out`; on error `out` is left as it was.
pub fn write_with_condition(
    out: &mut String,
    raw: &str,
    condition: &Condition,
) -> Result<(), SpliceError> {
    let mark = out.len();
    let cond = serde_json::to_string(condition)?;
    let r = splice(out, raw, condition.kind, &cond);
    if r.is_err() {
        out.truncate(mark);
    }
    Ok(r?)
}

/// `raw` with `cond` (of type `ctype`) as its only condition of that type, appended to `out`.
fn splice(out: &mut String, raw: &str, ctype: &str, cond: &str) -> Result<(), Malformed> {
    let pod = rawjson::object(raw)?;
    let Some(status) = pod.get(raw, "status") else {
        out.push_str(&raw[..pod.close]);
        if !pod.members.is_empty() {
            out.push(',');
        }
        out.push_str("\"status\":{\"conditions\":[");
        out.push_str(cond);
        out.push_str("]}");
        out.push_str(&raw[pod.close..]);
        return Ok(());
    };
    out.push_str(&raw[..status.value.start]);
    let st = &raw[status.value.clone()];
    let fields = rawjson::object(st)?;
    match fields.get(st, "conditions") {
        None => {
            out.push_str(&st[..fields.close]);
            if !fields.members.is_empty() {
                out.push(',');
            }
            out.push_str("\"conditions\":[");
            out.push_str(cond);
            out.push(']');
            out.push_str(&st[fields.close..]);
        }
        Some(c) => {
            out.push_str(&st[..c.value.start]);
            write_conditions(out, &st[c.value.clone()], ctype, cond)?;
            out.push_str(&st[c.value.end..]);
        }
    }
    out.push_str(&raw[status.value.end..]);
    Ok(())
}

/// The conditions of `list` (raw JSON: an array or null) but those of type `ctype`, then `cond`.
fn write_conditions(
    out: &mut String,
    list: &str,
    ctype: &str,
    cond: &str,
) -> Result<(), Malformed> {
    out.push('[');
    if list != "null" {
        for element in rawjson::array(list)? {
            let c = &list[element];
            let fields = rawjson::object(c)?;
            let same = match fields.get(c, "type") {
                Some(t) => rawjson::is_string(&c[t.value.clone()], ctype)?,
                None => false,
            };
            if !same {
                out.push_str(c);
                out.push(',');
            }
        }
    }
    out.push_str(cond);
    out.push(']');
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
    fn pretty_printed_pods_keep_their_layout_outside_the_conditions() {
        let raw = "{\n  \"metadata\": {\"name\": \"p\"},\n  \"status\": {\n    \"conditions\": [ {\"type\": \"Pod\\u004eeedUpgrade\", \"status\": \"True\"}, {\"type\": \"Ready\"} ],\n    \"phase\": \"Running\"\n  }\n}\n";
        let out = with_condition(raw, &cond("False")).unwrap();
        let want = format!(
            "{{\n  \"metadata\": {{\"name\": \"p\"}},\n  \"status\": {{\n    \"conditions\": [{{\"type\": \"Ready\"}},{}],\n    \"phase\": \"Running\"\n  }}\n}}\n",
            serde_json::to_string(&cond("False")).unwrap()
        );
        assert_eq!(
            out, want,
            "the escaped PodNeedUpgrade is replaced, the rest kept"
        );
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

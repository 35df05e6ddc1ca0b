//! The command line's side of transactions (`edgehub upgrade --manual-commit`, `commit`,
//! `rollback`, `transactions`): the request bodies it sends and what it prints, pure.

use crate::upgrade::txn::{human, parse_duration};
use serde_json::{json, Value};

/// `NS/POD[@REVISION]`, checked.
pub fn pod_ref(arg: &str) -> Result<Value, String> {
    let (pod, revision) = match arg.split_once('@') {
        Some((p, r)) => (p, Some(r)),
        None => (arg, None),
    };
    let (ns, name) = pod
        .split_once('/')
        .ok_or_else(|| format!("{arg:?} is not NAMESPACE/NAME[@REVISION]"))?;
    crate::names::check_label(ns).map_err(|r| format!("namespace {ns:?}: {r}"))?;
    crate::names::check_subdomain(name).map_err(|r| format!("pod name {name:?}: {r}"))?;
    let mut v = json!({"namespace": ns, "name": name});
    if let Some(r) = revision {
        if r.is_empty() {
            return Err(format!("{arg:?}: the revision after @ is empty"));
        }
        v["revision"] = r.into();
    }
    Ok(v)
}

/// The body of `POST /v1/transactions` for these pods and `--timeout`.
pub fn start_body(pods: &[String], timeout: Option<&str>) -> Result<String, String> {
    let pods = pods
        .iter()
        .map(|p| pod_ref(p))
        .collect::<Result<Vec<_>, _>>()?;
    let mut body = json!({ "pods": pods });
    if let Some(t) = timeout {
        let d = parse_duration(t).map_err(|e| format!("--timeout: {e}"))?;
        if d.as_secs() == 0 {
            return Err("--timeout: the commit deadline must be at least 1s".into());
        }
        body["commitTimeoutSeconds"] = d.as_secs().into();
    }
    Ok(body.to_string())
}

/// A transaction id as edgehub makes them: 16 lowercase hex digits.
pub fn check_id(id: &str) -> Result<(), String> {
    if id.len() == 16 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(format!(
            "{id:?} is not a transaction id (16 lowercase hex digits, as `edgehub upgrade --manual-commit` prints)"
        ))
    }
}

/// The body of `POST .../rollback`.
pub fn rollback_body(reason: Option<&str>) -> String {
    match reason {
        Some(r) => json!({ "reason": r }).to_string(),
        None => String::new(),
    }
}

fn left(t: &Value) -> String {
    match t["commitDeadlineLeftSeconds"].as_i64() {
        Some(s) => human(s * 1000),
        None => "-".into(),
    }
}

fn pods_of(t: &Value) -> Vec<&Value> {
    t["pods"].as_array().into_iter().flatten().collect()
}

/// One line per transaction: `edgehub transactions`.
pub fn table(body: &str) -> Result<String, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("bad answer: {e}"))?;
    let mut rows = vec![vec![
        "ID".to_string(),
        "STATE".into(),
        "PODS".into(),
        "DEADLINE LEFT".into(),
        "REASON".into(),
    ]];
    for t in v["transactions"].as_array().into_iter().flatten() {
        let pods: Vec<String> = pods_of(t)
            .iter()
            .map(|p| {
                format!(
                    "{}/{}",
                    p["namespace"].as_str().unwrap_or("?"),
                    p["name"].as_str().unwrap_or("?")
                )
            })
            .collect();
        rows.push(vec![
            t["id"].as_str().unwrap_or("?").into(),
            t["state"].as_str().unwrap_or("?").into(),
            pods.join(","),
            left(t),
            t["reason"].as_str().unwrap_or("").into(),
        ]);
    }
    Ok(super::columns(&rows))
}

/// One transaction in full: `edgehub transactions ID`.
pub fn details(body: &str) -> Result<String, String> {
    let t: Value = serde_json::from_str(body).map_err(|e| format!("bad answer: {e}"))?;
    let mut out = format!(
        "transaction {}: {}\n",
        t["id"].as_str().unwrap_or("?"),
        t["state"].as_str().unwrap_or("?")
    );
    out.push_str(&format!(
        "commit deadline: {} (left: {})\n",
        human(t["commitTimeoutSeconds"].as_i64().unwrap_or(0) * 1000),
        left(&t)
    ));
    if let Some(r) = t["reason"].as_str() {
        out.push_str(&format!("reason: {r}\n"));
    }
    for p in pods_of(&t) {
        out.push_str(&format!(
            "  {}/{} {} -> {} [{}]\n",
            p["namespace"].as_str().unwrap_or("?"),
            p["name"].as_str().unwrap_or("?"),
            p["from"].as_str().unwrap_or("?"),
            p["to"].as_str().unwrap_or("?"),
            p["state"].as_str().unwrap_or("?"),
        ));
        for key in ["error", "waiting"] {
            if let Some(e) = p[key].as_str() {
                out.push_str(&format!("      {key}: {e}\n"));
            }
        }
    }
    Ok(out)
}

/// What a transaction's pods are doing, for the progress lines of `--wait`.
pub fn progress(t: &Value) -> String {
    let pods: Vec<String> = pods_of(t)
        .iter()
        .map(|p| {
            format!(
                "{}/{} {}",
                p["namespace"].as_str().unwrap_or("?"),
                p["name"].as_str().unwrap_or("?"),
                p["state"].as_str().unwrap_or("?")
            )
        })
        .collect();
    format!(
        "{}: {} ({})",
        t["id"].as_str().unwrap_or("?"),
        t["state"].as_str().unwrap_or("?"),
        pods.join(", ")
    )
}

/// Why a transaction ended where the caller did not want it: its reason, or its pods' errors.
pub fn why(t: &Value) -> String {
    if let Some(r) = t["reason"].as_str() {
        return r.to_string();
    }
    let errors: Vec<String> = pods_of(t)
        .iter()
        .filter_map(|p| {
            Some(format!(
                "{}/{}: {}",
                p["namespace"].as_str()?,
                p["name"].as_str()?,
                p["error"].as_str()?
            ))
        })
        .collect();
    if errors.is_empty() {
        "no reason recorded".into()
    } else {
        errors.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_and_the_deadline_become_the_body() {
        let b = start_body(
            &[
                "vehicle/telemetry-sv74m@55778fbb9f".into(),
                "vehicle/gw".into(),
            ],
            Some("90s"),
        )
        .unwrap();
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(
            v,
            json!({"pods": [
                {"namespace": "vehicle", "name": "telemetry-sv74m", "revision": "55778fbb9f"},
                {"namespace": "vehicle", "name": "gw"}], "commitTimeoutSeconds": 90})
        );
        let v: Value = serde_json::from_str(&start_body(&["a/b".into()], None).unwrap()).unwrap();
        assert!(
            v.get("commitTimeoutSeconds").is_none(),
            "the config's default"
        );
        for bad in ["nope", "a/b@", "A/b", "a/b/c", "a/"] {
            assert!(start_body(&[bad.into()], None).is_err(), "{bad}");
        }
        assert!(start_body(&["a/b".into()], Some("soon")).is_err());
        assert!(start_body(&["a/b".into()], Some("0s")).is_err());
    }

    #[test]
    fn ids_and_reasons() {
        assert!(check_id("3f9a0c1d5e7b2a64").is_ok());
        for bad in ["", "3F9A0C1D5E7B2A64", "3f9a", "../../etc/passwd0"] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
        assert_eq!(rollback_body(None), "");
        assert_eq!(
            rollback_body(Some("rootfs \"failed\"")),
            r#"{"reason":"rootfs \"failed\""}"#
        );
    }

    #[test]
    fn a_transaction_printed() {
        let t = json!({"id": "3f9a0c1d5e7b2a64", "state": "RollingBack", "reason": "not committed within 30m",
            "commitTimeoutSeconds": 1800, "commitDeadlineLeftSeconds": null,
            "pods": [{"namespace": "vehicle", "name": "a", "from": "1", "to": "2", "state": "RollingBack",
                      "error": "not committed within 30m", "waiting": null}]});
        let d = details(&t.to_string()).unwrap();
        assert!(
            d.starts_with("transaction 3f9a0c1d5e7b2a64: RollingBack\n"),
            "{d}"
        );
        assert!(d.contains("commit deadline: 30m (left: -)\n"), "{d}");
        assert!(d.contains("  vehicle/a 1 -> 2 [RollingBack]\n"), "{d}");
        assert!(d.contains("      error: not committed within 30m\n"), "{d}");
        let list = json!({"transactions": [t]}).to_string();
        let tab = table(&list).unwrap();
        let lines: Vec<&str> = tab.lines().collect();
        assert!(lines[0].starts_with("ID"), "{tab}");
        assert!(
            lines[1].starts_with("3f9a0c1d5e7b2a64") && lines[1].contains("vehicle/a"),
            "{tab}"
        );
        assert_eq!(
            progress(&t),
            "3f9a0c1d5e7b2a64: RollingBack (vehicle/a RollingBack)"
        );
        assert_eq!(why(&t), "not committed within 30m");
        let mut failed = t.clone();
        failed["reason"] = Value::Null;
        failed["pods"][0]["error"] = "the rollback did not finish in time".into();
        assert_eq!(
            why(&failed),
            "vehicle/a: the rollback did not finish in time"
        );
        assert!(table("nope").is_err());
    }
}

//! What the CLI prints from the local API's answers: the `pods` and `images` tables and the
//! `status` text, pure functions of the bodies.

use serde_json::Value;

/// The `edgehub pods` table from a `GET /pods` body.
pub fn pods_table(body: &str) -> Result<String, String> {
    let list: Value =
        serde_json::from_str(body).map_err(|e| format!("GET /pods is not JSON: {e}"))?;
    let items = list["items"].as_array().cloned().unwrap_or_default();
    let mut rows = vec![[
        "POD".to_string(),
        "RUNNING".into(),
        "TARGET".into(),
        "NEED-UPGRADE".into(),
        "PHASE".into(),
    ]];
    for p in &items {
        let s = |v: &Value| v.as_str().unwrap_or("-").to_string();
        let cond = p["status"]["conditions"]
            .as_array()
            .and_then(|cs| {
                cs.iter()
                    .find(|c| c["type"] == crate::revision::POD_NEED_UPGRADE)
            })
            .cloned()
            .unwrap_or(Value::Null);
        let target = cond["message"]
            .as_str()
            .and_then(|m| m.strip_prefix("controllerrevision: "))
            .unwrap_or("-")
            .to_string();
        let need = match (cond["status"].as_str(), cond["reason"].as_str()) {
            (Some(st), Some(r)) => format!("{st} ({r})"),
            (Some(st), None) => st.to_string(),
            _ => "-".into(),
        };
        rows.push([
            format!(
                "{}/{}",
                s(&p["metadata"]["namespace"]),
                s(&p["metadata"]["name"])
            ),
            s(&p["metadata"]["labels"][crate::object::REVISION_HASH_LABEL]),
            target,
            need,
            s(&p["status"]["phase"]),
        ]);
    }
    Ok(columns(&rows))
}

/// Rows as left-aligned columns two spaces apart, as kubectl prints tables.
pub fn columns<R: AsRef<[String]>>(rows: &[R]) -> String {
    let mut widths: Vec<usize> = Vec::new();
    for r in rows {
        for (i, c) in r.as_ref().iter().enumerate() {
            if widths.len() <= i {
                widths.push(0);
            }
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .as_ref()
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}", w = *w))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The `edgehub images` table from a `GET /v1/images` body.
pub fn images_table(body: &str) -> Result<String, String> {
    let v: Value =
        serde_json::from_str(body).map_err(|e| format!("GET /v1/images is not JSON: {e}"))?;
    let mut rows = vec![vec![
        "IMAGE".to_string(),
        "SIZE".into(),
        "ROLE".into(),
        "REVISIONS".into(),
        "GC".into(),
    ]];
    for i in v["images"].as_array().into_iter().flatten() {
        let names: Vec<&str> = i["names"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        // A tag reads better than a digest; the id when the image has neither.
        let name = names
            .iter()
            .find(|n| !n.contains('@'))
            .or(names.first())
            .map(|n| n.to_string())
            .unwrap_or_else(|| i["id"].as_str().unwrap_or("-").to_string());
        let revisions: Vec<&str> = i["revisions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let gc = if i["removedAfterCommit"] == true {
            "after the next commit"
        } else if i["removableUnderPressure"] == true {
            "under disk pressure"
        } else {
            "never"
        };
        rows.push(vec![
            name,
            format!(
                "{:.1} MiB",
                i["size"].as_u64().unwrap_or(0) as f64 / 1048576.0
            ),
            i["role"].as_str().unwrap_or("-").to_string(),
            if revisions.is_empty() {
                "-".into()
            } else {
                revisions.join(",")
            },
            gc.to_string(),
        ]);
    }
    Ok(columns(&rows))
}

/// The `identity` lines of `edgehub status`: the credential in use, its window, and each
/// lapsed credential with since when.
fn identity_text(id: &Value, out: &mut String) {
    if !id.is_object() {
        return;
    }
    let s = |v: &Value| v.as_str().unwrap_or("-").to_string();
    let cert = &id["nodeCertificate"];
    match id["inUse"].as_str() {
        Some("nodeCertificate") => out.push_str(&format!(
            "identity: node certificate {} (valid {} to {})",
            s(&cert["subject"]),
            s(&cert["notBefore"]),
            s(&cert["notAfter"])
        )),
        _ => out.push_str("identity: no node certificate yet (TLS bootstrap under way)"),
    }
    if id["waitingForClock"] == true {
        out.push_str(", the device clock is behind its notBefore: kept, waiting for time");
    }
    out.push_str(&format!(
        "; bootstrap credential: {} ({})\n",
        s(&id["bootstrap"]["state"]),
        s(&id["bootstrap"]["source"])
    ));
    for l in id["lapsed"].as_array().into_iter().flatten() {
        let which = match l["credential"].as_str() {
            Some("nodeCertificate") => "node certificate",
            _ => "bootstrap credential",
        };
        out.push_str(&format!(
            "lapsed: {which} {} since {}\n",
            s(&l["reason"]),
            s(&l["since"])
        ));
    }
    let d = &id["lastDenial"];
    if d.is_object() {
        out.push_str(&format!(
            "denied: CSR {} at {}: {}: {} (asks again after the longest backoff, about 5 minutes)\n",
            s(&d["csr"]),
            s(&d["at"]),
            s(&d["reason"]),
            s(&d["message"])
        ));
    }
    let lapsed = id["lapsed"].as_array().map_or(0, Vec::len);
    if lapsed > 1 || (lapsed > 0 && id["inUse"] == "none") {
        out.push_str("        hand over a bootstrap token: edgehub bootstrap --token-file FILE\n");
    }
}

/// The `edgehub status` text from a `GET /v1/status` body.
pub fn status_text(body: &str) -> Result<String, String> {
    let v: Value =
        serde_json::from_str(body).map_err(|e| format!("GET /v1/status is not JSON: {e}"))?;
    let mut out = format!("node:   {}\n", v["node"].as_str().unwrap_or("-"));
    let link = &v["link"];
    out.push_str(&format!(
        "link:   {}",
        link["state"].as_str().unwrap_or("-")
    ));
    if let Some(r) = link["reason"].as_str() {
        out.push_str(&format!(" ({r})"));
    }
    out.push('\n');
    let rt = &v["runtime"];
    if let Some(state) = rt["state"].as_str() {
        out.push_str(&format!("runtime: {state}"));
        if let Some(x) = rt["version"].as_str().or(rt["reason"].as_str()) {
            out.push_str(&format!(" ({x})"));
        }
        out.push('\n');
    }
    let c = &v["cache"];
    out.push_str(&format!(
        "cache:  {} pods, {} DaemonSets, {} ControllerRevisions, {} nodes{}\n",
        c["pods"],
        c["daemonSets"],
        c["controllerRevisions"],
        c["nodes"],
        if c["synced"] == false {
            " (not synced yet: waiting for this node's first pod list; unknown pods keep running)"
        } else {
            ""
        }
    ));
    let sec = &v["secrets"];
    if sec.is_object() {
        let rows = &sec["rows"];
        let n = |k: &str| rows[k].as_u64().unwrap_or(0);
        match sec["key"].as_str() {
            Some(key) => out.push_str(&format!(
                "secrets: sealed with the device key ({key}): {} sealed",
                n("sealed")
            )),
            None => out.push_str(&format!(
                "secrets: NOT sealed, no device key ([seal] key_file or the edgehub-seal-key \
                 credential): {} Secrets and tokens on flash in the clear",
                n("clear")
            )),
        }
        if n("unreadable") > 0 {
            out.push_str(&format!(
                ", {} unreadable (sealed with another key; fetched again once online)",
                n("unreadable")
            ));
        }
        out.push('\n');
    }
    identity_text(&v["identity"], &mut out);
    let ob = &v["outbox"];
    if ob.is_object() {
        let parked = ob["parked"].as_array().cloned().unwrap_or_default();
        out.push_str(&format!(
            "outbox: {} queued, {} parked\n",
            ob["queued"].as_u64().unwrap_or(0),
            parked.len()
        ));
        for p in parked {
            out.push_str(&format!(
                "parked: {} {}/{} after {} attempts: {}\n",
                p["kind"].as_str().unwrap_or("-"),
                p["namespace"].as_str().unwrap_or("-"),
                p["name"].as_str().unwrap_or("-"),
                p["attempts"],
                p["error"].as_str().unwrap_or("-"),
            ));
        }
    }
    let active = v["activeRequests"].as_array().cloned().unwrap_or_default();
    if active.is_empty() {
        out.push_str("active: none\n");
    }
    for r in active {
        out.push_str(&format!(
            "active: {} {}/{} {} -> {} [{}] (request {})\n",
            r["kind"].as_str().unwrap_or("-"),
            r["namespace"].as_str().unwrap_or("-"),
            r["name"].as_str().unwrap_or("-"),
            r["from"].as_str().unwrap_or("-"),
            r["to"].as_str().unwrap_or("-"),
            r["state"].as_str().unwrap_or("-"),
            r["id"],
        ));
        if let Some(w) = r["waiting"].as_str() {
            out.push_str(&format!("        waiting: {w}\n"));
        }
    }
    Ok(out)
}

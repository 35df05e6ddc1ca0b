//! The transaction commands (`upgrade --manual-commit`, `commit`, `rollback`, `transactions`):
//! the contract the OTA manager integrations rely on (docs/api.md, "Transactions"). The
//! transaction id alone on stdout's first line; progress and reasons on stderr; exit 0 only
//! when the transaction is where the command was asked to bring it.

use anyhow::{bail, Context};
use edgehub::local_client::txn as out;
use edgehub::local_client::LocalClient;
use serde_json::Value;
use std::time::{Duration, Instant};

use super::local_cmds::{forbidden, local_client, privileged_client};
use super::Cli;

/// How long a wait keeps asking an API that does not answer (edgehub restarting after a crash
/// or a power cut) before it gives up.
const UNREACHABLE_FOR: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(250);

fn answer_json(status: u16, body: &str, what: &str) -> anyhow::Result<Value> {
    if status != 200 && status != 201 {
        bail!("{what}: {} ({status})", body.trim());
    }
    serde_json::from_str(body).with_context(|| format!("{what}: the answer is not JSON"))
}

/// Reads the transaction until `done` says where it ended (Ok: where it was asked to go, Err:
/// elsewhere), printing each change on stderr. An API that does not answer is asked again
/// for a while: edgehub may be restarting.
fn follow(
    client: &LocalClient,
    id: &str,
    done: impl Fn(&str) -> Option<bool>,
) -> anyhow::Result<Value> {
    let path = format!("/v1/transactions/{id}");
    let mut last = String::new();
    let mut unreachable_since: Option<Instant> = None;
    loop {
        let a = match client.get(&path) {
            Ok(a) => {
                unreachable_since = None;
                a
            }
            Err(e) => {
                let since = *unreachable_since.get_or_insert_with(Instant::now);
                if since.elapsed() > UNREACHABLE_FOR {
                    return Err(e.into());
                }
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        let t = answer_json(a.status, &a.body, &format!("GET {path}"))?;
        let line = out::progress(&t);
        if line != last {
            eprintln!("{line}");
            last = line;
        }
        let state = t["state"].as_str().unwrap_or("?").to_string();
        match done(&state) {
            Some(true) => return Ok(t),
            Some(false) => bail!("transaction {id} ended {state}: {}", out::why(&t)),
            None => std::thread::sleep(POLL),
        }
    }
}

/// `edgehub upgrade NS/POD[@REV]... --manual-commit [--timeout D] [--wait]`.
pub fn start(cli: &Cli, pods: &[String], wait: bool, timeout: Option<&str>) -> anyhow::Result<()> {
    let body = out::start_body(pods, timeout).map_err(anyhow::Error::msg)?;
    let client = privileged_client(cli)?;
    let a = client.post_body("/v1/transactions", body.as_bytes())?;
    if a.status == 403 && a.body.starts_with("Forbidden") {
        return Err(forbidden("edgehub upgrade --manual-commit", &a, &client));
    }
    let t = answer_json(a.status, &a.body, "the transaction was refused")?;
    let id = t["id"]
        .as_str()
        .context("the answer has no id")?
        .to_string();
    println!("{id}");
    if !wait {
        return Ok(());
    }
    follow(&client, &id, |state| match state {
        "Verified" => Some(true),
        // Committed by the manager before this wait saw Verified: it got where it was asked.
        "Committing" | "Committed" => Some(true),
        // Ended otherwise, once the old revisions run again.
        "RolledBack" | "Failed" => Some(false),
        _ => None,
    })?;
    Ok(())
}

/// `edgehub commit ID`: waits until every pod is Done; a committed transaction is success.
pub fn commit(cli: &Cli, id: &str) -> anyhow::Result<()> {
    out::check_id(id).map_err(anyhow::Error::msg)?;
    let client = privileged_client(cli)?;
    let a = client.post(&format!("/v1/transactions/{id}/commit"))?;
    if a.status == 403 {
        return Err(forbidden("edgehub commit", &a, &client));
    }
    answer_json(a.status, &a.body, &format!("commit {id}"))?;
    follow(&client, id, |state| match state {
        "Committed" => Some(true),
        "RolledBack" | "Failed" => Some(false),
        _ => None,
    })?;
    println!("{id} Committed");
    Ok(())
}

/// `edgehub rollback ID [--reason TEXT]`: waits until every pod runs its old revision again;
/// a rolled-back transaction is success, one that ended Failed is not.
pub fn rollback(cli: &Cli, id: &str, reason: Option<&str>) -> anyhow::Result<()> {
    out::check_id(id).map_err(anyhow::Error::msg)?;
    let client = privileged_client(cli)?;
    let body = out::rollback_body(reason);
    let a = client.post_body(&format!("/v1/transactions/{id}/rollback"), body.as_bytes())?;
    if a.status == 403 {
        return Err(forbidden("edgehub rollback", &a, &client));
    }
    answer_json(a.status, &a.body, &format!("rollback {id}"))?;
    follow(&client, id, |state| match state {
        "RolledBack" => Some(true),
        "Failed" | "Committed" => Some(false),
        _ => None,
    })?;
    println!("{id} RolledBack");
    Ok(())
}

/// `edgehub transactions [ID] [--json]`.
pub fn show(cli: &Cli, id: Option<&str>, json: bool) -> anyhow::Result<()> {
    let path = match id {
        Some(id) => {
            out::check_id(id).map_err(anyhow::Error::msg)?;
            format!("/v1/transactions/{id}")
        }
        None => "/v1/transactions".to_string(),
    };
    let a = local_client(cli)?.get(&path)?;
    if a.status != 200 {
        bail!("GET {path}: {} ({})", a.body.trim(), a.status);
    }
    let text = match (json, id) {
        (true, _) => format!("{}\n", a.body.trim()),
        (false, Some(_)) => out::details(&a.body).map_err(anyhow::Error::msg)?,
        (false, None) => out::table(&a.body).map_err(anyhow::Error::msg)?,
    };
    print!("{text}");
    Ok(())
}

//! The crash sweep over a transaction's side effects: edgehub is killed (SIGKILL, as a power
//! cut would) before and after every side effect of a commit and of a rollback from Verified,
//! in place and recreate, and of the commit deadline; the OTA manager's command (edgehub's own
//! CLI) is asked again after the restart, as the manager would after a crash, and must succeed;
//! then the transaction ends where it was decided, exactly one revision runs in one sandbox,
//! and the report is queued. Needs root, real containerd and the fake apiserver.

mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/txn.rs"]
mod txn;

use edge::{node, Node};
use edgehub::cri::{api, labels};
use std::time::{Duration, Instant};

const POD: &str = "vehicle/telemetry-sv74m";
const REASON: &str = "the crash sweep rolls it back";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decide {
    Commit,
    Rollback,
    /// Nobody decides: the deadline (3 s) rolls it back.
    Deadline,
}

fn add_env(spec: &mut serde_json::Value) {
    let app = &mut spec["containers"][0];
    if !app["env"].is_array() {
        app["env"] = serde_json::json!([]);
    }
    app["env"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"name": "LEVEL", "value": "debug"}));
}

/// The manager's command for `decide`, run to its end (it waits for the transaction).
async fn decide(n: &Node, id: &str, d: Decide) -> txn::Ran {
    match d {
        Decide::Commit => txn::cli(n, &["commit", id]).await,
        Decide::Rollback => txn::cli(n, &["rollback", id, "--reason", REASON]).await,
        Decide::Deadline => unreachable!("nobody decides"),
    }
}

/// Whether edgehub was killed by its failpoint (and reaps it).
fn killed(n: &mut Node) -> bool {
    use std::os::unix::process::ExitStatusExt;
    match n.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
        Some(status) => {
            assert_eq!(status.signal(), Some(9), "killed by SIGKILL");
            n.child = None;
            true
        }
        None => false,
    }
}

async fn crash_at(point: &'static str, recreate: bool, d: Decide) {
    let short: String = point
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect::<String>()
        .to_lowercase()
        .replace("upgrade", "")
        .replace("transaction", "t");
    let tag = format!(
        "tc{}{}{short}",
        if recreate { "r" } else { "" },
        match d {
            Decide::Commit => "c",
            Decide::Rollback => "b",
            Decide::Deadline => "d",
        }
    );
    let mut n = node(&tag).await;
    if recreate {
        n.edited_and_offline(add_env).await;
    } else {
        n.rolled_and_offline().await;
    }
    n.kill9();
    n.start_with(Some(point));
    n.wait_for(30, "the API is up", |n| async move {
        n.http("GET", "/v1/healthz").0 == 200
    })
    .await;
    let timeout: &[&str] = if d == Decide::Deadline {
        &["--timeout", "3s"]
    } else {
        &[]
    };
    let (id, ran) = txn::start(&n, &[POD], timeout).await;
    let id = id.unwrap_or_else(|| panic!("{point}: {}\n{}", ran.stderr, n.log()));
    // Decide once Verified; the failpoint kills edgehub somewhere on the way.
    let mut decision: Option<tokio::task::JoinHandle<txn::Ran>> = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !killed(&mut n) {
        assert!(
            Instant::now() < deadline,
            "{point} ({d:?}, recreate {recreate}) was never reached\n{}",
            n.log()
        );
        if d != Decide::Deadline && decision.is_none() {
            let verified = txn::get(&n, &id).is_some_and(|t| t["state"] == "Verified");
            if verified {
                let (cfg, id) = (n.config.clone(), id.clone());
                decision = Some(tokio::spawn(async move {
                    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_edgehub"));
                    cmd.arg("--config").arg(cfg);
                    match d {
                        Decide::Commit => cmd.args(["commit", &id]),
                        _ => cmd.args(["rollback", &id, "--reason", REASON]),
                    };
                    tokio::task::spawn_blocking(move || cmd.output().unwrap().into())
                        .await
                        .unwrap()
                }));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Power back.
    n.start();
    n.wait_for(30, "the API is up again", |n| async move {
        n.http("GET", "/v1/healthz").0 == 200
    })
    .await;
    let want = if d == Decide::Commit {
        "Committed"
    } else {
        "RolledBack"
    };
    if d != Decide::Deadline {
        // The manager's command of before the crash either waited through it or failed; the
        // manager asks again either way, and that succeeds.
        if let Some(first) = decision {
            let first = first.await.unwrap();
            if !first.ok {
                println!(
                    "{point}: the first {d:?} failed as edgehub died: {}",
                    first.stderr.trim()
                );
            }
        } else {
            txn::wait(&n, &id, 90, &["Verified", "RolledBack", "Failed"]).await;
        }
        let again = decide(&n, &id, d).await;
        assert!(
            again.ok,
            "{point}: asked again: {}\n{}",
            again.stderr,
            n.log()
        );
    }
    let t = txn::wait(&n, &id, 90, &["Committed", "RolledBack", "Failed"]).await;
    assert_eq!(t["state"], want, "{point}: {t}\n{}", n.log());
    // Exactly one revision runs, the transaction's, in one sandbox.
    n.wait_for(
        30,
        "one running container per name, one sandbox",
        |n| async move {
            let all = n.containers().await;
            ["app", "sidecar"].iter().all(|name| {
                let mine: Vec<_> = all
                    .iter()
                    .filter(|c| {
                        c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
                            && c.state == api::ContainerState::ContainerRunning as i32
                    })
                    .collect();
                mine.len() == 1
            }) && n.sandboxes().await.len() == 1
        },
    )
    .await;
    let (image, app) = txn::app(&n).await;
    let env = n.env_of(&app).await;
    match (want, recreate) {
        ("Committed", false) => assert_eq!(image, n.image("2.0"), "{point}"),
        ("Committed", true) => assert!(env.contains("LEVEL=debug"), "{point}: the new spec"),
        (_, _) => {
            assert_eq!(image, n.image("1.0"), "{point}");
            assert!(!env.contains("LEVEL=debug"), "{point}: the old spec");
        }
    }
    if want == "RolledBack" {
        let left = n
            .containers()
            .await
            .into_iter()
            .filter(|c| c.labels.contains_key(labels::UPGRADE_ID))
            .count();
        assert_eq!(left, 0, "{point}: nothing the upgrade made is left");
    }
    let events = txn::queued_events(&n);
    let reported = match d {
        Decide::Commit => events.iter().any(|(r, _)| r == "UpgradeSucceeded"),
        Decide::Rollback => events
            .iter()
            .any(|(r, m)| r == "UpgradeRolledBack" && m.contains(REASON)),
        Decide::Deadline => events
            .iter()
            .any(|(r, m)| r == "UpgradeRolledBack" && m.contains("not committed within 3s")),
    };
    assert!(reported, "{point}: the report is queued: {events:?}");
    if d != Decide::Commit {
        assert!(
            !events.iter().any(|(r, _)| r == "UpgradeSucceeded"),
            "{point}"
        );
    }
    n.clean().await;
}

/// Runs a crash point per entry, three at a time; returns how many ran.
async fn sweep(points: &[(&'static str, bool, Decide)]) -> usize {
    for chunk in points.chunks(3) {
        let mut set = tokio::task::JoinSet::new();
        for (p, r, d) in chunk {
            set.spawn(crash_at(p, *r, *d));
        }
        while let Some(r) = set.join_next().await {
            if let Err(e) = r {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }
    points.len()
}

/// The commit: the decision's write (before and after), and every step after it, in place and
/// recreate (where the old pod's containers stop and its sandbox stays until the commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_any_point_of_a_commit_ends_committed_in_one_revision() {
    use Decide::Commit;
    let points = [
        ("transaction:before:commit", false, Commit),
        ("transaction:after:commit", false, Commit),
        ("upgrade:after:Verified", false, Commit),
        ("upgrade:after:Committed", false, Commit),
        ("upgrade:before:RemoveOld", false, Commit),
        ("upgrade:step:RemoveOld", false, Commit),
        ("upgrade:after:Done", false, Commit),
        ("upgrade:before:StopContainers", true, Commit),
        ("upgrade:step:StopContainers", true, Commit),
        ("upgrade:after:Verified", true, Commit),
        ("transaction:after:commit", true, Commit),
        ("upgrade:after:Committed", true, Commit),
        ("upgrade:before:RemovePod", true, Commit),
        ("upgrade:step:RemovePod", true, Commit),
        ("upgrade:after:Done", true, Commit),
    ];
    let n = sweep(&points).await;
    println!("crash points covered on the way to Committed: {n}");
}

/// The rollback from Verified: the decision's write, and every step that brings the old
/// revision back, in place and into the kept sandbox of a recreate; and the deadline's own
/// decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_any_point_of_a_rollback_from_verified_ends_in_the_old_revision() {
    use Decide::{Deadline, Rollback};
    let points = [
        ("transaction:before:rollback", false, Rollback),
        ("transaction:after:rollback", false, Rollback),
        ("upgrade:after:RollingBack", false, Rollback),
        ("upgrade:before:StopNew", false, Rollback),
        ("upgrade:step:StopNew", false, Rollback),
        ("upgrade:before:RemoveNew", false, Rollback),
        ("upgrade:step:RemoveNew", false, Rollback),
        ("upgrade:before:RestoreOld", false, Rollback),
        ("upgrade:step:RestoreOld", false, Rollback),
        ("upgrade:after:RolledBack", false, Rollback),
        ("transaction:after:rollback", true, Rollback),
        ("upgrade:after:RollingBack", true, Rollback),
        ("upgrade:before:RemovePod", true, Rollback),
        ("upgrade:step:RemovePod", true, Rollback),
        ("upgrade:before:RestoreOld", true, Rollback),
        ("upgrade:step:RestoreOld", true, Rollback),
        ("upgrade:after:RolledBack", true, Rollback),
        ("transaction:after:deadline", false, Deadline),
    ];
    let n = sweep(&points).await;
    println!("crash points covered on the way back from Verified: {n}");
}

//! The quickstart cannot rot: this runs `scripts/demo.sh` itself (debug build, its own work
//! directory, the suite's CRI stack) and checks the lines a newcomer is told to look for:
//! the pods running, `PodNeedUpgrade=True` with the link down, the upgrade accepted offline,
//! `edgehub logs` offline, the restart served from the cache, and the report when the link
//! returns. Needs root and containerd;
//! without them this fails, loudly.

mod common;

use std::process::Command;

/// The demo's output split at its `==> ` headings: (heading, the lines under it).
fn sections(out: &str) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = Vec::new();
    for line in out.lines() {
        if let Some(h) = line.strip_prefix("==> ") {
            v.push((h.to_string(), String::new()));
        } else if let Some((_, body)) = v.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    v
}

/// The body of the first section whose heading starts with `heading`.
fn section<'a>(all: &'a [(String, String)], heading: &str, out: &str) -> &'a str {
    all.iter()
        .find(|(h, _)| h.starts_with(heading))
        .map(|(_, b)| b.as_str())
        .unwrap_or_else(|| panic!("no section {heading:?} in the demo's output:\n{out}"))
}

/// The row of `pod` in an `edgehub pods` table.
fn row<'a>(table: &'a str, pod: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.starts_with(pod))
        .unwrap_or_else(|| panic!("no row for {pod} in:\n{table}"))
}

#[test]
fn the_demo_runs_and_shows_the_main_job() {
    // The demo starts the stack itself when it is not running; starting it first makes sure
    // the demo leaves it running for the rest of the suite.
    let socket = common::cri_stack();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/demo.sh"))
        .env("EDGEHUB_DEMO_PROFILE", "dev")
        .env("EDGEHUB_DEMO_DIR", dir.path().join("demo"))
        .output()
        .expect("bash runs scripts/demo.sh");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // The demo's pods ran in the shared containerd; they must not outlive the test.
    remove_pods_of_node(&socket, "edge-1");
    assert!(
        out.status.success(),
        "scripts/demo.sh failed:\n{stdout}\n{stderr}"
    );
    let all = sections(&stdout);

    // The pods run in containerd, and their containers write logs.
    let logs = section(&all, "the pods run in containerd", &stdout);
    for pod in ["telemetry-sv74m", "gateway-v9hb2"] {
        assert!(
            logs.contains(&format!("vehicle/{pod} app: hello")),
            "{pod} logs:\n{logs}"
        );
    }
    let rolled = section(&all, "waiting for the operator", &stdout);
    assert!(
        rolled.contains("operator rolled DaemonSet vehicle/telemetry"),
        "{rolled}"
    );
    assert!(
        row(rolled, "vehicle/gateway-v9hb2").ends_with("Running"),
        "{rolled}"
    );
    let telemetry = row(rolled, "vehicle/telemetry-sv74m");
    assert!(
        telemetry.contains("True (NewRevisionAvailable)") && telemetry.ends_with("Running"),
        "{rolled}"
    );

    // Offline: PodNeedUpgrade=True from the cache, logs, and the upgrade accepted.
    let pods = section(&all, "OTA manager: curl http://", &stdout);
    assert!(
        pods.contains(r#"{"type":"PodNeedUpgrade","status":"True","reason":"NewRevisionAvailable","message":"controllerrevision: 55778fbb9f"}"#),
        "{pods}"
    );
    let offline_logs = section(&all, "edgehub logs works offline", &stdout);
    // log() prints a blank line before each heading.
    assert_eq!(offline_logs.trim_end(), "hello\nhello");
    let upgrade = section(&all, "OTA manager: curl -X POST", &stdout);
    assert!(
        upgrade.contains("Start updating pod vehicle/telemetry-sv74m  (HTTP 200)"),
        "{upgrade}"
    );
    assert!(
        upgrade.contains("Pod is not-updatable: RunningLatestRevision  (HTTP 403)"),
        "{upgrade}"
    );

    // The upgrade runs offline, in place, and its journal shows each state.
    let journal = section(&all, "the upgrade runs offline", &stdout);
    assert!(journal.contains(r#""state":"Done""#), "{journal}");
    let mut at = 0;
    for state in ["Pulling", "Swapping", "Verifying", "Committed", "Done"] {
        let i = journal[at..]
            .find(state)
            .unwrap_or_else(|| panic!("{state} missing or out of order:\n{journal}"));
        at += i + state.len();
    }
    let after = section(&all, "after the upgrade", &stdout);
    assert!(
        row(after, "vehicle/telemetry-sv74m").contains("55778fbb9f")
            && row(after, "vehicle/telemetry-sv74m").contains("False (RunningLatestRevision)"),
        "{after}"
    );
    assert!(
        after.contains("telemetry-sv74m app 127.0.0.1:5000/busybox:2.0 running"),
        "{after}"
    );
    assert!(
        after.contains("hello"),
        "the new container's output:\n{after}"
    );
    assert!(after.contains("link:   Offline"), "{after}");
    assert!(after.contains("active: none"), "{after}");

    // The restart with the link still down serves the cache at once.
    let restart = section(&all, "edgehub restarts with the link still down", &stdout);
    assert!(
        row(restart, "vehicle/telemetry-sv74m").contains("False (RunningLatestRevision)"),
        "the upgrade survives the restart:\n{restart}"
    );
    assert!(
        row(restart, "vehicle/gateway-v9hb2").contains("6c4d5f8b7c"),
        "{restart}"
    );
    assert!(restart.contains("link:   Offline"), "{restart}");
    assert!(
        restart.contains("cache:  2 pods, 2 DaemonSets, 3 ControllerRevisions, 1 nodes"),
        "{restart}"
    );
    // The link returns: the cloud gets the new revision by delete-and-adopt, with the
    // device's status and the upgrade's Events, and the container was not restarted.
    let report = section(&all, "the link returns", &stdout);
    assert!(
        report.contains("DaemonSet controller: vehicle/telemetry-sv74m deleted; created vehicle/telemetry-r0001 at revision 55778fbb9f"),
        "{report}"
    );
    let cloud = report
        .lines()
        .find(|l| {
            l.starts_with(
                "telemetry-r0001 revision 55778fbb9f app 127.0.0.1:5000/busybox:2.0 ready ",
            )
        })
        .unwrap_or_else(|| {
            panic!("the replacement in the cloud, reporting the new image:\n{report}")
        });
    assert!(
        report.contains("telemetry-sv74m UpgradeStarted count 1")
            && report.contains("telemetry-sv74m UpgradeSucceeded count 1"),
        "{report}"
    );
    let container = cloud.rsplit(' ').next().unwrap_or("");
    assert!(
        !container.is_empty()
            && report.contains(&format!(
                "telemetry-r0001 app 127.0.0.1:5000/busybox:2.0 running {container}"
            ))
            && after.contains(&format!(
                "telemetry-sv74m app 127.0.0.1:5000/busybox:2.0 running {container}"
            )),
        "the same container before and after the report:\n{after}\n{report}"
    );
    assert!(report.contains("link:   Online"), "{report}");

    // The work directory is the one asked for (the demo prints it resolved).
    let last = stdout.trim_end().lines().last().unwrap_or("");
    assert!(
        last.starts_with("==> done; logs and database are in ") && last.ends_with("/demo/"),
        "{stdout}"
    );
}

fn remove_pods_of_node(socket: &std::path::Path, node: &str) {
    use edgehub::cri::{labels, CriClient, CriRuntime};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = CriClient::new(socket);
        let mine = std::collections::HashMap::from([(labels::NODE.to_string(), node.to_string())]);
        for sb in c.list_pod_sandbox(mine).await.unwrap_or_default() {
            let _ = c.stop_pod_sandbox(&sb.id).await;
            let _ = c.remove_pod_sandbox(&sb.id).await;
        }
    });
}

//! Idle CPU (needs root and the containerd test stack): `edgehub run` (the binary devices run)
//! with the two recorded DaemonSet pods (`telemetry` and `gateway`: two containers each, a
//! ConfigMap, the projected token, an exec readiness probe every 2 s), online against the
//! fake apiserver with the recorded DaemonSets and ControllerRevisions, settled and Ready.
//! Then, over `EDGEHUB_IDLE_WINDOWS` windows (3) of 60 s each, the CPU time the process used:
//! utime + stime of /proc/PID/stat (clock ticks, 10 ms here), with each thread's share from
//! /proc/PID/task/*/stat, so a regression says whether the tokio workers or the blocking
//! pool (SQLite, file I/O) burn it.
//!
//! A year of a vehicle idling is where this matters: on a gateway every tenth of a CPU second
//! per minute is 53 CPU minutes a year. The same two pods beside the stock kubelet were 0.57 s
//! per minute for the kubelet (issue 20).
//!
//! `EDGEHUB_IDLE_CONFIG` is appended to edgehub's config (TOML), to see what a part costs:
//! `EDGEHUB_IDLE_CONFIG=$'[upgrade]\nprepull = false'` leaves the pre-pull check out.
//!
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//! Run: `bash cross/build.sh && cargo bench --bench idle` (or set `EDGEHUB_BENCH_BIN`).

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use edgehub::cri::{labels, CriClient, CriRuntime};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use support::{metric, Edge};

const WINDOW: Duration = Duration::from_secs(60);

fn ready(server: &edgehub_testsupport::FakeApiServer, name: &str) -> bool {
    server.get("pods", "vehicle", name).is_some_and(|p| {
        p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// Context switches (voluntary and not) of the live threads of `pid`, summed: each is a
/// wake-up or a preemption, so it counts the idle process's work without the VM's speed in it
/// (the CPU time of the same work varied threefold on one VM in one day). Threads that exit in
/// between (the blocking pool's, after 10 s idle) take theirs with them.
fn context_switches(pid: u32) -> u64 {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    rd.flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

/// CPU ticks (utime + stime) of each thread of `pid`, by thread name.
fn thread_ticks(pid: u32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in rd.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        if let Some((name, ticks)) = support::stat_name_ticks(&stat) {
            *out.entry(name).or_default() += ticks;
        }
    }
    out
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "idle CPU benchmark: run with `cargo bench --bench idle` (root, containerd test stack)"
        );
        return;
    }
    let Some(bin) = support::edgehub_bin() else {
        return;
    };
    let windows: usize = std::env::var("EDGEHUB_IDLE_WINDOWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let hz = support::clock_ticks_per_sec();
    println!(
        "binary: {}; {windows} windows of {} s",
        bin.display(),
        WINDOW.as_secs()
    );
    let socket = common::cri_stack();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let server = support::recorded_server().await;
        let node = format!("idle-cpu-{}", std::process::id());
        let pods = ["telemetry-sv74m", "gateway-v9hb2"];
        for (i, name) in pods.iter().enumerate() {
            server.modify("pods", "vehicle", name, |p| {
                p["spec"]["nodeName"] = json!(node);
                p["metadata"]["uid"] = json!(format!("{node}-{i}"));
            });
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let extra = std::env::var("EDGEHUB_IDLE_CONFIG").unwrap_or_default();
        if !extra.is_empty() {
            println!("config added: {extra:?}");
        }
        let mut e = Edge::prepare(&server, &bin, dir.path(), &node, &socket, &extra);
        e.start(&[]);
        if !support::wait_for(120, || pods.iter().all(|p| ready(&server, p))).await {
            println!(
                "pods not Ready after 120 s; see {}",
                dir.path().join("edgehub.log").display()
            );
        } else {
            // Settled: the first status reports are sent, the sources and tokens cached.
            tokio::time::sleep(Duration::from_secs(20)).await;
            let pid = e.pid();
            server.clear_log();
            let mut per_thread: BTreeMap<String, u64> = BTreeMap::new();
            for w in 0..windows {
                let (t0, before) = (Instant::now(), thread_ticks(pid));
                let start = support::cpu_ticks(pid).unwrap_or(0);
                let switches = context_switches(pid);
                tokio::time::sleep(WINDOW).await;
                let used = support::cpu_ticks(pid).unwrap_or(0).saturating_sub(start);
                let switches = context_switches(pid).saturating_sub(switches);
                let secs = used as f64 / hz;
                let per_minute = secs * 60.0 / t0.elapsed().as_secs_f64();
                for (name, ticks) in thread_ticks(pid) {
                    let d = ticks.saturating_sub(before.get(&name).copied().unwrap_or(0));
                    *per_thread.entry(name).or_default() += d;
                }
                let switches_per_minute = switches as f64 * 60.0 / t0.elapsed().as_secs_f64();
                println!(
                    "  window {}: {used} ticks, {secs:.2} CPU s in {:.0} s ({per_minute:.3} s per minute), {switches} context switches",
                    w + 1,
                    t0.elapsed().as_secs_f64()
                );
                metric("idle_cpu_s_per_minute_2_probed_pods", per_minute, "s");
                metric(
                    "idle_context_switches_per_minute_2_probed_pods",
                    switches_per_minute,
                    "",
                );
            }
            println!("  by thread over all windows (CPU s):");
            for (name, ticks) in per_thread.iter().filter(|(_, t)| **t > 0) {
                println!("    {name:<20} {:.2}", *ticks as f64 / hz);
            }
            println!(
                "  apiserver requests meanwhile: {:?}",
                server.count_by_verb()
            );
        }
        e.stop();
        let cri = CriClient::new(&socket);
        for sb in cri
            .list_pod_sandbox(HashMap::from([(labels::NODE.to_string(), node.clone())]))
            .await
            .unwrap_or_default()
        {
            let _ = cri.stop_pod_sandbox(&sb.id).await;
            let _ = cri.remove_pod_sandbox(&sb.id).await;
        }
        // The token volumes are tmpfs mounts under the data dir: the temporary directory
        // cannot go while they are mounted.
        for (i, _) in pods.iter().enumerate() {
            let pod_dir = dir.path().join("data/pods").join(format!("{node}-{i}"));
            let _ = edgehub::volumes::remove_pod_dir(&pod_dir);
        }
    });
}

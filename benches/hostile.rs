//! What hostile or careless callers cost a running release edgehub (issue 31), one section
//! each. Needs root and the CRI test stack (scripts/cri-stack.sh), as the node's pod runs in
//! the shared containerd.
//!
//! Sections:
//! - `imagepull_flash`: flash bytes for 300 identical `POST .../imagepull` once the pre-pull
//!   is done (budget: under 64 KiB). An OTA manager may ask on every poll; each ask used to
//!   reopen the request and the engine to close it again, about 37 KB of WAL a time.
//! - `archive_rss`: edgehub's peak RSS (`VmHWM`) while it refuses the three hostile image
//!   archives (a GNU long name and a PAX header each declaring 1 GiB, 1 GiB of gzipped
//!   zeros; about 1 MiB each on the wire), POSTed to `/v1/images/load` (budget: within
//!   32 MiB of idle). The tar reader used to buffer the long name whole: 1 GiB and more.
//! - `silent_connections`: the apiserver's `GET /containerLogs` on the node API (10250),
//!   answered with 0 and with 64 TCP connections opened and left silent, as any pod that
//!   reaches the node's address can hold them. They used to take the 32 slots before TLS,
//!   for up to the idle timeout: no answer at all.
//!
//! A section is an `async fn(&mut Bench)` that prints its numbers and `METRIC` lines; add one
//! to [`SECTIONS`] (and to the list above). Prints numbers; asserts nothing about time.
//! Run: `cargo bench --bench hostile` (one section: `cargo bench --bench hostile -- NAME`).

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/edge.rs"]
mod edge;
#[path = "../tests/common/node_api.rs"]
mod node_api;
mod support;

use serde_json::Value;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::time::{Duration, Instant};
use support::{io_write_bytes, metric};

/// What the sections share (more as sections need it).
struct Bench {
    /// Sections named on the command line; empty: all.
    only: Vec<String>,
}

type Section = for<'a> fn(&'a mut Bench) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

/// The sections, in the order they run.
const SECTIONS: &[(&str, Section)] = &[
    ("imagepull_flash", |b| Box::pin(imagepull_flash(b))),
    ("archive_rss", |b| Box::pin(archive_rss(b))),
    ("silent_connections", |b| Box::pin(silent_connections(b))),
];

/// Identical asks measured, and the budget of their writes.
const PULLS: usize = 300;
const PULL_BUDGET_BYTES: u64 = 64 << 10;

/// Bytes of the store's database and WAL.
fn store_bytes(data: &Path) -> u64 {
    ["edgehub.db", "edgehub.db-wal"]
        .iter()
        .filter_map(|f| std::fs::metadata(data.join(f)).ok())
        .map(|m| m.len())
        .sum()
}

/// `write_bytes` of edgehub over a window, with the store's and the log's growth beside it.
struct Written {
    io: u64,
    store: i64,
    log: i64,
}

async fn written_during<F: Future<Output = ()>>(n: &edge::Node, work: F) -> Written {
    let pid = n.child.as_ref().map(|c| c.id()).unwrap_or(0);
    let data = n.dir.path().join("data");
    let log = n.dir.path().join("edgehub.log");
    let log_len = || std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    let (io0, store0, log0) = (
        io_write_bytes(pid).unwrap_or(0),
        store_bytes(&data),
        log_len(),
    );
    work.await;
    // Time for the upgrade engine to have picked up and closed a request, had one been
    // recorded, and for SQLite's writes to have reached the page cache.
    tokio::time::sleep(Duration::from_secs(3)).await;
    Written {
        io: io_write_bytes(pid).unwrap_or(0).saturating_sub(io0),
        store: store_bytes(&data) as i64 - store0 as i64,
        log: log_len() as i64 - log0 as i64,
    }
}

/// 300 identical `POST .../imagepull` against a node whose pod needs revision 2, the
/// pre-pull of which is done (its images are on the node), with the apiserver link cut so
/// that nothing else writes; beside it, an idle window as long.
async fn imagepull_flash(_: &mut Bench) {
    let mut n = edge::node("hostile-pull").await;
    // Warnings only: an info line per request would be log bytes, not the store's.
    n.edit_config(|c| format!("log = \"warn\"\n{c}"));
    n.rolled_and_offline().await;
    let path = "/openyurt.io/v1/namespaces/vehicle/pods/telemetry-sv74m/imagepull";
    let first = Instant::now();
    while n.http("POST", path).0 != 200 {
        if first.elapsed() > Duration::from_secs(60) {
            println!(
                "imagepull_flash: the first pre-pull was never accepted\n{}",
                n.log()
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let done = |n: &edge::Node| {
        let (code, body) = n.http("GET", "/v1/status");
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        code == 200
            && v["activeRequests"]
                .as_array()
                .is_some_and(|a| a.iter().all(|r| r["kind"] != "imagepull"))
    };
    if !support::wait_for(120, || done(&n)).await {
        println!(
            "imagepull_flash: the pre-pull did not end within 120 s\n{}",
            n.log()
        );
        return;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    let t = Instant::now();
    let mut codes = std::collections::BTreeMap::<u16, usize>::new();
    let asked = written_during(&n, async {
        for _ in 0..PULLS {
            *codes.entry(n.http("POST", path).0).or_default() += 1;
        }
    })
    .await;
    let took = t.elapsed();
    let idle = written_during(&n, tokio::time::sleep(took)).await;

    let kib = |b: u64| b as f64 / 1024.0;
    println!(
        "imagepull_flash: {PULLS} identical POST .../imagepull after the pre-pull was done, \
         in {:.1} s (answers {codes:?})",
        took.as_secs_f64()
    );
    println!(
        "  written (write_bytes of /proc/PID/io): {} B ({:.1} KiB, {:.0} B a request); budget {} KiB: {}",
        asked.io,
        kib(asked.io),
        asked.io as f64 / PULLS as f64,
        PULL_BUDGET_BYTES >> 10,
        if asked.io < PULL_BUDGET_BYTES { "ok" } else { "OVER" }
    );
    println!(
        "  store (database + WAL) grew {} B, the log {} B",
        asked.store, asked.log
    );
    println!(
        "  idle for as long, for comparison: {} B written, store grew {} B",
        idle.io, idle.store
    );
    metric("hostile_imagepull_300_write_bytes", asked.io as f64, "B");
    metric(
        "hostile_imagepull_300_store_growth_bytes",
        asked.store as f64,
        "B",
    );
    n.clean().await;
}

/// The peak resident memory of process `pid` (`VmHWM`), in bytes; 0 when unreadable.
fn peak_rss(pid: u32) -> u64 {
    support::proc_status_kib(pid, "VmHWM").unwrap_or(0) << 10
}

const ARCHIVE_RSS_BUDGET: u64 = 32 << 20;

async fn archive_rss(_: &mut Bench) {
    let mut n = edge::node("hostile-rss").await;
    // No pod to run: the memory measured is edgehub's own.
    n.server.remove("pods", "vehicle", "telemetry-sv74m");
    n.edit_config(|c| format!("log = \"warn\"\n{c}"));
    n.start();
    if !support::wait_for(30, || n.http("GET", "/v1/images").0 == 200).await {
        println!("archive_rss: the local API never came up\n{}", n.log());
        return;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = n.child.as_ref().map(|c| c.id()).unwrap_or(0);
    let idle = peak_rss(pid);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("archive_rss: peak RSS idle {:.1} MiB", mib(idle));
    let mut worst = idle;
    for (what, bytes) in edgehub_testsupport::hostile_archive::all(1 << 30) {
        let t = Instant::now();
        let code = n.post_on_socket("/v1/images/load?force=true", &bytes).0;
        let peak = peak_rss(pid);
        worst = worst.max(peak);
        println!(
            "  {what}: {} KiB on the wire, 1 GiB declared: {code} in {:.0} ms; peak RSS {:.1} MiB",
            bytes.len() >> 10,
            t.elapsed().as_secs_f64() * 1000.0,
            mib(peak)
        );
    }
    println!(
        "  worst peak {:.1} MiB, {:.1} MiB over idle; budget {} MiB over idle: {}",
        mib(worst),
        mib(worst - idle),
        ARCHIVE_RSS_BUDGET >> 20,
        if worst - idle < ARCHIVE_RSS_BUDGET {
            "ok"
        } else {
            "OVER"
        }
    );
    metric("hostile_archive_peak_rss_mib", mib(worst), "MiB");
    metric(
        "hostile_archive_rss_over_idle_mib",
        mib(worst - idle),
        "MiB",
    );
    n.clean().await;
}

/// Silent connections held while the apiserver asks.
const SILENT: usize = 64;
/// Requests timed in each phase.
const ASKS: usize = 20;

async fn silent_connections(_: &mut Bench) {
    let s = match edgehub_testsupport::FakeApiServer::start().await {
        Ok(s) => s,
        Err(e) => {
            println!("silent_connections: no fake apiserver: {e}");
            return;
        }
    };
    let node = format!("edge-silent-{}", std::process::id());
    let pod = node_api::talker(
        &node,
        "vehicle",
        &format!("silent-{}", std::process::id()),
        "echo one; while true; do sleep 1; echo tick; done",
    );
    let run = node_api::start_served(&s, &node, &[pod]).await;
    let Ok(client) = edgehub_testsupport::hostile::apiserver_client(&s.pki) else {
        println!("silent_connections: no kubelet client");
        return;
    };
    let addr = run.node_api;
    let path = "/containerLogs/vehicle/talker/app?tailLines=1";
    let ask = || edgehub_testsupport::hostile::get(&client, addr, path, Duration::from_secs(10));
    // The container's first line: the route answers 200 from here on.
    let first = Instant::now();
    while !matches!(ask().await, Ok((200, ref b)) if !b.is_empty()) {
        if first.elapsed() > Duration::from_secs(60) {
            println!("silent_connections: no log line within 60 s");
            return;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let phase = |held: usize| {
        let ask = &ask;
        async move {
            let conns = if held > 0 {
                edgehub_testsupport::hostile::silent_connections(addr, held)
                    .await
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            let mut ms = Vec::with_capacity(ASKS);
            let mut failed = 0;
            for _ in 0..ASKS {
                let t = Instant::now();
                match tokio::time::timeout(Duration::from_secs(20), ask()).await {
                    Ok(Ok((200, _))) => ms.push(t.elapsed().as_secs_f64() * 1000.0),
                    _ => failed += 1,
                }
            }
            drop(conns);
            ms.sort_by(f64::total_cmp);
            (ms, failed)
        }
    };
    let pct = |v: &[f64], p: f64| {
        if v.is_empty() {
            f64::NAN
        } else {
            v[((v.len() as f64 - 1.0) * p).round() as usize]
        }
    };
    let (calm, calm_failed) = phase(0).await;
    let (held, held_failed) = phase(SILENT).await;
    println!(
        "silent_connections: the apiserver's GET /containerLogs on a new TLS connection, {ASKS} times"
    );
    println!(
        "  none held: median {:.1} ms, max {:.1} ms, {calm_failed} unanswered",
        pct(&calm, 0.5),
        pct(&calm, 1.0)
    );
    println!(
        "  {SILENT} silent TCP connections held: median {:.1} ms, max {:.1} ms, {held_failed} unanswered (20 s each)",
        pct(&held, 0.5),
        pct(&held, 1.0)
    );
    metric("hostile_silent_logs_median_ms", pct(&held, 0.5), "ms");
    metric("hostile_silent_logs_unanswered", held_failed as f64, "");
    drop(run);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; anything else names sections.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut b = Bench { only };
    for (name, run) in SECTIONS {
        if b.only.is_empty() || b.only.iter().any(|o| o == name) {
            run(&mut b).await;
        }
    }
}

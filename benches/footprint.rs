//! The device's footprint, measured on the binary the devices run (the static musl build by
//! default; see `support::edgehub_bin`):
//! - idle RSS of `edgehub run` with 0, 100 and 1000 pods cached, the runtime absent (real
//!   containers would measure containerd's shims, not edgehub), after the initial list, the
//!   pods' ConfigMaps and tokens fetched and 12 s of quiet (longer than tokio's 10 s keep-alive
//!   of idle blocking threads); beside it the peak (VmHWM) and the thread count;
//! - cold start, offline: from exec to `GET /v1/readyz` answering 200 with 100 pods cached (a
//!   data dir an online run filled), the apiserver refusing connections and containerd (the
//!   test stack's, needed: readyz asks the runtime) answering.
//!
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//! Run: `bash cross/build.sh && cargo bench --bench footprint` (root, containerd test stack
//! for the cold start).

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use edgehub::cri::{labels, CriClient, CriRuntime};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use support::{metric, Edge};

/// The pods' cursor key (`sync::pods_cursor_key`): present once the first pod list completed.
fn pods_listed(e: &Edge) -> bool {
    support::query_count(
        &e.db(),
        "SELECT count(*) FROM sync_cursors WHERE resource = ?1",
        &edgehub::sync::pods_cursor_key(&e.name),
    ) > 0
}

fn tokens(e: &Edge) -> i64 {
    support::query_count(
        &e.db(),
        "SELECT count(*) FROM sa_tokens WHERE pod_uid LIKE ?1",
        "%",
    )
}

struct Idle {
    pods: usize,
    rss: u64,
    /// RssAnon (heap, stacks, SQLite's cache) and RssFile (the binary's pages touched).
    anon: u64,
    file: u64,
    hwm: u64,
    threads: u64,
}

/// How long the process idles before its RSS is read: 12 s, or `EDGEHUB_FOOTPRINT_IDLE_SECS`
/// (a longer quiet shows whether timers that fire every few minutes, such as the periodic
/// report and image GC, bring more of the binary back in).
fn idle_secs() -> u64 {
    support::env_or("EDGEHUB_FOOTPRINT_IDLE_SECS", 12)
}

/// `edgehub run` with `pods` pods, runtime absent: RSS once it has listed, fetched and idled.
async fn idle_rss(bin: &Path, pods: usize) -> Option<Idle> {
    let server = support::recorded_server().await;
    let name = format!("idle-{pods}");
    support::seed_pods(&server, &name, pods);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut e = Edge::prepare(
        &server,
        bin,
        dir.path(),
        &name,
        &dir.path().join("no-runtime.sock"),
        "",
    );
    e.start(&[]);
    let settled = support::wait_for(180, || {
        pods_listed(&e) && e.cached("Pod") == pods as i64 && tokens(&e) == pods as i64
    })
    .await;
    if !settled {
        println!(
            "  {pods} pods: not settled after 180 s ({} cached, {} tokens)",
            e.cached("Pod"),
            tokens(&e)
        );
        return None;
    }
    tokio::time::sleep(Duration::from_secs(idle_secs())).await;
    let pid = e.pid();
    if std::env::var_os("EDGEHUB_FOOTPRINT_SMAPS").is_some() {
        print_smaps(pid, pods);
    }
    let idle = Idle {
        pods,
        rss: support::proc_status_kib(pid, "VmRSS")?,
        anon: support::proc_status_kib(pid, "RssAnon")?,
        file: support::proc_status_kib(pid, "RssFile")?,
        hwm: support::proc_status_kib(pid, "VmHWM")?,
        threads: support::threads(pid)?,
    };
    e.stop();
    Some(idle)
}

/// Each mapping's resident KiB, largest first (`EDGEHUB_FOOTPRINT_SMAPS=1`): where the
/// anonymous memory is (the heap, thread stacks, musl's mmapped blocks) and how much of
/// each segment of the binary is mapped in.
fn print_smaps(pid: u32, pods: usize) {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return;
    };
    let mut maps: Vec<(u64, String)> = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            let rest: Vec<&str> = line.split_whitespace().skip(1).collect();
            let name = rest.get(4).copied().unwrap_or("[anon]");
            current = format!("{first} {} {name}", rest.first().copied().unwrap_or(""));
        } else if first == "Rss:" {
            let kib = words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            maps.push((kib, current.clone()));
        }
    }
    maps.sort_by_key(|m| std::cmp::Reverse(m.0));
    println!("  smaps, {pods} pods (resident KiB, mapping):");
    for (kib, m) in maps.iter().filter(|(k, _)| *k > 0) {
        println!("    {kib:>6} {m}");
    }
}

/// Fills a data dir with an online run (100 pods, their sources), stops it, takes the link
/// away, then times exec -> readyz 200 `rounds` times on that data dir.
async fn cold_start(bin: &Path, socket: &Path, pods: usize, rounds: usize) -> Vec<f64> {
    let server = support::recorded_server().await;
    let name = format!("cold-{}", std::process::id());
    support::seed_pods(&server, &name, pods);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut e = Edge::prepare(
        &server,
        bin,
        dir.path(),
        &name,
        &dir.path().join("no-runtime.sock"),
        "",
    );
    e.start(&[]);
    let filled = support::wait_for(120, || {
        pods_listed(&e) && e.cached("Pod") == pods as i64 && tokens(&e) == pods as i64
    })
    .await;
    e.stop();
    if !filled {
        println!("  cold start: the online run did not fill the cache in 120 s");
        return vec![];
    }
    server.set_offline(true).await.expect("offline");
    // The same data dir, now with containerd: readyz needs the runtime to answer.
    let mut e = Edge::prepare(&server, bin, dir.path(), &name, socket, "");
    let cri = CriClient::new(socket);
    let mut out = Vec::new();
    for round in 0..rounds {
        let t = e.start(&[]);
        let mut ready = None;
        while t.elapsed() < Duration::from_secs(30) {
            let (code, body) = e.http("GET", "/v1/readyz");
            if code == 200 {
                ready = Some((t.elapsed(), body));
                break;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        let served = e.http("GET", "/pods");
        e.stop();
        // It began starting the cached pods; they are not what is measured.
        for sb in cri
            .list_pod_sandbox(HashMap::from([(labels::NODE.to_string(), name.clone())]))
            .await
            .unwrap_or_default()
        {
            let _ = cri.stop_pod_sandbox(&sb.id).await;
            let _ = cri.remove_pod_sandbox(&sb.id).await;
        }
        match ready {
            Some((d, body)) => {
                let items = serde_json::from_str::<serde_json::Value>(&served.1)
                    .ok()
                    .and_then(|v| v["items"].as_array().map(Vec::len))
                    .unwrap_or(0);
                println!(
                    "  cold start {round}: readyz {} after {:.1} ms ({:?}); GET /pods then served {items} pods",
                    200,
                    d.as_secs_f64() * 1000.0,
                    body.trim()
                );
                out.push(d.as_secs_f64() * 1000.0);
            }
            None => println!("  cold start {round}: readyz not 200 after 30 s"),
        }
    }
    out
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("footprint benchmark: run with `cargo bench --bench footprint` (root, containerd test stack)");
        return;
    }
    let Some(bin) = support::edgehub_bin() else {
        return;
    };
    println!("binary: {}", bin.display());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        // The three sizes side by side: RSS does not depend on the neighbours, and it saves
        // two thirds of the wait.
        // `EDGEHUB_FOOTPRINT_PODS=100` measures one size only (and skips the cold start).
        let only: Option<usize> = std::env::var("EDGEHUB_FOOTPRINT_PODS")
            .ok()
            .and_then(|v| v.parse().ok());
        let size = |n: usize| only.is_none_or(|o| o == n);
        let (a, b, c) = tokio::join!(
            async { if size(0) { idle_rss(&bin, 0).await } else { None } },
            async { if size(100) { idle_rss(&bin, 100).await } else { None } },
            async { if size(1000) { idle_rss(&bin, 1000).await } else { None } }
        );
        for idle in [a, b, c].into_iter().flatten() {
            println!(
                "edgehub run idle, {} pods cached (runtime absent): VmRSS {} KiB ({} anonymous, {} of the binary), peak {} KiB, {} threads",
                idle.pods, idle.rss, idle.anon, idle.file, idle.hwm, idle.threads
            );
            metric(
                &format!("rss_anon_kib_{}_pods", idle.pods),
                idle.anon as f64,
                "KiB",
            );
            metric(
                &format!("rss_file_kib_{}_pods", idle.pods),
                idle.file as f64,
                "KiB",
            );
            metric(
                &format!("rss_idle_kib_{}_pods", idle.pods),
                idle.rss as f64,
                "KiB",
            );
            metric(
                &format!("rss_peak_kib_{}_pods", idle.pods),
                idle.hwm as f64,
                "KiB",
            );
            metric(
                &format!("threads_idle_{}_pods", idle.pods),
                idle.threads as f64,
                "",
            );
        }

        if only.is_some() {
            return;
        }
        let socket = common::cri_stack();
        let pods = 100;
        // `EDGEHUB_FOOTPRINT_ROUNDS`: how many cold starts (5); cross/profile-hot.sh runs one.
        let rounds = support::env_or("EDGEHUB_FOOTPRINT_ROUNDS", 5) as usize;
        let ms = cold_start(&bin, &socket, pods, rounds).await;
        if !ms.is_empty() {
            println!(
                "cold start, offline, {pods} pods cached: exec -> readyz 200 median {:.1} ms over {} (all: {:.1?})",
                support::median(ms.clone()),
                ms.len(),
                ms
            );
            metric(
                "cold_start_offline_ms_100_pods",
                support::median(ms),
                "ms",
            );
        }
    });
}

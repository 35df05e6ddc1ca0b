//! Flash writes at steady state (needs root and the containerd test stack): `edgehub run` (the
//! binary devices run) with 5 running pods, each with a readiness and a liveness probe (exec,
//! every 5 and 10 s), a ConfigMap and a service-account token; the fake apiserver sends a
//! bookmark about every minute as a real one does (47 s, see below), and edgehub renews its
//! Lease every 10 s and reports Node status every 5 minutes (the shipped defaults).
//!
//! What writes at steady state comes in events further apart than any window a bench can
//! wait out: a cursor checkpoint every `cursor_checkpoint_secs` (3600 s shipped) and a round
//! of token renewals every 48 minutes (80 % of the usual 3607 s). So the bench makes both
//! happen inside its window, and counts what each costs:
//! - the cursor checkpoint every 120 s instead of 3600;
//! - tokens of 600 s (the API's shortest) instead of 3607, 1.1 KB long as real bound JWTs
//!   are, for pods started in two groups 30 s apart, so their renewals must merge;
//!
//! and samples, every 100 ms over the window (until 30 s after the token round, about 8
//! minutes; at most 10, `EDGEHUB_FLASH_WINDOW_SECS`), the `write_bytes` of /proc/PID/io (the
//! pages edgehub dirtied, file system metadata included: what reaches storage) and the size
//! of the database and its WAL. Writes that come with TokenRequests are the token round's, a
//! WAL that grew otherwise is a checkpoint's, the rest is the steady background. The hour at
//! the shipped cadence is then `background × 3600 / window + round × 3600 / (0.8 × 3607 s)`:
//! a round carries the parked cursors and restarts the checkpoint interval, and comes before
//! that interval (3600 s) is out. Without tokens it is `background + checkpoint × 1`.
//!
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//! Run: `bash cross/build.sh && cargo bench --bench flash`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use edgehub::cri::{labels, CriClient, CriRuntime};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use support::{metric, Edge};

const PODS: usize = 5;
/// The shipped cadence the hour is computed for.
const SHIPPED_CHECKPOINT_SECS: f64 = 3600.0;
const SHIPPED_TOKEN_SECS: f64 = 3607.0;
/// The bench's own, so that each happens inside the window.
const BENCH_CHECKPOINT_SECS: u64 = 120;
const BENCH_TOKEN_SECS: u64 = 600;
/// A real bound service-account token (a signed JWT) is about this long.
const TOKEN_BYTES: usize = 1100;
const BOOKMARK_SECS: u64 = 47;

/// One sample of the window (every 100 ms: a checkpoint and a token round can come within a
/// second of each other, both being due on a minute's tick).
struct Sample {
    at: Instant,
    written: u64,
    db: u64,
}

/// What the window's writes were, by cause.
#[derive(Default, Debug)]
struct Attributed {
    checkpoints: usize,
    checkpoint_bytes: u64,
    checkpoint_growth: u64,
    rounds: usize,
    round_bytes: u64,
    round_growth: u64,
    other_bytes: u64,
    other_growth: u64,
}

/// Sorts each sample's writes: with a TokenRequest in it (or in the 2 s before it) they are
/// a token round's; else, when the database grew, a commit's (at steady state, only the
/// cursor checkpoint commits); else background. A round is one run of such samples.
fn attribute(samples: &[Sample], token_requests: &[Instant]) -> Attributed {
    let mut a = Attributed::default();
    let mut in_round = false;
    for w in samples.windows(2) {
        let (prev, cur) = (&w[0], &w[1]);
        let bytes = cur.written.saturating_sub(prev.written);
        let growth = cur.db.saturating_sub(prev.db);
        let from = prev
            .at
            .checked_sub(Duration::from_secs(2))
            .unwrap_or(prev.at);
        let tokens = token_requests.iter().any(|t| *t > from && *t <= cur.at);
        if tokens {
            if !in_round {
                a.rounds += 1;
            }
            a.round_bytes += bytes;
            a.round_growth += growth;
        } else if growth > 0 {
            a.checkpoints += 1;
            a.checkpoint_bytes += bytes;
            a.checkpoint_growth += growth;
        } else {
            a.other_bytes += bytes;
            a.other_growth += growth;
        }
        in_round = tokens;
    }
    a
}

fn pod(node: &str, i: usize) -> serde_json::Value {
    json!({
        "metadata": {"name": format!("flash-{i}"), "namespace": "bench", "uid": format!("{node}-{i}"),
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds", "controller": true}]},
        "spec": {"nodeName": node, "hostNetwork": true, "terminationGracePeriodSeconds": 0,
            "volumes": [
                {"name": "cfg", "configMap": {"name": format!("cfg-{i}")}},
                {"name": "kube-api-access", "projected": {"sources": [
                    {"serviceAccountToken": {"expirationSeconds": BENCH_TOKEN_SECS, "path": "token"}}]}}],
            "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0",
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "touch /tmp/ready; while true; do sleep 1; done"],
                "readinessProbe": {"exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 5},
                "livenessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 10}}]},
        "status": {"phase": "Pending"},
    })
}

/// Bytes of the files under `dir`, leaving out the containers' logs (`pods/<uid>/logs`).
fn tree_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() && p.file_name().is_some_and(|n| n == "logs") => 0,
                Ok(t) if t.is_dir() => tree_bytes(&p),
                Ok(_) => e.metadata().map(|m| m.len()).unwrap_or(0),
                Err(_) => 0,
            }
        })
        .sum()
}

fn db_bytes(data: &Path) -> u64 {
    ["edgehub.db", "edgehub.db-wal"]
        .iter()
        .map(|f| {
            std::fs::metadata(data.join(f))
                .map(|m| m.len())
                .unwrap_or(0)
        })
        .sum()
}

fn ready(server: &edgehub_testsupport::FakeApiServer, name: &str) -> bool {
    server.get("pods", "bench", name).is_some_and(|p| {
        p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "flash benchmark: run with `cargo bench --bench flash` (root, containerd test stack)"
        );
        return;
    }
    let Some(bin) = support::edgehub_bin() else {
        return;
    };
    let window = Duration::from_secs(
        std::env::var("EDGEHUB_FLASH_WINDOW_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(600),
    );
    println!("binary: {}; window {} s", bin.display(), window.as_secs());
    let socket = common::cri_stack();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let server = support::recorded_server().await;
        server.set_token_len(TOKEN_BYTES);
        // Bookmarks every 47 s, not 60: the fetcher's pass runs on a minute's tick from the
        // start, and a checkpoint a bookmark sets off on the same tick lands in the same
        // 100 ms as the token round, which then looked twice its cost.
        server.set_bookmark_interval(Duration::from_secs(BOOKMARK_SECS));
        let node = format!("flash-{}", std::process::id());
        for i in 0..PODS {
            server.apply(
                "configmaps",
                json!({"metadata": {"name": format!("cfg-{i}"), "namespace": "bench"}, "data": {"k": "v"}}),
            );
        }
        // Two groups 30 s apart: their tokens fall due apart, and must merge.
        let first = 3;
        for i in 0..first {
            server.apply("pods", pod(&node, i));
        }
        let dir = tempfile::tempdir().expect("tempdir");
        // With a device key, as the README asks a device to have, so the hour counts what
        // sealing the tokens costs; EDGEHUB_FLASH_SEAL=0 runs without one, for comparison
        // (benches/seal.rs isolates the store's part).
        let seal = if std::env::var("EDGEHUB_FLASH_SEAL").as_deref() == Ok("0") {
            println!("no device key (EDGEHUB_FLASH_SEAL=0): tokens in the clear");
            String::new()
        } else {
            let key = dir.path().join("seal.key");
            std::fs::write(&key, [0x5au8; 32]).expect("key file");
            std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .expect("key mode");
            format!("[seal]\nkey_file = \"{}\"\n", key.display())
        };
        let mut e = Edge::prepare(
            &server,
            &bin,
            dir.path(),
            &node,
            &socket,
            &format!("[sync]\ncursor_checkpoint_secs = {BENCH_CHECKPOINT_SECS}\n{seal}"),
        );
        let started = e.start(&[]);
        let all_ready = |n: usize| (0..n).all(|i| ready(&server, &format!("flash-{i}")));
        let mut ok = support::wait_for(120, || all_ready(first)).await;
        if ok {
            tokio::time::sleep(Duration::from_secs(30).saturating_sub(started.elapsed())).await;
            for i in first..PODS {
                server.apply("pods", pod(&node, i));
            }
            ok = support::wait_for(120, || all_ready(PODS)).await;
        }
        if !ok {
            println!("pods not Ready after 120 s; see {}", dir.path().join("edgehub.log").display());
        } else {
            // Settled: the first status reports and the sources are written.
            tokio::time::sleep(Duration::from_secs(20)).await;
            let data = dir.path().join("data");
            let pid = e.pid();
            let tree0 = tree_bytes(&data);
            server.clear_log();
            let t = Instant::now();
            let mut samples = Vec::new();
            // Until the window is over, or 30 s after the token round (the window's purpose
            // is the round; what else writes is sampled on the way).
            let tokens_sent = || server.count(|r| r.resource == "serviceaccounts/token");
            let mut round_seen: Option<(usize, Instant)> = None;
            while t.elapsed() < window && round_seen.is_none_or(|(_, at)| at.elapsed() < Duration::from_secs(30)) {
                if let Some(written) = support::io_write_bytes(pid) {
                    samples.push(Sample { at: Instant::now(), written, db: db_bytes(&data) });
                }
                let n = tokens_sent();
                if n > round_seen.map_or(0, |(seen, _)| seen) {
                    round_seen = Some((n, Instant::now()));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let secs = t.elapsed().as_secs_f64();
            let grown = tree_bytes(&data).saturating_sub(tree0);
            let log = server.requests();
            let token_requests: Vec<Instant> = log
                .iter()
                .filter(|r| r.resource == "serviceaccounts/token")
                .map(|r| r.at)
                .collect();
            let a = attribute(&samples, &token_requests);
            let total = match (samples.first(), samples.last()) {
                (Some(f), Some(l)) => l.written.saturating_sub(f.written),
                _ => 0,
            };
            let per = |bytes: u64, n: usize| if n == 0 { 0.0 } else { bytes as f64 / n as f64 };
            let checkpoint = per(a.checkpoint_bytes, a.checkpoints);
            let round = per(a.round_bytes, a.rounds);
            let kib = |b: f64| b / 1024.0;
            // A round carries the parked cursors and restarts the checkpoint interval; at the
            // shipped cadence one comes every 0.8 × 3607 s, before the 3600 s interval is out,
            // so no checkpoint is written on its own. Without tokens (pods that do not mount
            // one), one is, every interval.
            let rounds_per_hour = 3600.0 / (0.8 * SHIPPED_TOKEN_SECS);
            let lone_checkpoints_per_hour = if 0.8 * SHIPPED_TOKEN_SECS < SHIPPED_CHECKPOINT_SECS {
                0.0
            } else {
                3600.0 / SHIPPED_CHECKPOINT_SECS
            };
            let hour = |other: u64, ckpt: f64, round: f64| {
                other as f64 * 3600.0 / secs
                    + ckpt * lone_checkpoints_per_hour
                    + round * rounds_per_hour
            };
            let per_hour = hour(a.other_bytes, checkpoint, round);
            let growth_per_hour = hour(
                a.other_growth,
                per(a.checkpoint_growth, a.checkpoints),
                per(a.round_growth, a.rounds),
            );
            let per_hour_no_tokens =
                a.other_bytes as f64 * 3600.0 / secs + checkpoint * 3600.0 / SHIPPED_CHECKPOINT_SECS;
            println!(
                "steady state, {PODS} pods with probes, over {secs:.0} s: write_bytes {total} B (data dir grew {grown} B)"
            );
            println!(
                "  cursor checkpoints (every {BENCH_CHECKPOINT_SECS} s here): {} of {:.1} KiB each",
                a.checkpoints,
                kib(checkpoint)
            );
            println!(
                "  token rounds ({BENCH_TOKEN_SECS} s tokens here): {} round(s), {} TokenRequests, {:.1} KiB per round",
                a.rounds,
                token_requests.len(),
                kib(round)
            );
            println!(
                "  everything else: {} B in the window ({:.1} KiB/h)",
                a.other_bytes,
                kib(a.other_bytes as f64 * 3600.0 / secs)
            );
            println!(
                "  per hour at the shipped cadence (3607 s tokens renewed at 80 %, each round carrying the cursors; a checkpoint on its own every {SHIPPED_CHECKPOINT_SECS:.0} s when no round comes): {:.1} KiB written, {:.1} KiB of growth; without tokens {:.1} KiB written (budget 100 KiB/h)",
                kib(per_hour),
                kib(growth_per_hour),
                kib(per_hour_no_tokens)
            );
            let by_verb = server.count_by_verb();
            println!("  apiserver requests in the window: {by_verb:?}");
            metric("flash_write_kib_per_hour", kib(per_hour), "KiB/h");
            metric("flash_write_kib_per_hour_no_tokens", kib(per_hour_no_tokens), "KiB/h");
            metric("flash_growth_kib_per_hour", kib(growth_per_hour), "KiB/h");
            metric("flash_write_bytes_per_cursor_checkpoint", checkpoint, "B");
            metric(&format!("flash_write_bytes_per_token_round_{PODS}_pods"), round, "B");
            metric("flash_write_kib_per_hour_background", kib(a.other_bytes as f64 * 3600.0 / secs), "KiB/h");
            metric("flash_token_rounds_window", a.rounds as f64, "");
            // Requests an idle device sends, at the shipped token lifetime.
            let tokens = token_requests.len() as f64;
            let others = by_verb.values().sum::<usize>() as f64 - tokens;
            let token_per_min = if a.rounds == 0 {
                0.0
            } else {
                tokens / a.rounds as f64 * 60.0 / (0.8 * SHIPPED_TOKEN_SECS)
            };
            metric("apiserver_requests_per_idle_minute", others * 60.0 / secs + token_per_min, "");
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
    });
}

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
//! Two devices run side by side, one with a device key (`[seal] key_file`: Secrets and tokens
//! sealed) and one without; `write_bytes` is per process, so neither counts the other's.
//! Each one's log reaches its file through a pipe the bench copies (a device logs to the
//! journal, not to a file of edgehub's), so edgehub's count is its own; the log's bytes are
//! printed beside it.
//!
//! Once both have settled, `EDGEHUB_FLASH_WINDOWS` (3) windows of `EDGEHUB_FLASH_WINDOW_SECS`
//! (600 s) each. Every 100 ms the bench samples each device's `write_bytes` of /proc/PID/io
//! (the pages edgehub dirtied, file system metadata included: what reaches storage) and the
//! size of its database and WAL. Writes that come with its TokenRequests are the token
//! round's, a WAL that grew otherwise is a checkpoint's, the rest is the steady background;
//! each write is listed with its time, so a log line at the same second says what it was.
//! The hour at the shipped cadence is then `background × 3600 / window + round × 3600 / (0.8
//! × 3607 s)`: a round carries the parked cursors and restarts the checkpoint interval, and
//! comes before that interval (3600 s) is out. Without tokens it is `background +
//! checkpoint × 1`. Each window gives its own hour; the median and the worst are the
//! figures.
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
    /// Of the bytes above, those written after the commit itself, within `TAIL` of it.
    checkpoint_tail: u64,
    round_tail: u64,
    other_bytes: u64,
    other_growth: u64,
}

/// How long after a commit its writes are still its own: the file system's metadata follows
/// the commit's fsync. Two later writes of a commit's are gone (50fc138, c30a779): the next
/// read moving the -shm read mark, and the next read of the WAL writing its access time,
/// each after the kernel had written the commit back (`dirty_expire_centisecs`, 30 s); they
/// came as lone 4 KiB writes 40-170 s after commits, which this bench counted as background.
const TAIL: Duration = Duration::from_secs(45);

/// Sorts each sample's writes: with a TokenRequest in it (or in the 2 s before it) they are
/// a token round's; else, when the database grew, a commit's (at steady state, only the
/// cursor checkpoint commits); writes within `TAIL` after either are that commit's tail;
/// the rest is background. A round is one run of samples with TokenRequests.
fn attribute(samples: &[Sample], token_requests: &[Instant]) -> Attributed {
    #[derive(Clone, Copy, PartialEq)]
    enum Owner {
        Round,
        Checkpoint,
    }
    let mut a = Attributed::default();
    let mut in_round = false;
    let mut last: Option<(Owner, Instant)> = None;
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
            last = Some((Owner::Round, cur.at));
        } else if growth > 0 {
            a.checkpoints += 1;
            a.checkpoint_bytes += bytes;
            a.checkpoint_growth += growth;
            last = Some((Owner::Checkpoint, cur.at));
        } else {
            match last.filter(|(_, at)| cur.at.duration_since(*at) < TAIL) {
                Some((Owner::Round, _)) => {
                    a.round_bytes += bytes;
                    a.round_tail += bytes;
                }
                Some((Owner::Checkpoint, _)) => {
                    a.checkpoint_bytes += bytes;
                    a.checkpoint_tail += bytes;
                }
                None => {
                    a.other_bytes += bytes;
                    a.other_growth += growth;
                }
            }
        }
        in_round = tokens;
    }
    a
}

fn pod_name(node: &str, i: usize) -> String {
    format!("{node}-{i}")
}

fn pod(node: &str, i: usize) -> serde_json::Value {
    json!({
        "metadata": {"name": pod_name(node, i), "namespace": "bench", "uid": format!("{node}-{i}"),
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

/// One device of the bench: its edgehub, and where its writes are read.
struct Device {
    label: &'static str,
    node: String,
    edge: Edge,
    data: std::path::PathBuf,
    log_bytes: std::sync::Arc<std::sync::atomic::AtomicU64>,
    _dir: tempfile::TempDir,
}

/// What one window measured on one device.
struct Window {
    secs: f64,
    total: u64,
    a: Attributed,
    token_requests: usize,
    log_bytes: u64,
}

/// Starts a device with `PODS` pods (two groups 30 s apart, so their tokens must merge),
/// and waits until all are Ready.
async fn device(
    server: &edgehub_testsupport::FakeApiServer,
    bin: &Path,
    socket: &Path,
    label: &'static str,
    keyed: bool,
) -> Option<Device> {
    let node = format!("flash-{label}-{}", std::process::id());
    for i in 0..PODS {
        server.apply(
            "configmaps",
            json!({"metadata": {"name": format!("cfg-{i}"), "namespace": "bench"}, "data": {"k": "v"}}),
        );
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let seal = if keyed {
        let key = dir.path().join("seal.key");
        std::fs::write(&key, [0x5au8; 32]).expect("key file");
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("key mode");
        format!("[seal]\nkey_file = \"{}\"\n", key.display())
    } else {
        String::new()
    };
    let mut edge = Edge::prepare(
        server,
        bin,
        dir.path(),
        &node,
        socket,
        &format!("[sync]\ncursor_checkpoint_secs = {BENCH_CHECKPOINT_SECS}\n{seal}"),
    );
    let log_bytes = edge.pipe_log();
    let first = 3;
    for i in 0..first {
        server.apply("pods", pod(&node, i));
    }
    // Debug level: each write can be matched with what edgehub did at that second. The log
    // goes through a pipe (`pipe_log`), so it is not counted as edgehub's writes.
    let started = edge.start(&[("EDGEHUB_LOG", "info,edgehub=debug")]);
    let all_ready = |n: usize| (0..n).all(|i| ready(server, &pod_name(&node, i)));
    let mut ok = support::wait_for(120, || all_ready(first)).await;
    if ok {
        tokio::time::sleep(Duration::from_secs(30).saturating_sub(started.elapsed())).await;
        for i in first..PODS {
            server.apply("pods", pod(&node, i));
        }
        ok = support::wait_for(120, || all_ready(PODS)).await;
    }
    if !ok {
        println!(
            "{label}: pods not Ready after 120 s; see {}",
            dir.path().join("edgehub.log").display()
        );
        return None;
    }
    let data = dir.path().join("data");
    Some(Device {
        label,
        node,
        edge,
        data,
        log_bytes,
        _dir: dir,
    })
}

fn kib(b: f64) -> f64 {
    b / 1024.0
}

/// The hour at the shipped cadence from one window's attribution; `round` is this window's
/// cost of a token round, or another window's when this one saw none.
fn hour(w: &Window, round: f64) -> (f64, f64) {
    let per = |bytes: u64, n: usize| if n == 0 { 0.0 } else { bytes as f64 / n as f64 };
    let checkpoint = per(w.a.checkpoint_bytes, w.a.checkpoints);
    // A round carries the parked cursors and restarts the checkpoint interval; at the shipped
    // cadence one comes every 0.8 × 3607 s, before the 3600 s interval is out, so no
    // checkpoint is written on its own. Without tokens (pods that do not mount one), one is,
    // every interval.
    let rounds_per_hour = 3600.0 / (0.8 * SHIPPED_TOKEN_SECS);
    let lone_checkpoints_per_hour = if 0.8 * SHIPPED_TOKEN_SECS < SHIPPED_CHECKPOINT_SECS {
        0.0
    } else {
        3600.0 / SHIPPED_CHECKPOINT_SECS
    };
    let background = w.a.other_bytes as f64 * 3600.0 / w.secs;
    let with_tokens = background + checkpoint * lone_checkpoints_per_hour + round * rounds_per_hour;
    let no_tokens = background + checkpoint * 3600.0 / SHIPPED_CHECKPOINT_SECS;
    (with_tokens, no_tokens)
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
    let env_u64 = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let window = Duration::from_secs(env_u64("EDGEHUB_FLASH_WINDOW_SECS", 600));
    let windows = env_u64("EDGEHUB_FLASH_WINDOWS", 3) as usize;
    println!(
        "binary: {}; {windows} windows of {} s",
        bin.display(),
        window.as_secs()
    );
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
        let (keyed, clear) = tokio::join!(
            device(&server, &bin, &socket, "key", true),
            device(&server, &bin, &socket, "no-key", false)
        );
        let mut devices: Vec<Device> = [keyed, clear].into_iter().flatten().collect();
        // Settled: the first status reports and the sources are written.
        tokio::time::sleep(Duration::from_secs(20)).await;
        let mut results: Vec<Vec<Window>> = devices.iter().map(|_| Vec::new()).collect();
        server.clear_log();
        for w in 0..windows {
            let t = Instant::now();
            println!(
                "window {} starts at {} (the edgehub logs' clock)",
                w + 1,
                edgehub::time::rfc3339_micros(std::time::SystemTime::now())
            );
            let logged: Vec<u64> = devices
                .iter()
                .map(|d| d.log_bytes.load(std::sync::atomic::Ordering::Relaxed))
                .collect();
            let mut samples: Vec<Vec<Sample>> = devices.iter().map(|_| Vec::new()).collect();
            while t.elapsed() < window {
                for (d, s) in devices.iter().zip(samples.iter_mut()) {
                    if let Some(written) = support::io_write_bytes(d.edge.pid()) {
                        s.push(Sample {
                            at: Instant::now(),
                            written,
                            db: db_bytes(&d.data),
                        });
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let secs = t.elapsed().as_secs_f64();
            let log = server.requests();
            for (i, d) in devices.iter().enumerate() {
                let user = format!("system:node:{}", d.node);
                let token_requests: Vec<Instant> = log
                    .iter()
                    .filter(|r| r.resource == "serviceaccounts/token" && r.at >= t)
                    .filter(|r| r.user.as_deref() == Some(user.as_str()))
                    .map(|r| r.at)
                    .collect();
                let s = &samples[i];
                let a = attribute(s, &token_requests);
                let total = match (s.first(), s.last()) {
                    (Some(f), Some(l)) => l.written.saturating_sub(f.written),
                    _ => 0,
                };
                println!(
                    "{} window {}: {total} B written in {secs:.0} s; {} checkpoint(s) ({} B, of which {} B within {} s after), {} token round(s) ({} TokenRequests; {} B, of which {} B after), background {} B",
                    d.label,
                    w + 1,
                    a.checkpoints,
                    a.checkpoint_bytes,
                    a.checkpoint_tail,
                    TAIL.as_secs(),
                    a.rounds,
                    token_requests.len(),
                    a.round_bytes,
                    a.round_tail,
                    a.other_bytes
                );
                // Every write, so that the edgehub log's line at that second names it.
                for pair in s.windows(2) {
                    let bytes = pair[1].written.saturating_sub(pair[0].written);
                    if bytes > 0 {
                        println!(
                            "    +{:>6.1} s  {bytes:>6} B written, database and WAL {:+} B",
                            pair[1].at.duration_since(t).as_secs_f64(),
                            pair[1].db as i64 - pair[0].db as i64
                        );
                    }
                }
                results[i].push(Window {
                    secs,
                    total,
                    a,
                    token_requests: token_requests.len(),
                    log_bytes: d
                        .log_bytes
                        .load(std::sync::atomic::Ordering::Relaxed)
                        .saturating_sub(logged[i]),
                });
            }
        }
        for (d, ws) in devices.iter().zip(&results) {
            let rounds: Vec<f64> = ws
                .iter()
                .filter(|w| w.a.rounds > 0)
                .map(|w| w.a.round_bytes as f64 / w.a.rounds as f64)
                .collect();
            let any_round = if rounds.is_empty() {
                0.0
            } else {
                support::median(rounds.clone())
            };
            let mut with_tokens = Vec::new();
            let mut no_tokens = Vec::new();
            for (n, w) in ws.iter().enumerate() {
                let round = if w.a.rounds > 0 {
                    w.a.round_bytes as f64 / w.a.rounds as f64
                } else {
                    any_round
                };
                let (h, h0) = hour(w, round);
                println!(
                    "{} window {}: {:.1} KiB/h at the shipped cadence with tokens, {:.1} KiB/h without (measured {:.1} KiB/h at the bench's cadence; round {:.1} KiB; background {:.1} KiB/h; {} TokenRequests; log {} B)",
                    d.label,
                    n + 1,
                    kib(h),
                    kib(h0),
                    kib(w.total as f64 * 3600.0 / w.secs),
                    kib(round),
                    kib(w.a.other_bytes as f64 * 3600.0 / w.secs),
                    w.token_requests,
                    w.log_bytes
                );
                with_tokens.push(kib(h));
                no_tokens.push(kib(h0));
            }
            let worst = |v: &[f64]| v.iter().cloned().fold(f64::NAN, f64::max);
            let suffix = if d.label == "key" { "_device_key" } else { "" };
            println!(
                "{}: median {:.1} KiB/h (worst {:.1}) with tokens, {:.1} KiB/h (worst {:.1}) without, over {} windows (budget 75 KiB/h)",
                d.label,
                support::median(with_tokens.clone()),
                worst(&with_tokens),
                support::median(no_tokens.clone()),
                worst(&no_tokens),
                ws.len()
            );
            for (h, h0) in with_tokens.iter().zip(&no_tokens) {
                metric(&format!("flash_write_kib_per_hour{suffix}"), *h, "KiB/h");
                metric(&format!("flash_write_kib_per_hour_no_tokens{suffix}"), *h0, "KiB/h");
            }
            metric(&format!("flash_write_kib_per_hour_worst{suffix}"), worst(&with_tokens), "KiB/h");
            for w in ws {
                let per = |bytes: u64, n: usize| if n == 0 { 0.0 } else { bytes as f64 / n as f64 };
                if w.a.checkpoints > 0 {
                    metric(
                        &format!("flash_write_bytes_per_cursor_checkpoint{suffix}"),
                        per(w.a.checkpoint_bytes, w.a.checkpoints),
                        "B",
                    );
                }
                if w.a.rounds > 0 {
                    metric(
                        &format!("flash_write_bytes_per_token_round_{PODS}_pods{suffix}"),
                        per(w.a.round_bytes, w.a.rounds),
                        "B",
                    );
                }
                metric(
                    &format!("flash_write_kib_per_hour_background{suffix}"),
                    kib(w.a.other_bytes as f64 * 3600.0 / w.secs),
                    "KiB/h",
                );
                metric(
                    &format!("flash_growth_kib_per_hour{suffix}"),
                    kib((w.a.other_growth + w.a.checkpoint_growth + w.a.round_growth) as f64 * 3600.0 / w.secs),
                    "KiB/h",
                );
            }
        }
        // Requests an idle device sends, at the shipped token lifetime (the device without a
        // key; both send the same).
        if let Some(d) = devices.iter().find(|d| d.label == "no-key") {
            let user = format!("system:node:{}", d.node);
            let log: Vec<_> = server
                .requests()
                .into_iter()
                .filter(|r| r.user.as_deref() == Some(user.as_str()))
                .collect();
            let secs = window.as_secs_f64() * windows as f64;
            let tokens = log.iter().filter(|r| r.resource == "serviceaccounts/token").count() as f64;
            let rounds: usize = results
                .iter()
                .zip(&devices)
                .filter(|(_, dd)| dd.label == "no-key")
                .flat_map(|(ws, _)| ws.iter().map(|w| w.a.rounds))
                .sum();
            let others = log.len() as f64 - tokens;
            let token_per_min = if rounds == 0 {
                0.0
            } else {
                tokens / rounds as f64 * 60.0 / (0.8 * SHIPPED_TOKEN_SECS)
            };
            let mut by_verb: std::collections::BTreeMap<(String, String), usize> = Default::default();
            for r in &log {
                *by_verb.entry((r.verb.to_string(), r.resource.clone())).or_insert(0) += 1;
            }
            println!("apiserver requests of the device without a key over the windows: {by_verb:?}");
            metric("apiserver_requests_per_idle_minute", others * 60.0 / secs + token_per_min, "");
        }
        let cri = CriClient::new(&socket);
        let keep = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
        let _ = std::fs::create_dir_all(&keep);
        for d in &mut devices {
            d.edge.stop();
            // The edgehub log (debug level), to match each listed write with what it was.
            let _ = std::fs::copy(
                d.edge.dir.join("edgehub.log"),
                keep.join(format!("flash-{}.log", d.label)),
            );
            for sb in cri
                .list_pod_sandbox(HashMap::from([(labels::NODE.to_string(), d.node.clone())]))
                .await
                .unwrap_or_default()
            {
                let _ = cri.stop_pod_sandbox(&sb.id).await;
                let _ = cri.remove_pod_sandbox(&sb.id).await;
            }
        }
    });
}

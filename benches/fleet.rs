//! A fleet reconnecting, as the apiserver sees it: 50 `edgehub run` processes (the runtime
//! absent, each with its own node name, token, data dir and two DaemonSet pods) against one
//! fake apiserver. Two cuts of the whole fleet's link:
//! - a short one (40 s, `EDGEHUB_FLEET_SHORT_CUT_SECS`), shorter than the apiserver's watch
//!   window, while every pod is modified: the requests each device sends in the 60 s after
//!   the restore, by verb, and the reconnect's own cost, which leaves out the Lease renewals
//!   after the first (a device renews every 10 s, link or no link). Every watch resumes from
//!   its cursor; that is the Lease renewal and the watches;
//! - a long one (2 minutes) while the cluster changes (the `telemetry` DaemonSet rolls: a new
//!   ControllerRevision and a modified DaemonSet; every pod is modified again), then
//!   restored. Counted at the server from the restore on: requests per device, LISTs among
//!   them, the peak requests per second, and when every device had caught up; the same minus
//!   what an idle fleet sends in as long (Lease renewals).
//!
//! Two fleets run side by side, one with the reflectors' reconnect jitter and one with it
//! turned off (`EDGEHUB_TEST_BACKOFF_JITTER=0`, a test-only knob, and the outbox's
//! `[report] reconnect_jitter_secs = 0`), each against its own apiserver, so the comparison
//! costs one window, not two.
//!
//! Knobs: `EDGEHUB_FLEET_DEVICES` (50), `EDGEHUB_FLEET_OFFLINE_SECS` (120),
//! `EDGEHUB_FLEET_SHORT_CUT_SECS` (40).
//! Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing about time.
//! Run: `bash cross/build.sh && cargo bench --bench fleet`.

mod support;

use edgehub_testsupport::FakeApiServer;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use support::{metric, Edge};

/// After the restore: longer than the reflectors' 60 s backoff cap, so every device has
/// retried once.
const AFTER: Duration = Duration::from_secs(80);
/// The idle window the Lease renewals are measured in, before the cut.
const IDLE: Duration = Duration::from_secs(20);
/// After the short cut's restore: what a reconnect costs is counted over this long.
const SHORT_AFTER: Duration = Duration::from_secs(60);

/// The short cut: requests in the `SHORT_AFTER` after the restore.
struct Reconnect {
    cut: Duration,
    devices: usize,
    total: usize,
    leases: usize,
    lists: usize,
    version_checks: usize,
    watches: usize,
    converged_s: Option<f64>,
    by_verb: BTreeMap<(String, String), usize>,
}

impl Reconnect {
    /// Per device, the reconnect's own requests: all of them but the Lease renewals after
    /// the first, which an idle device sends every 10 s anyway.
    fn own_per_device(&self) -> f64 {
        (self.total - self.leases) as f64 / self.devices as f64 + 1.0
    }
}

struct Outcome {
    reconnect: Option<Reconnect>,
    devices: usize,
    total: usize,
    idle_per_device: f64,
    lists: usize,
    peak_per_s: usize,
    peak_at_s: u64,
    converged_s: Option<f64>,
    by_verb: BTreeMap<(String, String), usize>,
    /// Requests per second over the window, for the printout.
    per_second: Vec<usize>,
}

/// A device has its two pods and the two revisions of the start.
fn synced(db: &Path) -> bool {
    support::count_rows(db, "Pod") == 2 && support::count_rows(db, "ControllerRevision") == 2
}

/// A device has what changed during the short cut: both pods modified.
fn caught_up_short(db: &Path) -> bool {
    support::query_count(
        db,
        "SELECT count(*) FROM objects WHERE kind = 'Pod' AND raw LIKE ?1",
        "%fleet/short%",
    ) == 2
}

/// A device has what changed during the cut: both pods modified, the third revision.
fn caught_up(db: &Path) -> bool {
    support::query_count(
        db,
        "SELECT count(*) FROM objects WHERE kind = 'Pod' AND raw LIKE ?1",
        "%fleet/changed%",
    ) == 2
        && support::count_rows(db, "ControllerRevision") == 3
}

/// Seconds until `done` held for every device's database, or `None` after `limit`. The
/// checks run off the runtime's worker threads, where the fake apiserver runs, every
/// 500 ms, and only for the devices not done yet: polling 50 databases every 50 ms on those
/// threads starved the apiserver, so a fleet on two loaded cores never finished starting.
async fn until_all(dbs: &[PathBuf], limit: Duration, done: fn(&Path) -> bool) -> Option<f64> {
    let start = Instant::now();
    let mut pending = dbs.to_vec();
    loop {
        let check = std::mem::take(&mut pending);
        pending =
            tokio::task::spawn_blocking(move || check.into_iter().filter(|d| !done(d)).collect())
                .await
                .expect("the poll task");
        if pending.is_empty() {
            return Some(start.elapsed().as_secs_f64());
        }
        if start.elapsed() >= limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn lease_of(server: &FakeApiServer, node: &str) -> bool {
    server.get("leases", "kube-node-lease", node).is_some()
}

/// The short cut: the link gone for `cut` while every pod is modified, then back; what the
/// fleet sends in the `SHORT_AFTER` after.
async fn short_cut(
    server: &FakeApiServer,
    names: &[String],
    dbs: &[PathBuf],
    cut: Duration,
) -> Reconnect {
    let started = Instant::now();
    server.set_offline(true).await.expect("offline");
    tokio::time::sleep(Duration::from_secs(2)).await;
    for n in names {
        for pod in [format!("telemetry-{n}"), format!("gateway-{n}")] {
            server.modify("pods", "vehicle", &pod, |p| {
                p["metadata"]["annotations"]["fleet/short"] = json!("1");
            });
        }
    }
    tokio::time::sleep(cut.saturating_sub(started.elapsed())).await;
    server.clear_log();
    server.set_offline(false).await.expect("online");
    let restored = Instant::now();
    let converged_s = until_all(dbs, SHORT_AFTER, caught_up_short).await;
    tokio::time::sleep(SHORT_AFTER.saturating_sub(restored.elapsed())).await;
    let log: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.at.saturating_duration_since(restored) < SHORT_AFTER)
        .collect();
    let mut by_verb = BTreeMap::new();
    for r in &log {
        *by_verb
            .entry((r.verb.to_string(), r.resource.clone()))
            .or_insert(0) += 1;
    }
    Reconnect {
        cut,
        devices: names.len(),
        total: log.len(),
        leases: log.iter().filter(|r| r.resource == "leases").count(),
        lists: log
            .iter()
            .filter(|r| r.verb == "list" && !r.query.contains_key("resourceVersionMatch"))
            .count(),
        version_checks: log
            .iter()
            .filter(|r| r.verb == "list" && r.query.contains_key("resourceVersionMatch"))
            .count(),
        watches: log.iter().filter(|r| r.is_watch()).count(),
        converged_s,
        by_verb,
    }
}

async fn fleet(
    bin: &Path,
    devices: usize,
    offline: Duration,
    short: Duration,
    jitter: bool,
) -> Option<Outcome> {
    let tag = if jitter { "j" } else { "s" };
    let server = support::recorded_server().await;
    let gateway = server
        .get("pods", "vehicle", "gateway-v9hb2")
        .expect("recorded gateway pod");
    let names: Vec<String> = (0..devices).map(|i| format!("fleet-{tag}{i:02}")).collect();
    for n in &names {
        server.apply(
            "pods",
            support::telemetry_pod(&server, n, &format!("telemetry-{n}"), &format!("t-{n}")),
        );
        let mut g = gateway.clone();
        g["metadata"]["name"] = json!(format!("gateway-{n}"));
        g["metadata"]["uid"] = json!(format!("g-{n}"));
        g["spec"]["nodeName"] = json!(n);
        server.apply("pods", g);
    }
    for name in ["telemetry-sv74m", "gateway-v9hb2"] {
        server.remove("pods", "vehicle", name);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("no-runtime.sock");
    // Without jitter: the reflectors' backoffs (a test-only knob) and the outbox's wait
    // before it drains (`[report] reconnect_jitter_secs`, 30 s by default).
    let (env, extra): (&[(&str, &str)], &str) = if jitter {
        (&[], "")
    } else {
        (
            &[("EDGEHUB_TEST_BACKOFF_JITTER", "0")],
            "[report]\nreconnect_jitter_secs = 0\n",
        )
    };
    let mut edges: Vec<Edge> = names
        .iter()
        .map(|n| Edge::prepare(&server, bin, &dir.path().join(n), n, &socket, extra))
        .collect();
    for e in &mut edges {
        e.start(env);
    }
    let dbs: Vec<PathBuf> = edges.iter().map(Edge::db).collect();
    let up = until_all(&dbs, Duration::from_secs(180), synced)
        .await
        .is_some()
        && support::wait_for(30, || names.iter().all(|n| lease_of(&server, n))).await;
    if !up {
        let behind: Vec<&str> = names
            .iter()
            .zip(&dbs)
            .filter(|(n, db)| !synced(db) || !lease_of(&server, n))
            .map(|(n, _)| n.as_str())
            .collect();
        println!(
            "  fleet ({tag}): {} of {devices} devices not synced after 180 s: {behind:?}",
            behind.len()
        );
        if let Some(n) = behind.first() {
            let log =
                std::fs::read_to_string(dir.path().join(n).join("edgehub.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            println!("  the last lines of {n}'s log:");
            for l in tail.iter().rev() {
                println!("    {l}");
            }
        }
        return None;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    server.clear_log();
    tokio::time::sleep(IDLE).await;
    let idle_per_device =
        server.requests().len() as f64 / devices as f64 * AFTER.as_secs_f64() / IDLE.as_secs_f64();
    let reconnect = if short.is_zero() {
        None
    } else {
        Some(short_cut(&server, &names, &dbs, short).await)
    };

    // The cut, and the cluster changing meanwhile.
    let cut = Instant::now();
    server.set_offline(true).await.expect("offline");
    tokio::time::sleep(Duration::from_secs(5)).await;
    server.roll_telemetry();
    for n in &names {
        for pod in [format!("telemetry-{n}"), format!("gateway-{n}")] {
            server.modify("pods", "vehicle", &pod, |p| {
                p["metadata"]["annotations"]["fleet/changed"] = json!("1");
            });
        }
    }
    tokio::time::sleep(offline.saturating_sub(cut.elapsed())).await;
    server.clear_log();
    server.set_offline(false).await.expect("online");
    let restored = Instant::now();
    let converged_s = until_all(&dbs, AFTER, caught_up).await;
    tokio::time::sleep(AFTER.saturating_sub(restored.elapsed())).await;
    let log = server.requests();
    for e in &mut edges {
        e.stop();
    }
    let mut per_second = vec![0usize; AFTER.as_secs() as usize + 1];
    for r in &log {
        let s = r.at.saturating_duration_since(restored).as_secs() as usize;
        if let Some(c) = per_second.get_mut(s) {
            *c += 1;
        }
    }
    let (peak_at_s, peak_per_s) = per_second
        .iter()
        .enumerate()
        .max_by_key(|(_, c)| **c)
        .map(|(s, c)| (s as u64, *c))
        .unwrap_or((0, 0));
    let mut by_verb = BTreeMap::new();
    for r in &log {
        *by_verb
            .entry((r.verb.to_string(), r.resource.clone()))
            .or_insert(0) += 1;
    }
    Some(Outcome {
        reconnect,
        devices,
        total: log.len(),
        idle_per_device,
        lists: log.iter().filter(|r| r.verb == "list").count(),
        peak_per_s,
        peak_at_s,
        converged_s,
        by_verb,
        per_second,
    })
}

fn report(o: &Outcome, jitter: bool) {
    let label = if jitter {
        "with jitter"
    } else {
        "without jitter"
    };
    let suffix = if jitter { "" } else { "_no_jitter" };
    if let Some(r) = &o.reconnect {
        let per = |n: usize| n as f64 / r.devices as f64;
        println!(
            "fleet of {} after a {} s cut, {label}: {:.1} requests per device in the {} s after the restore ({:.1} watches, {:.1} version checks, {:.1} LISTs, {:.1} Lease renewals); the reconnect's own, with one Lease renewal: {:.1} per device (budget 8); every device caught up after {}",
            r.devices,
            r.cut.as_secs(),
            per(r.total),
            SHORT_AFTER.as_secs(),
            per(r.watches),
            per(r.version_checks),
            per(r.lists),
            per(r.leases),
            r.own_per_device(),
            r.converged_s
                .map_or("never, within the window".into(), |s| format!("{s:.1} s"))
        );
        println!("  by verb: {:?}", r.by_verb);
        metric(
            &format!("apiserver_requests_per_device_reconnect{suffix}"),
            r.own_per_device(),
            "",
        );
        metric(
            &format!(
                "apiserver_requests_per_device_{}s_after_{}s_cut{suffix}",
                SHORT_AFTER.as_secs(),
                r.cut.as_secs()
            ),
            per(r.total),
            "",
        );
        metric(
            &format!("apiserver_version_checks_per_device_reconnect{suffix}"),
            per(r.version_checks),
            "",
        );
    }
    let per_device = o.total as f64 / o.devices as f64;
    println!(
        "fleet of {} after a {}-minute cut, {label}: {} requests in the {} s after the restore, {per_device:.1} per device ({:.1} of them what an idle device sends in as long); {} LIST; peak {} requests/s at the server ({} s after the restore); every device caught up after {}",
        o.devices,
        support::env_or("EDGEHUB_FLEET_OFFLINE_SECS", 120) / 60,
        o.total,
        AFTER.as_secs(),
        o.idle_per_device,
        o.lists,
        o.peak_per_s,
        o.peak_at_s,
        o.converged_s
            .map_or("never, within the window".into(), |s| format!("{s:.1} s"))
    );
    println!("  by verb: {:?}", o.by_verb);
    println!(
        "  requests per second after the restore: {:?}",
        o.per_second
    );
    metric(
        &format!("apiserver_requests_per_device_link_flap{suffix}"),
        per_device,
        "",
    );
    metric(
        &format!("apiserver_requests_per_device_link_flap_net_of_idle{suffix}"),
        per_device - o.idle_per_device,
        "",
    );
    metric(
        &format!("apiserver_lists_per_device_link_flap{suffix}"),
        o.lists as f64 / o.devices as f64,
        "",
    );
    metric(
        &format!(
            "apiserver_peak_requests_per_s_{}_devices{suffix}",
            o.devices
        ),
        o.peak_per_s as f64,
        "/s",
    );
    if let Some(s) = o.converged_s {
        metric(&format!("fleet_caught_up_s{suffix}"), s, "s");
    }
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("fleet benchmark: run with `cargo bench --bench fleet`");
        return;
    }
    let Some(bin) = support::edgehub_bin() else {
        return;
    };
    let devices = support::env_or("EDGEHUB_FLEET_DEVICES", 50) as usize;
    let offline = Duration::from_secs(support::env_or("EDGEHUB_FLEET_OFFLINE_SECS", 120));
    let short = Duration::from_secs(support::env_or("EDGEHUB_FLEET_SHORT_CUT_SECS", 40));
    println!(
        "binary: {}; {devices} devices per fleet, link cut for {} s",
        bin.display(),
        offline.as_secs()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (jittered, steady) = tokio::join!(
            fleet(&bin, devices, offline, short, true),
            fleet(&bin, devices, offline, short, false)
        );
        if let Some(o) = jittered {
            report(&o, true);
        }
        if let Some(o) = steady {
            report(&o, false);
        }
    });
}

//! What sealing Secrets and tokens at rest costs (store::seal), the same work with and without
//! a device key, on a real SQLite file on the data dir's file system:
//! - flash: the bytes one round of token renewals writes (`write_bytes` of /proc/self/io,
//!   what the process sent towards storage, file system metadata included, as benches/flash.rs
//!   counts them): 5 pods' tokens of 1.1 KB (a real bound JWT's length), renewed together in
//!   one transaction as the fetcher does; the median of 30 rounds;
//! - CPU per pod start: what the runtime reads from the cache to start a pod
//!   (`sources::fetch::load`: its Secret volume's Secret and its projected token), in thread
//!   CPU time, the median of 7 batches of 2000; and the AEAD alone, per 1.1 KB token.
//!
//! The steady-state hour with sealing on is benches/flash.rs's, which runs `edgehub run` with
//! a device key. Prints numbers and `METRIC` lines for `benches/run.sh`; asserts nothing
//! about time. Run: `cargo bench --bench seal`.

mod support;

use edgehub::object::Kind;
use edgehub::store::{
    CachedSource, CachedToken, Change, DeviceKey, KeySource, OpenMode, Store, StoredObject,
};
use serde_json::json;
use std::path::Path;
use support::metric;

const PODS: usize = 5;
const TOKEN_BYTES: usize = 1100;
const ROUNDS: usize = 30;
const LOADS: usize = 2000;
const BATCHES: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Bytes this process has caused to be written to storage.
fn io_write_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("write_bytes: ")
                    .and_then(|v| v.trim().parse().ok())
            })
        })
        .expect("/proc/self/io has write_bytes (Linux, with task I/O accounting)")
}

/// CPU time this thread has used, in microseconds.
fn thread_cpu_us() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the pointer it is given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3
}

fn device_key() -> DeviceKey {
    DeviceKey::from_bytes(&[7u8; 32], KeySource::File("/bench/key".into())).expect("key")
}

/// A token as long as a real one, distinct per round (as a JWT's iat and signature are).
fn token(pod: usize, round: usize) -> CachedToken {
    let mut t = format!("eyJhbGciOiJSUzI1NiIsImtpZCI6ImJlbmNoIn0.{pod}.{round}.");
    while t.len() < TOKEN_BYTES {
        t.push_str(&format!("{:016x}", (pod * 1_000_003 + round) as u64));
    }
    t.truncate(TOKEN_BYTES);
    CachedToken {
        pod_uid: format!("pod-{pod}"),
        audience: String::new(),
        expiration_secs: 3607,
        token: t,
        issued_ms: round as i64,
        expires_ms: round as i64 + 3_607_000,
    }
}

/// Bytes written per renewal round of `PODS` tokens, the median over `ROUNDS`.
fn round_bytes(dir: &Path, key: Option<DeviceKey>) -> f64 {
    let store = Store::open_with(&dir.join("edgehub.db"), OpenMode::Normal, key).expect("store");
    let round = |r: usize| (0..PODS).map(|p| token(p, r)).collect::<Vec<_>>();
    // The first round creates the rows (and grows the file); renewals replace them.
    store.put_tokens(&round(0)).expect("tokens");
    let mut per_round = Vec::new();
    for r in 1..=ROUNDS {
        let before = io_write_bytes();
        store.put_tokens(&round(r)).expect("tokens");
        per_round.push((io_write_bytes() - before) as f64);
    }
    median(per_round)
}

/// A pod with a Secret volume and a projected token, and the store holding both.
fn pod_start_inputs(
    dir: &Path,
    key: Option<DeviceKey>,
) -> (Store, StoredObject, serde_json::Value) {
    let store = Store::open_with(&dir.join("edgehub.db"), OpenMode::Normal, key).expect("store");
    let pod = json!({
        "metadata": {"name": "p", "namespace": "bench", "uid": "pod-0", "resourceVersion": "1"},
        "spec": {"nodeName": "edge-1", "volumes": [
            {"name": "creds", "secret": {"secretName": "creds"}},
            {"name": "tok", "projected": {"sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}],
            "containers": [{"name": "app", "image": "busybox"}]}
    });
    let obj = StoredObject::from_raw(Kind::Pod, pod.to_string()).expect("pod");
    store
        .apply(Kind::Pod, &[Change::Upsert(obj.clone())], None)
        .expect("apply");
    // A Secret of a few keys, about 1 KB of JSON, as a typical credentials Secret is.
    let data: serde_json::Map<String, serde_json::Value> = (0..4)
        .map(|i| (format!("key-{i}"), json!("c2VjcmV0LXZhbHVl".repeat(10))))
        .collect();
    store
        .put_source(&CachedSource {
            kind: "secrets".into(),
            namespace: "bench".into(),
            name: "creds".into(),
            raw: Some(
                json!({"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "creds", "namespace": "bench"}, "data": data})
                .to_string(),
            ),
            fetched_ms: 0,
        })
        .expect("secret");
    store.put_token(&token(0, 0)).expect("token");
    (store, obj, pod)
}

/// CPU microseconds per `sources::fetch::load` of the pod's Secret and token.
fn load_cpu_us(dir: &Path, key: Option<DeviceKey>) -> f64 {
    let (store, obj, raw) = pod_start_inputs(dir, key);
    let mut batches = Vec::new();
    for _ in 0..BATCHES {
        let t = thread_cpu_us();
        for _ in 0..LOADS {
            let s = edgehub::sources::fetch::load(&store, &obj, &raw).expect("load");
            assert_eq!(s.tokens.len(), 1, "the token opened");
            assert_eq!(s.secrets.len(), 1, "the Secret opened");
        }
        batches.push((thread_cpu_us() - t) / LOADS as f64);
    }
    median(batches)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // The data dir's file system, not a tmpfs: beside the build.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-seal");
    std::fs::create_dir_all(&root).expect("bench dir");
    let dir = |name: &str| {
        tempfile::Builder::new()
            .prefix(name)
            .tempdir_in(&root)
            .expect("tempdir")
    };

    let (a, b) = (dir("clear"), dir("sealed"));
    let clear = round_bytes(a.path(), None);
    let sealed = round_bytes(b.path(), Some(device_key()));
    println!(
        "token round ({PODS} tokens of {TOKEN_BYTES} B, median of {ROUNDS}): {clear:.0} B written in the clear, {sealed:.0} B sealed ({:+.0} B)",
        sealed - clear
    );
    metric("seal_flash_bytes_per_token_round_5_pods_clear", clear, "B");
    metric(
        "seal_flash_bytes_per_token_round_5_pods_sealed",
        sealed,
        "B",
    );

    let (a, b) = (dir("load-clear"), dir("load-sealed"));
    let clear = load_cpu_us(a.path(), None);
    let sealed = load_cpu_us(b.path(), Some(device_key()));
    println!(
        "pod start, its Secret and token read from the cache (median of {BATCHES} x {LOADS}): {clear:.1} us CPU in the clear, {sealed:.1} us sealed ({:+.1} us)",
        sealed - clear
    );
    metric("seal_cpu_us_per_pod_start_clear", clear, "us");
    metric("seal_cpu_us_per_pod_start_sealed", sealed, "us");

    let k = device_key();
    let aad = b"sa_tokens\0pod-0\0\x003607";
    let t = token(0, 1).token;
    let boxed = k.seal(aad, t.as_bytes()).expect("seal");
    let n = 20_000;
    let start = thread_cpu_us();
    for _ in 0..n {
        std::hint::black_box(
            k.seal(aad, std::hint::black_box(t.as_bytes()))
                .expect("seal"),
        );
    }
    let seal_us = (thread_cpu_us() - start) / n as f64;
    let start = thread_cpu_us();
    for _ in 0..n {
        std::hint::black_box(k.open(aad, std::hint::black_box(&boxed)).expect("open"));
    }
    let open_us = (thread_cpu_us() - start) / n as f64;
    println!(
        "AES-256-GCM with its synthetic nonce, one {TOKEN_BYTES} B token: seal {seal_us:.2} us, open {open_us:.2} us CPU"
    );
    metric("seal_us_per_token", seal_us, "us");
    metric("open_us_per_token", open_us, "us");
}

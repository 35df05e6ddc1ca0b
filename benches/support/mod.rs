//! What the benchmarks that run the `edgehub` binary share: which binary, starting it against
//! the fake apiserver with a node identity of its own, reading its memory and I/O from /proc,
//! one plain HTTP request to its local API, and the machine-readable lines
//! `benches/run.sh` collects.
#![allow(dead_code)]

use edgehub_testsupport::FakeApiServer;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One number for `benches/run.sh`: a line `METRIC <key> <value> <unit>`. A key printed more
/// than once (one line per sample, or one per run of the bench) is reported as the median.
pub fn metric(key: &str, value: f64, unit: &str) {
    println!("METRIC {key} {value} {unit}");
}

/// The binary to measure: `EDGEHUB_BENCH_BIN`, else the static x86_64 musl build devices run
/// (`bash cross/build.sh`), else the glibc release build. Its memory depends on the libc's
/// allocator, so the bench says which one it ran.
pub fn edgehub_bin() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let candidates: Vec<PathBuf> = match std::env::var_os("EDGEHUB_BENCH_BIN") {
        Some(b) => vec![PathBuf::from(b)],
        None => vec![
            root.join("target/x86_64-unknown-linux-musl/release/edgehub"),
            root.join("target/release/edgehub"),
        ],
    };
    let found = candidates.into_iter().find(|p| p.exists());
    if found.is_none() {
        println!(
            "no edgehub binary: run `bash cross/build.sh` (or `cargo build --release --bin edgehub`), or set EDGEHUB_BENCH_BIN"
        );
    }
    found
}

/// A port for an edgehub's local API, distinct for every call in this process. Taken below
/// the kernel's ephemeral range (32768 and up): a port the kernel handed out (`bind(0)`)
/// and released could be handed out again to one of the many connections a fleet opens
/// before the edgehub meant to listen on it starts, and that edgehub then exits with
/// "address in use".
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let _ = NEXT.compare_exchange(
        0,
        20_000 + fastrand::u16(0..8_000),
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    loop {
        let port = NEXT.fetch_add(1, Ordering::SeqCst);
        assert!(port < 32_768, "no free port left below the ephemeral range");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// The recorded telemetry pod (two containers, a ConfigMap volume, the projected token; about
/// 5.5 KB) bound to `node` as `name`.
pub fn telemetry_pod(server: &FakeApiServer, node: &str, name: &str, uid: &str) -> Value {
    let mut p = server
        .get("pods", "vehicle", "telemetry-sv74m")
        .expect("the recorded cluster is seeded");
    p["metadata"]["name"] = json!(name);
    p["metadata"]["uid"] = json!(uid);
    p["spec"]["nodeName"] = json!(node);
    p
}

/// A fake apiserver with the recorded cluster (DaemonSets, revisions, the ConfigMaps the pods
/// reference) and no pods yet.
pub async fn recorded_server() -> FakeApiServer {
    let server = FakeApiServer::start().await.expect("fake apiserver");
    server.seed_recorded_cluster();
    server
}

/// Adds `n` copies of the telemetry pod bound to `node`, then removes the recorded pods.
pub fn seed_pods(server: &FakeApiServer, node: &str, n: usize) {
    for i in 0..n {
        let p = telemetry_pod(
            server,
            node,
            &format!("telemetry-{node}-{i:04}"),
            &format!("{node}-{i:04}"),
        );
        server.apply("pods", p);
    }
    for name in ["telemetry-sv74m", "gateway-v9hb2"] {
        server.remove("pods", "vehicle", name);
    }
}

/// One `edgehub run`: its own node name (with a token for that identity), data dir, local API
/// port and config file.
pub struct Edge {
    pub name: String,
    pub dir: PathBuf,
    pub api: String,
    pub config: PathBuf,
    pub child: Option<Child>,
    bin: PathBuf,
    /// When set ([`Edge::pipe_log`]), the log reaches `edgehub.log` through a pipe this
    /// process copies, counted here, so that edgehub's own `write_bytes` leave it out.
    log_bytes: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

impl Edge {
    /// Writes the config (`extra` is appended: TOML sections) without starting it.
    pub fn prepare(
        server: &FakeApiServer,
        bin: &Path,
        dir: &Path,
        name: &str,
        cri_socket: &Path,
        extra: &str,
    ) -> Edge {
        let token = format!("token-{name}");
        server.add_token(&token, &format!("system:node:{name}"));
        std::fs::create_dir_all(dir).expect("edge dir");
        let kc = server
            .write_kubeconfig(&dir.join("kube"), &token)
            .expect("kubeconfig");
        let api = format!("127.0.0.1:{}", free_port());
        let config = dir.join("config.toml");
        std::fs::write(
            &config,
            format!(
                "node_name = \"{name}\"\napi_addr = \"{api}\"\ndata_dir = \"{}\"\nkubeconfig = \"{}\"\ncri_socket = \"{}\"\n{extra}",
                dir.join("data").display(),
                kc.display(),
                cri_socket.display()
            ),
        )
        .expect("config");
        Edge {
            name: name.into(),
            dir: dir.into(),
            api,
            config,
            child: None,
            bin: bin.into(),
            log_bytes: None,
        }
    }

    /// From the next start on, the log goes through a pipe: the flash bench counts what
    /// edgehub itself writes to storage, and a device's log goes to the journal, not to a file
    /// of edgehub's. Returns the count of log bytes (what the journal would get).
    pub fn pipe_log(&mut self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        let n = self.log_bytes.get_or_insert_with(Default::default);
        n.clone()
    }

    /// Starts `edgehub run`, its log in `edgehub.log`; `env` is added to its environment.
    pub fn start(&mut self, env: &[(&str, &str)]) -> Instant {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("edgehub.log"))
            .expect("log file");
        // `EDGEHUB_BENCH_WRAPPER` (say `heaptrack -o /tmp/eh` or `strace -f -tt -o /tmp/eh`)
        // runs edgehub under a tool, to see where a number comes from; the pid and /proc
        // readings are then the tool's, so the numbers printed mean nothing.
        let wrapper = std::env::var("EDGEHUB_BENCH_WRAPPER").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut cmd = match words.next() {
            Some(tool) => {
                let mut c = Command::new(tool);
                c.args(words).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        cmd.arg("--config")
            .arg(&self.config)
            .arg("run")
            .stdout(Stdio::null());
        if self.log_bytes.is_some() {
            cmd.stderr(Stdio::piped());
        } else {
            cmd.stderr(log.try_clone().expect("log file"));
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let t = Instant::now();
        let mut child = cmd.spawn().expect("edgehub starts");
        if let (Some(count), Some(mut err)) = (self.log_bytes.clone(), child.stderr.take()) {
            let mut log = log;
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut buf = [0u8; 8192];
                while let Ok(n) = err.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    count.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                    let _ = log.write_all(&buf[..n]);
                }
            });
        }
        self.child = Some(child);
        t
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    pub fn db(&self) -> PathBuf {
        self.dir.join("data/edgehub.db")
    }

    /// Cached objects of `kind`, read from the database file beside the running process.
    pub fn cached(&self, kind: &str) -> i64 {
        count_rows(&self.db(), kind)
    }

    /// SIGTERM, then wait for the exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is our own child,
            // not yet waited for, so it cannot have been reused.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let _ = c.wait();
        }
    }

    /// One request to the local API: status code (0 when it cannot connect) and body.
    pub fn http(&self, method: &str, path: &str) -> (u16, String) {
        http(&self.api, method, path)
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn count_rows(db: &Path, kind: &str) -> i64 {
    query_count(db, "SELECT count(*) FROM objects WHERE kind = ?1", kind)
}

/// A `count(*)` query with one parameter on a database another process writes (0 when it
/// cannot be read yet).
pub fn query_count(db: &Path, sql: &str, param: &str) -> i64 {
    rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .and_then(|c| c.query_row(sql, [param], |r| r.get::<_, i64>(0)))
        .unwrap_or(0)
}

/// One HTTP/1.1 request with `Connection: close`.
pub fn http(addr: &str, method: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    if s.write_all(req.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let code = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body)
}

/// A field of /proc/PID/status in KiB (`VmRSS`, `VmHWM`).
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Threads of the process.
pub fn threads(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// `write_bytes` of /proc/PID/io: what the process caused to be written to storage.
pub fn io_write_bytes(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// A whole number from the environment (a bench's knob), or `default` when unset or unparsable.
pub fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Polls `f` every 50 ms for up to `secs`; whether it became true.
pub async fn wait_for(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

/// A thread's or process's name and CPU ticks (utime + stime) from a `stat` line of /proc:
/// the name is between the first `(` and the last `)`, and utime and stime are the 12th and
/// 13th fields after it.
pub fn stat_name_ticks(stat: &str) -> Option<(String, u64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let utime: u64 = rest.get(11)?.parse().ok()?;
    let stime: u64 = rest.get(12)?.parse().ok()?;
    Some((name, utime + stime))
}

/// The CPU ticks (utime + stime) the process has used, all its threads together.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_name_ticks(&stat).map(|(_, t)| t)
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), the unit of /proc's CPU times.
pub fn clock_ticks_per_sec() -> f64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// A TLS client configuration that takes any server certificate (the benches measure; the
/// tests check the certificates).
pub fn any_server_cert() -> std::sync::Arc<rustls::ClientConfig> {
    #[derive(Debug)]
    struct Any;
    impl rustls::client::danger::ServerCertVerifier for Any {
        fn verify_server_cert(
            &self,
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &[rustls::pki_types::CertificateDer<'_>],
            _: &rustls::pki_types::ServerName<'_>,
            _: &[u8],
            _: rustls::pki_types::UnixTime,
        ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            rustls::crypto::ring::default_provider()
                .signature_verification_algorithms
                .supported_schemes()
        }
    }
    let cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .dangerous()
    .with_custom_certificate_verifier(std::sync::Arc::new(Any))
    .with_no_client_auth();
    std::sync::Arc::new(cfg)
}

/// Has `server` approve every kubelet-serving CSR at once (the node API's certificate).
pub fn approve_serving_csrs(server: &FakeApiServer) {
    use edgehub_testsupport::{Approval, CsrRequest, KUBELET_SERVING_SIGNER};
    server.set_csr_approver(Some(std::sync::Arc::new(|r: &CsrRequest| {
        if r.signer_name == KUBELET_SERVING_SIGNER {
            Approval::Approve {
                reason: "BenchApproved".into(),
                message: "bench".into(),
            }
        } else {
            Approval::Pending
        }
    })));
}

//! The edgehub binary end to end: config errors, a real `edgehub run` against the fake
//! apiserver, SIGKILL and restart without a relist, a corrupt or locked database.

mod common;

use common::wait_until;
use edgehub::object::Kind;
use edgehub::store::{OpenMode, Store};
use edgehub_testsupport::{FakeApiServer, NODE_TOKEN};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_edgehub");

struct Env {
    server: FakeApiServer,
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Env {
    async fn new() -> Env {
        let server = FakeApiServer::start().await.unwrap();
        server.seed_recorded_cluster();
        let dir = tempfile::tempdir().unwrap();
        let kc = server
            .write_kubeconfig(&dir.path().join("kube"), NODE_TOKEN)
            .unwrap();
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!(
                "node_name = \"edge-1\"\napi_addr = \"127.0.0.1:0\"\ndata_dir = \"{}\"\nkubeconfig = \"{}\"\n[sync]\nbackoff_initial_ms = 50\nbackoff_max_secs = 1\n",
                dir.path().join("data").display(),
                kc.display()
            ),
        )
        .unwrap();
        Env {
            server,
            dir,
            config,
        }
    }

    fn db(&self) -> PathBuf {
        self.dir.path().join("data/edgehub.db")
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--config")
            .arg(&self.config)
            .args(args)
            .env_remove("EDGEHUB_NODE_NAME");
        c
    }

    fn spawn_run(&self, extra: &[&str]) -> Child {
        let mut args = vec!["run"];
        args.extend_from_slice(extra);
        self.cmd(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Pods in the database file, read through a second connection (edgehub keeps running).
    fn pods_in_db(&self) -> usize {
        let Ok(conn) = rusqlite::Connection::open_with_flags(
            self.db(),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        ) else {
            return 0;
        };
        conn.query_row("SELECT count(*) FROM objects WHERE kind = 'Pod'", [], |r| {
            r.get::<_, i64>(0)
        })
        .map(|n| n as usize)
        .unwrap_or(0)
    }
}

fn output(mut c: Command) -> (bool, String) {
    let out = c.output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// A child killed when dropped, so a failing assertion does not leave it running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn kill9(child: &mut Child) {
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

#[test]
fn version_prints_the_crate_version() {
    let (ok, out) = output({
        let mut c = Command::new(BIN);
        c.arg("version");
        c
    });
    assert!(ok);
    assert_eq!(out.trim(), format!("edgehub {}", env!("CARGO_PKG_VERSION")));
}

#[tokio::test]
async fn check_config_reports_the_resolved_config() {
    let env = Env::new().await;
    let (ok, out) = output(env.cmd(&["check-config"]));
    assert!(ok, "{out}");
    assert!(out.contains("node_name   = edge-1"), "{out}");
    assert!(out.contains(&env.server.url()), "{out}");
    assert!(out.contains("config OK"), "{out}");
}

#[tokio::test]
async fn check_config_checks_the_credentials_it_names() {
    let env = Env::new().await;
    let (ok, out) = output(env.cmd(&["check-config"]));
    assert!(
        ok && out.contains("credential  = kubeconfig: token (inline)"),
        "{out}"
    );

    // A tokenFile that is not there, and an [api] token_file that is not there.
    let kc = env.dir.path().join("kube").join("kubeconfig");
    let text = std::fs::read_to_string(&kc).unwrap();
    std::fs::write(
        &kc,
        text.replace(&format!("token: {NODE_TOKEN}"), "tokenFile: missing-token"),
    )
    .unwrap();
    let (ok, out) = output(env.cmd(&["check-config"]));
    assert!(
        !ok && out.contains("tokenFile") && out.contains("missing-token"),
        "{out}"
    );
    std::fs::write(
        env.dir.path().join("kube").join("missing-token"),
        NODE_TOKEN,
    )
    .unwrap();
    let (ok, out) = output(env.cmd(&["check-config"]));
    assert!(ok && out.contains("tokenFile"), "{out}");

    let cfg = std::fs::read_to_string(&env.config).unwrap();
    let api_token = env.dir.path().join("api-token");
    std::fs::write(
        &env.config,
        format!("{cfg}[api]\ntoken_file = \"{}\"\n", api_token.display()),
    )
    .unwrap();
    let (ok, out) = output(env.cmd(&["check-config"]));
    assert!(!ok && out.contains("api-token"), "{out}");
    std::fs::write(&api_token, "local-secret\n").unwrap();
    let (ok, out) = output(env.cmd(&["check-config"]));
    assert!(ok && out.contains("api.token"), "{out}");

    // A client certificate (one the fake issued) is shown with its dates.
    let cert_dir = env.dir.path().join("cert");
    let ckc = env
        .server
        .write_cert_kubeconfig(&cert_dir, "system:node:edge-1")
        .unwrap();
    let cfg = std::fs::read_to_string(&env.config).unwrap();
    std::fs::write(
        &env.config,
        cfg.replace(&kc.display().to_string(), &ckc.display().to_string()),
    )
    .unwrap();
    let (ok, out) = output(env.cmd(&["check-config"]));
    assert!(
        ok && out.contains("client certificate system:node:edge-1 valid"),
        "{out}"
    );
}

#[test]
fn invalid_config_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        "node_name = \"edge-1\"\napi_addr = \"not an address\"\n",
    )
    .unwrap();
    let (ok, out) = output({
        let mut c = Command::new(BIN);
        c.arg("--config").arg(&cfg).arg("check-config");
        c
    });
    assert!(!ok);
    assert!(out.contains("config field `api_addr`"), "{out}");

    let (ok, out) = output({
        let mut c = Command::new(BIN);
        c.args(["--config", "/nonexistent/edgehub.toml", "check-config"]);
        c
    });
    assert!(!ok);
    assert!(out.contains("/nonexistent/edgehub.toml"), "{out}");
}

/// Waits up to `secs` for a child to exit; a child still running then is killed and reported.
fn exit_within(mut child: Child, secs: u64, what: &str) -> (std::process::ExitStatus, String) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                std::io::Read::read_to_string(&mut e, &mut err).unwrap();
            }
            return (status, err);
        }
        if std::time::Instant::now() > deadline {
            kill9(&mut child);
            panic!("{what}: still running after {secs}s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[tokio::test]
async fn out_of_range_numbers_and_mistyped_log_filters_are_refused_at_start() {
    let env = Env::new().await;
    let text = std::fs::read_to_string(&env.config).unwrap();
    // 2^44 MiB: shifted to bytes it wrapped to 0, a reserve of nothing, and check-config said
    // OK.
    std::fs::write(
        &env.config,
        format!("{text}[node]\nmemory_reserve_mib = 17592186044416\n"),
    )
    .unwrap();
    let (ok, out) = output(env.cmd(&["check-config"]));
    assert!(!ok, "{out}");
    assert!(
        out.contains("config field `node.memory_reserve_mib`: must be between 0 and 1048576"),
        "{out}"
    );
    std::fs::write(&env.config, &text).unwrap();

    // A mistyped filter parses as a target and silences everything, errors included: `run`
    // refuses it at once instead of running mute.
    for (how, filter) in [
        ("--log", "warning"),
        ("--log", "verbose"),
        ("--log", "info "),
        ("EDGEHUB_LOG", ""),
    ] {
        let mut c = if how == "--log" {
            env.cmd(&["--log", filter, "run"])
        } else {
            let mut c = env.cmd(&["run"]);
            c.env("EDGEHUB_LOG", filter);
            c
        };
        let child = c
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (status, err) = exit_within(child, 20, &format!("run with {how} {filter:?}"));
        assert!(!status.success(), "{how} {filter:?}: {err}");
        assert!(
            err.contains("config field `log`"),
            "{how} {filter:?}: {err}"
        );
    }
    let child = env
        .cmd(&["--log", "warning", "controller", "--no-leader-elect"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (status, err) = exit_within(child, 20, "controller with --log warning");
    assert!(
        !status.success() && err.contains("is not a log level"),
        "{err}"
    );
}

// Multi-threaded: the test blocks reading edgehub's stderr while the fake apiserver serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_is_caught_and_edgehub_keeps_running() {
    let env = Env::new().await;
    let port = common::free_port();
    let mut child = env
        .cmd(&["--api-addr", &format!("127.0.0.1:{port}"), "run"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = stderr_lines(&mut child);
    let wait_line = |child: &mut Child, what: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut seen = Vec::new();
        loop {
            if let Ok(line) = lines.recv_timeout(std::time::Duration::from_millis(100)) {
                if line.contains(what) {
                    return line;
                }
                seen.push(line);
                continue;
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("edgehub ended ({status:?}) before logging {what:?}: {seen:#?}");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {what:?} line: {seen:#?}"
            );
        }
    };
    wait_line(&mut child, "local API serving");
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    let line = wait_line(&mut child, "SIGHUP");
    assert!(line.contains("keeps running"), "{line}");
    assert!(child.try_wait().unwrap().is_none(), "still running");
    let client = edgehub::local_client::LocalClient {
        target: edgehub::local_client::Target::Tcp(format!("127.0.0.1:{port}").parse().unwrap()),
        token: None,
        timeout: std::time::Duration::from_secs(5),
    };
    let health = tokio::task::spawn_blocking(move || client.get("/v1/healthz").unwrap())
        .await
        .unwrap();
    assert_eq!(health.status, 200, "the API still answers");
    // It still stops cleanly on SIGTERM.
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    wait_line(&mut child, "stopped");
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "exit status {status:?}");
}

#[test]
fn missing_kubeconfig_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, out) = output({
        let mut c = Command::new(BIN);
        c.args([
            "--node-name",
            "edge-1",
            "--kubeconfig",
            "/nonexistent/kubeconfig",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .arg("check-config");
        c
    });
    assert!(!ok);
    assert!(
        out.contains("kubeconfig /nonexistent/kubeconfig not found"),
        "{out}"
    );
}

#[tokio::test]
async fn run_fills_the_database_and_resumes_after_sigkill_without_a_relist() {
    let env = Env::new().await;
    let mut child = env.spawn_run(&[]);
    wait_until(20, "edgehub run caches the node's pods", || {
        env.pods_in_db() == 2
    })
    .await;
    // Let every reflector reach its watch before the kill.
    wait_until(10, "all reflectors watch", || {
        env.server.count(|r| r.is_watch()) >= 4
    })
    .await;
    kill9(&mut child);
    let full_lists = env
        .server
        .count(|r| r.is_list_of("pods") && r.status == 200);
    assert_eq!(full_lists, 1);
    assert_eq!(
        env.server.count(|r| r.is_version_check_of("pods")),
        0,
        "the first run's watch followed its own list: nothing to check"
    );

    // While it is dead, a pod is deleted in the cloud.
    env.server.remove("pods", "vehicle", "gateway-v9hb2");
    let mut child = env.spawn_run(&[]);
    wait_until(20, "the restarted edgehub sees the deletion", || {
        env.pods_in_db() == 1
    })
    .await;
    kill9(&mut child);
    assert_eq!(
        env.server
            .count(|r| r.is_list_of("pods") && r.status == 200),
        1,
        "the server logs no second full list"
    );
    assert_eq!(
        env.server.count(|r| r.is_version_check_of("pods")),
        0,
        "the resumed watch carries the cursor itself: no limit=1 probe before it \
         (a 410 on the watch is what would send it back to a list)"
    );
    let store = Store::open(&env.db(), OpenMode::Normal).unwrap();
    assert_eq!(store.count(Kind::DaemonSet).unwrap(), 2);
}

#[tokio::test]
async fn a_corrupt_database_is_refused_untouched_until_reset_cache() {
    let env = Env::new().await;
    std::fs::create_dir_all(env.db().parent().unwrap()).unwrap();
    let junk = b"definitely not sqlite".repeat(300);
    std::fs::write(env.db(), &junk).unwrap();
    let out = env.spawn_run(&[]).wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not an SQLite database") && err.contains("--reset-cache"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(env.db()).unwrap(),
        junk,
        "the file is untouched"
    );

    let mut child = env.spawn_run(&["--reset-cache"]);
    wait_until(20, "the reset cache is rebuilt from the apiserver", || {
        env.pods_in_db() == 2
    })
    .await;
    kill9(&mut child);
    let aside = std::fs::read_dir(env.db().parent().unwrap())
        .unwrap()
        .filter_map(Result::ok)
        .find(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("edgehub.db.bad-")
        })
        .expect("the corrupt file was moved aside");
    assert_eq!(std::fs::read(aside.path()).unwrap(), junk);
}

#[tokio::test]
async fn a_schema_version_that_does_not_match_the_tables_is_named_and_reset_cache_recovers() {
    let env = Env::new().await;
    {
        let store = Store::open(&env.db(), OpenMode::Normal).unwrap();
        drop(store);
        let conn = rusqlite::Connection::open(env.db()).unwrap();
        conn.pragma_update(None, "user_version", 5).unwrap();
    }
    let out = env.spawn_run(&[]).wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&env.db().display().to_string())
            && err.contains("do not match its schema version 5")
            && err.contains("--reset-cache"),
        "{err}"
    );
    let mut child = env.spawn_run(&["--reset-cache"]);
    wait_until(20, "the reset cache is rebuilt from the apiserver", || {
        env.pods_in_db() == 2
    })
    .await;
    kill9(&mut child);
}

#[tokio::test]
async fn a_second_edgehub_on_the_same_data_dir_is_refused() {
    let env = Env::new().await;
    let first = Running(env.spawn_run(&[]));
    wait_until(20, "first edgehub is running", || env.pods_in_db() == 2).await;
    let (status, err) = exit_within(env.spawn_run(&[]), 20, "the second edgehub");
    assert!(!status.success());
    assert!(err.contains("locked by another process"), "{err}");
    // The natural reaction: delete whatever looks like a lock file, and try again.
    for e in std::fs::read_dir(env.db().parent().unwrap()).unwrap() {
        let e = e.unwrap();
        if e.file_name().to_string_lossy().ends_with(".lock") {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    let (status, err) = exit_within(
        env.spawn_run(&[]),
        20,
        "the second edgehub after deleting the lock files",
    );
    drop(first);
    assert!(!status.success());
    assert!(err.contains("locked by another process"), "{err}");
}

#[tokio::test]
async fn sigterm_stops_cleanly_and_checkpoints_the_cursor() {
    let env = Env::new().await;
    let mut child = env.spawn_run(&[]);
    wait_until(20, "running", || env.pods_in_db() == 2).await;
    wait_until(10, "all reflectors watch", || {
        env.server.count(|r| r.is_watch()) >= 4
    })
    .await;
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "exit status {status:?}");
    let store = Store::open(&env.db(), OpenMode::Normal).unwrap();
    assert!(store
        .cursor("pods?fieldSelector=spec.nodeName=edge-1")
        .unwrap()
        .is_some());
}

#[tokio::test]
async fn pods_status_and_upgrade_commands_talk_to_the_running_agent() {
    let env = Env::new().await;
    for item in edgehub_testsupport::fixture_body("controllerrevisions_list_rev2")["items"]
        .as_array()
        .unwrap()
    {
        env.server.apply("controllerrevisions", item.clone());
    }
    let port = common::free_port();
    let text = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    std::fs::write(&env.config, text).unwrap();
    let mut child = env.spawn_run(&[]);
    wait_until(20, "edgehub run caches the node's pods", || {
        env.pods_in_db() == 2
    })
    .await;
    wait_until(20, "the new revision is cached and the API answers", || {
        let (ok, out) = output(env.cmd(&["pods"]));
        ok && out.contains("55778fbb9f")
    })
    .await;

    let (ok, out) = output(env.cmd(&["pods"]));
    assert!(ok, "{out}");
    let tele = out
        .lines()
        .find(|l| l.contains("vehicle/telemetry-sv74m"))
        .unwrap();
    assert!(
        tele.contains("768bcc7446")
            && tele.contains("55778fbb9f")
            && tele.contains("True (NewRevisionAvailable)"),
        "{out}"
    );

    // No container runtime runs here: the upgrade is refused, naming it, and nothing is
    // recorded (tests/upgrade_faults.rs follows an accepted one with --wait).
    let (ok, out) = output(env.cmd(&[
        "upgrade",
        "vehicle/telemetry-sv74m",
        "--wait",
        "--timeout",
        "1",
    ]));
    assert!(!ok, "{out}");
    assert!(
        out.contains("503") && out.contains("container runtime does not answer"),
        "{out}"
    );
    // One accepted before the runtime went away: it waits, and says why.
    {
        let conn = rusqlite::Connection::open(env.db()).unwrap();
        conn.execute(
            "INSERT INTO requests (kind, pod_uid, namespace, name, from_hash, to_hash, state,
                 created_ms, updated_ms, uid)
             SELECT 'upgrade', uid, namespace, name, '768bcc7446', '55778fbb9f', 'Requested',
                 0, 0, 'accepted-before'
             FROM objects WHERE name = 'telemetry-sv74m'",
            [],
        )
        .unwrap();
    }
    wait_until(20, "the engine says why the upgrade waits", || {
        let (ok, out) = output(env.cmd(&["status"]));
        ok && out.contains("container runtime")
    })
    .await;
    let (ok, out) = output(env.cmd(&["upgrade", "vehicle/telemetry-sv74m"]));
    assert!(
        !ok && out.contains("409") && out.contains("already in progress"),
        "{out}"
    );
    let (ok, out) = output(env.cmd(&["upgrade", "vehicle/gateway-v9hb2"]));
    assert!(!ok && out.contains("403"), "{out}");
    let (ok, out) = output(env.cmd(&["upgrade", "not-a-pod-ref"]));
    assert!(!ok && out.contains("is not NAMESPACE/NAME"), "{out}");

    let (ok, out) = output(env.cmd(&["status"]));
    assert!(ok, "{out}");
    assert!(
        out.contains("link:   Online") && out.contains("2 pods"),
        "{out}"
    );
    assert!(
        out.contains("upgrade vehicle/telemetry-sv74m 768bcc7446 -> 55778fbb9f [Requested]"),
        "{out}"
    );

    // --wait follows the request; with no engine to move it, it gives up at its timeout.
    let (ok, out) = output(env.cmd(&[
        "upgrade",
        "vehicle/telemetry-sv74m",
        "--wait",
        "--timeout",
        "1",
    ]));
    assert!(!ok && out.contains("409"), "{out}");
    kill9(&mut child);

    // With edgehub stopped, the commands say so clearly.
    let (ok, out) = output(env.cmd(&["pods"]));
    assert!(!ok && out.contains("is `edgehub run` running?"), "{out}");
}

// Multi-threaded: the test blocks on the notify socket while the fake apiserver keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tells_systemd_when_the_api_is_up_and_when_it_stops() {
    let env = Env::new().await;
    let sock_path = env.dir.path().join("notify.sock");
    let rx = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    rx.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let port = common::free_port();
    let mut child = env
        .cmd(&["--api-addr", &format!("127.0.0.1:{port}"), "run"])
        .env("NOTIFY_SOCKET", &sock_path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 64];
    let n = rx.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"READY=1");
    // Ready means the API answers.
    let healthz = std::net::TcpStream::connect(("127.0.0.1", port));
    assert!(healthz.is_ok(), "API up when READY=1 is sent");
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let n = rx.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"STOPPING=1");
    assert!(child.wait().unwrap().success());
}

#[tokio::test]
async fn run_registers_the_node_and_keeps_its_lease_fresh() {
    let env = Env::new().await;
    env.server.remove("nodes", "", "edge-1");
    let socket = common::cri_stack();
    let text = std::fs::read_to_string(&env.config).unwrap().replace(
        "api_addr",
        &format!("cri_socket = \"{}\"\napi_addr", socket.display()),
    ) + "[node]\nlease_renew_secs = 1\n";
    std::fs::write(&env.config, text).unwrap();
    let mut child = env.spawn_run(&[]);
    wait_until(20, "the Node is registered", || {
        env.server.get("nodes", "", "edge-1").is_some()
    })
    .await;
    wait_until(20, "the Lease exists", || {
        env.server
            .get("leases", "kube-node-lease", "edge-1")
            .is_some()
    })
    .await;
    let renew = |e: &Env| {
        e.server.get("leases", "kube-node-lease", "edge-1").unwrap()["spec"]["renewTime"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let first = renew(&env);
    wait_until(10, "the Lease is renewed", || renew(&env) > first).await;
    let node = env.server.get("nodes", "", "edge-1").unwrap();
    let ready = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap()
        .clone();
    assert_eq!(ready["status"], "True");
    assert!(node["status"]["allocatable"]["memory"]
        .as_str()
        .unwrap()
        .ends_with("Ki"));
    assert_eq!(node["metadata"]["labels"]["kubernetes.io/os"], "linux");
    // The node's own watch brings it into the cache, too.
    wait_until(20, "the Node is cached", || {
        rusqlite::Connection::open_with_flags(env.db(), rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| {
                c.query_row(
                    "SELECT count(*) FROM objects WHERE kind = 'Node'",
                    [],
                    |r| r.get::<_, i64>(0),
                )
            })
            .unwrap_or(0)
            == 1
    })
    .await;
    kill9(&mut child);
    // The recorded pods ran in the shared containerd; they must not outlive the test.
    use edgehub::cri::{labels, CriClient, CriRuntime};
    let c = CriClient::new(&socket);
    let mine = std::collections::HashMap::from([(labels::NODE.to_string(), "edge-1".to_string())]);
    for sb in c.list_pod_sandbox(mine).await.unwrap_or_default() {
        let _ = c.stop_pod_sandbox(&sb.id).await;
        let _ = c.remove_pod_sandbox(&sb.id).await;
    }
}

/// kubeedge#3618: after a reboot with no link, the node's pods must come back.
#[tokio::test]
async fn a_restart_with_the_apiserver_unreachable_brings_the_pods_back() {
    use edgehub::cri::{api, labels, CriClient, CriRuntime};
    use std::collections::HashMap;
    let env = Env::new().await;
    let socket = common::cri_stack();
    let node = format!("edge-reboot-{}", std::process::id());
    env.server.apply(
        "pods",
        serde_json::json!({
            "metadata": {"name": "svc", "namespace": "vehicle", "uid": format!("reboot-{}", std::process::id()),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "svc", "uid": "ds-svc", "controller": true}]},
            "spec": {"nodeName": node, "hostNetwork": true, "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent"}]}
        }),
    );
    let text = std::fs::read_to_string(&env.config).unwrap().replace(
        "node_name = \"edge-1\"",
        &format!(
            "node_name = \"{node}\"\ncri_socket = \"{}\"",
            socket.display()
        ),
    );
    std::fs::write(&env.config, text).unwrap();
    let c = CriClient::new(&socket);
    let mine = HashMap::from([(labels::NODE.to_string(), node.clone())]);
    let running = |c: CriClient, sel: HashMap<String, String>| async move {
        c.list_containers(sel)
            .await
            .unwrap_or_default()
            .iter()
            .filter(|x| x.state == api::ContainerState::ContainerRunning as i32)
            .count()
    };

    let mut child = env.spawn_run(&[]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while running(c.clone(), mine.clone()).await == 0 {
        assert!(std::time::Instant::now() < deadline, "the pod runs");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    kill9(&mut child);

    // The reboot: containers and sandboxes are gone, and so is the link.
    for sb in c.list_pod_sandbox(mine.clone()).await.unwrap() {
        c.stop_pod_sandbox(&sb.id).await.unwrap();
        c.remove_pod_sandbox(&sb.id).await.unwrap();
    }
    assert_eq!(running(c.clone(), mine.clone()).await, 0);
    env.server.set_offline(true).await.unwrap();

    let mut child = env.spawn_run(&[]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while running(c.clone(), mine.clone()).await == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pod comes back from the cache with no apiserver"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    kill9(&mut child);
    for sb in c.list_pod_sandbox(mine).await.unwrap() {
        let _ = c.stop_pod_sandbox(&sb.id).await;
        let _ = c.remove_pod_sandbox(&sb.id).await;
    }
}

/// The lines a child writes to stderr, read on a thread so a test can wait with a deadline
/// (and the pipe never fills).
fn stderr_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines() {
            let Ok(line) = line else { return };
            // The test may stop listening; keep draining so the child never blocks.
            let _ = tx.send(line);
        }
    });
    rx
}

/// Polls an async condition every 200 ms, or panics after `secs`.
async fn wait_for<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !f().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {secs}s waiting for: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// An empty cache is not a verdict: after `--reset-cache`, after a corrupt database is moved
/// aside, and with a new data dir, all offline, the pods edgehub runs keep running (same
/// containers). When the link returns, the pods the list confirms are adopted as they run and
/// the one it does not have is removed.
// Multi-threaded: the test blocks reading edgehub's stderr while the fake apiserver serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_cache_offline_stops_nothing_and_the_list_adopts_what_it_confirms() {
    use edgehub::cri::{api, labels, CriClient, CriRuntime};
    use std::collections::HashMap;
    let env = Env::new().await;
    let socket = common::cri_stack();
    let node = format!("edge-empty-{}", std::process::id());
    let pod = |name: &str| {
        serde_json::json!({
            "metadata": {"name": name, "namespace": "vehicle", "uid": format!("{name}-{}", std::process::id()),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": name, "uid": format!("ds-{name}"), "controller": true}]},
            "spec": {"nodeName": node, "hostNetwork": true, "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent"}]}
        })
    };
    let text = std::fs::read_to_string(&env.config).unwrap().replace(
        "node_name = \"edge-1\"",
        &format!(
            "node_name = \"{node}\"\ncri_socket = \"{}\"",
            socket.display()
        ),
    );
    std::fs::write(&env.config, &text).unwrap();
    let c = CriClient::new(&socket);
    let running = |name: &str| {
        let c = c.clone();
        let sel = HashMap::from([(
            labels::POD_UID.to_string(),
            format!("{name}-{}", std::process::id()),
        )]);
        async move {
            let mut ids: Vec<String> = c
                .list_containers(sel)
                .await
                .unwrap_or_default()
                .into_iter()
                .filter(|x| x.state == api::ContainerState::ContainerRunning as i32)
                .map(|x| x.id)
                .collect();
            ids.sort();
            ids
        }
    };

    for variant in ["--reset-cache", "corrupt file moved aside", "new data dir"] {
        // Online: both pods run.
        env.server.set_offline(false).await.unwrap();
        env.server.apply("pods", pod("keep"));
        env.server.apply("pods", pod("gone"));
        let mut child = env.spawn_run(&[]);
        wait_for(30, "both pods run", || async {
            running("keep").await.len() == 1 && running("gone").await.len() == 1
        })
        .await;
        let (keep, gone) = (running("keep").await, running("gone").await);
        kill9(&mut child);

        // Offline, and the cloud no longer has one of them; the cache starts empty.
        env.server.set_offline(true).await.unwrap();
        env.server.remove("pods", "vehicle", "gone");
        let args: Vec<&str> = match variant {
            "--reset-cache" => vec!["--reset-cache"],
            "corrupt file moved aside" => {
                std::fs::write(env.db(), b"this is not a database, it is a vehicle").unwrap();
                vec!["--reset-cache"]
            }
            _ => {
                let fresh = env.dir.path().join("data-fresh");
                let _ = std::fs::remove_dir_all(&fresh);
                std::fs::write(
                    &env.config,
                    text.replace(
                        &env.dir.path().join("data").display().to_string(),
                        &fresh.display().to_string(),
                    ),
                )
                .unwrap();
                vec![]
            }
        };
        // The proof that the runtime left them alone: two of its passes in a row count both
        // sandboxes as kept for want of a pod list. A pass that started stopping them would
        // hold them (a held pod is not counted) or, once done, find them gone, so the second
        // line cannot come after a stop.
        let mut run_args = vec!["--log", "info,edgehub::runtime=debug", "run"];
        run_args.extend_from_slice(&args);
        let mut child = env
            .cmd(&run_args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = stderr_lines(&mut child);
        let mut kept = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while kept < 2 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("{variant}: two runtime passes that keep both pods"));
            if line.contains("reconciled") && line.contains("kept_unsynced: 2") {
                kept += 1;
            }
        }
        assert_eq!(
            running("keep").await,
            keep,
            "{variant}: kept running, same container"
        );
        assert_eq!(
            running("gone").await,
            gone,
            "{variant}: kept running, same container"
        );

        // The link returns: the list has `keep` (adopted as it runs) and not `gone`.
        env.server.set_offline(false).await.unwrap();
        wait_for(30, "the pod the list does not have is removed", || async {
            running("gone").await.is_empty()
        })
        .await;
        assert_eq!(
            running("keep").await,
            keep,
            "{variant}: adopted without a restart"
        );
        kill9(&mut child);
        std::fs::write(&env.config, &text).unwrap();
    }
    let mine = HashMap::from([(labels::NODE.to_string(), node.clone())]);
    for sb in c.list_pod_sandbox(mine).await.unwrap() {
        let _ = c.stop_pod_sandbox(&sb.id).await;
        let _ = c.remove_pod_sandbox(&sb.id).await;
    }
}

/// Names that become paths are checked: a pod uid of `..` (its directory would be the data
/// dir, and its cleanup after a delete would remove everything edgehub has), a volume name
/// and a container name that climb out of the pod's directory. Each such pod is refused with
/// the reason in its status and never touches the disk; the cache still holds it as sent.
// Multi-threaded: the test blocks reading edgehub's stderr while the fake apiserver serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_would_escape_the_pod_directory_are_refused_and_never_touch_the_disk() {
    use edgehub::cri::{labels, CriClient, CriRuntime};
    use std::collections::HashMap;
    let env = Env::new().await;
    let socket = common::cri_stack();
    let node = format!("edge-names-{}", std::process::id());
    let pod = |name: &str, uid: &str, volume: &str, container: &str| {
        serde_json::json!({
            "metadata": {"name": name, "namespace": "vehicle", "uid": uid},
            "spec": {"nodeName": node, "hostNetwork": true, "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 0,
                "volumes": [{"name": volume, "emptyDir": {}}],
                "containers": [{"name": container, "image": "127.0.0.1:5000/busybox:1.0",
                    "imagePullPolicy": "IfNotPresent",
                    "volumeMounts": [{"name": volume, "mountPath": "/data"}]}]}
        })
    };
    let tag = std::process::id();
    env.server.apply("pods", pod("dotdot", "..", "data", "app"));
    env.server.apply(
        "pods",
        pod(
            "badvol",
            &format!("badvol-{tag}"),
            "../../../../escape",
            "app",
        ),
    );
    env.server.apply(
        "pods",
        pod(
            "badname",
            &format!("badname-{tag}"),
            "data",
            "../../../evil",
        ),
    );
    // The node's own identity: its status patches go through the Node authorizer.
    let token = format!("{node}-token");
    env.server.add_token(&token, &format!("system:node:{node}"));
    let kc = env
        .server
        .write_kubeconfig(&env.dir.path().join("kube-names"), &token)
        .unwrap();
    let text: String = std::fs::read_to_string(&env.config)
        .unwrap()
        .lines()
        .map(|l| match l {
            "node_name = \"edge-1\"" => format!(
                "node_name = \"{node}\"\ncri_socket = \"{}\"\n",
                socket.display()
            ),
            l if l.starts_with("kubeconfig = ") => format!("kubeconfig = \"{}\"\n", kc.display()),
            l => format!("{l}\n"),
        })
        .collect();
    std::fs::write(&env.config, &text).unwrap();
    let data = env.db().parent().unwrap().to_path_buf();
    let _cleanup = common::NodeCleanup {
        socket: socket.clone(),
        node: node.clone(),
    };
    let mut child = Running(
        env.cmd(&["--log", "info,edgehub::runtime=debug", "run"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = stderr_lines(&mut child.0);

    // Each is refused with the field and the reason in its status (as the apiserver has it).
    for (name, field) in [
        ("dotdot", "metadata.uid"),
        ("badvol", "spec.volumes[0].name"),
        ("badname", "spec.containers[0].name"),
    ] {
        wait_until(30, &format!("{name} is refused in its status"), || {
            env.server
                .get("pods", "vehicle", name)
                .and_then(|p| p["status"]["conditions"].as_array().cloned())
                .is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c["reason"] == "UnsupportedField"
                            && c["message"].as_str().is_some_and(|m| m.contains(field))
                    })
                })
        })
        .await;
    }
    assert_eq!(
        env.pods_in_db(),
        3,
        "the cache holds them as the server sent them"
    );
    // Nothing of them reached the runtime or the disk outside pods/.
    let c = CriClient::new(&socket);
    let mine = HashMap::from([(labels::NODE.to_string(), node.clone())]);
    assert!(c.list_pod_sandbox(mine).await.unwrap().is_empty());
    let mut top: Vec<String> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        // The image drop directory is edgehub's own (created at start).
        .filter(|n| !n.starts_with("edgehub.db") && n != "images")
        .collect();
    top.sort();
    assert!(top.is_empty() || top == ["pods"], "{top:?}");

    // The operator deletes the `..` pod: edgehub finishes the delete on the apiserver, and
    // the cleanup that follows does not remove the data dir.
    let (code, _) = env
        .server
        .raw(
            Some(edgehub_testsupport::ADMIN_TOKEN),
            "DELETE",
            "/api/v1/namespaces/vehicle/pods/dotdot",
            Some("application/json"),
            Some(&serde_json::json!({"gracePeriodSeconds": 1})),
        )
        .await
        .unwrap();
    assert_eq!(code, 200);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let cleanup = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = lines
            .recv_timeout(left)
            .expect("the deleted pod's cleanup is logged");
        if line.contains("pod_uid=..")
            && (line.contains("pod directory removed") || line.contains("not removing"))
        {
            break line;
        }
    };
    assert!(cleanup.contains("not removing a directory"), "{cleanup}");
    assert!(
        env.server.get("pods", "vehicle", "dotdot").is_none(),
        "deletion finished"
    );
    assert!(
        env.db().exists(),
        "the data dir and its database are still there"
    );
}

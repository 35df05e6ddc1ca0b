//! edgehub's SWUpdate handler (integrations/swupdate/edgehub-swupdate) under Debian's real
//! SWUpdate 2022.12, with .swu files built by integrations/swupdate/edgehub-swu and signed
//! with a key and certificate each test makes (Debian builds SWUpdate for signed images only),
//! against the real edgehub, containerd and the fake apiserver, the link down. Needs root;
//! without it (or without the packages `scripts/setup.sh test` installs) these tests fail,
//! loudly.
//!
//! Each test's SWUpdate keeps everything under its own TMPDIR (SWUpdate puts its control and
//! progress sockets and the extracted update there), runs the handler's `commit` as its
//! post-update command (`-p`), and has a progress client (`swupdate-progress -e`) that hands
//! the update's result, SUCCESS or FAILURE, to the handler, as a device would.

#[path = "common/archive.rs"]
mod archive;
mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/ota.rs"]
mod ota;

use ota::{fleet, repo, run, Fleet, Image};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const HWREV: &str = "1.0";

/// One device's SWUpdate: its TMPDIR, the handler's state dir, the staging directory, and the
/// signing key and certificate its updates are checked with.
struct Swu {
    dir: tempfile::TempDir,
    key: PathBuf,
    cert: PathBuf,
    progress: Option<Child>,
}

impl Swu {
    fn new() -> Swu {
        let dir = tempfile::tempdir().unwrap();
        for sub in ["tmp", "state"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        let key = dir.path().join("signing.key");
        let cert = dir.path().join("signing.crt");
        // SWUpdate checks a CMS signature against this certificate, for the purpose it is
        // started with (emailProtection by default).
        let (ok, log) = run(
            Command::new("openssl")
                .args([
                    "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                ])
                .arg("/CN=edgehub test updates")
                .args(["-addext", "extendedKeyUsage=emailProtection"])
                .args(["-addext", "keyUsage=digitalSignature"])
                .arg("-keyout")
                .arg(&key)
                .arg("-out")
                .arg(&cert),
            &[],
        );
        assert!(ok, "openssl: {log}");
        Swu {
            dir,
            key,
            cert,
            progress: None,
        }
    }

    fn staging(&self) -> PathBuf {
        self.dir.path().join("staging")
    }

    fn handler() -> PathBuf {
        repo("integrations/swupdate/edgehub-swupdate")
    }

    fn env(&self, base: &[(String, String)]) -> Vec<(String, String)> {
        let mut env = base.to_vec();
        env.push((
            "TMPDIR".into(),
            self.dir.path().join("tmp").display().to_string(),
        ));
        env.push((
            "EDGEHUB_SWUPDATE_STATE".into(),
            self.dir.path().join("state").display().to_string(),
        ));
        env
    }

    /// `edgehub-swu` for `targets` and `archives`, signed, with `extra` postinstall scripts.
    fn build(
        &self,
        name: &str,
        targets: &[String],
        archives: &[PathBuf],
        extra: &[&Path],
    ) -> PathBuf {
        let out = self.dir.path().join(format!("{name}.swu"));
        let mut cmd = Command::new(repo("integrations/swupdate/edgehub-swu"));
        cmd.arg("-o")
            .arg(&out)
            .args(["-H", HWREV, "-k"])
            .arg(&self.key)
            .arg("-c")
            .arg(&self.cert)
            .arg("-s")
            .arg(self.staging());
        for x in extra {
            cmd.arg("-x").arg(x);
        }
        for t in targets {
            cmd.arg("-p").arg(t);
        }
        cmd.args(archives);
        let (ok, log) = run(&mut cmd, &[]);
        assert!(ok, "edgehub-swu: {log}");
        out
    }

    fn build_for(&self, f: &Fleet, name: &str, extra: &[&Path]) -> PathBuf {
        self.build(name, &f.targets(), &f.archives(), extra)
    }

    /// The device's progress client, handing each update's result to the handler.
    fn start_progress(&mut self, base: &[(String, String)]) {
        let log = std::fs::File::create(self.dir.path().join("progress.log")).unwrap();
        let child = Command::new("swupdate-progress")
            // `--quiet`: 2022.12 takes no `-q` (its getopt string lacks it, though its help lists it).
            .args(["-w", "--quiet", "-e"])
            .arg(Self::handler())
            .arg("-s")
            .arg(self.dir.path().join("tmp/swupdateprog"))
            .envs(self.env(base))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("swupdate-progress (Debian package swupdate)");
        self.progress = Some(child);
        // It exits at once on an option it does not take (printing its usage): the failure
        // path would then silently never run.
        std::thread::sleep(Duration::from_millis(300));
        let exited = self
            .progress
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten());
        assert!(
            exited.is_none(),
            "swupdate-progress exited ({exited:?}):\n{}",
            self.progress_log()
        );
    }

    fn progress_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("progress.log")).unwrap_or_default()
    }

    /// `swupdate -i FILE` as the device runs it: (success, what it printed).
    fn install(&self, base: &[(String, String)], swu: &Path) -> (bool, String) {
        run(&mut self.install_cmd(swu), &self.env(base))
    }

    fn install_cmd(&self, swu: &Path) -> Command {
        let mut cmd = Command::new("swupdate");
        cmd.arg("-v")
            .arg("-H")
            .arg(format!("edgehub-test:{HWREV}"))
            .arg("-k")
            .arg(&self.cert)
            .arg("-p")
            .arg(format!("{} commit", Self::handler().display()))
            .arg("-i")
            .arg(swu)
            .stdin(Stdio::null());
        cmd
    }

    /// The transaction the handler is waiting to see decided, if any.
    fn undecided(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.path().join("state/transaction"))
            .ok()
            .map(|s| s.trim().to_string())
    }
}

impl Drop for Swu {
    fn drop(&mut self) {
        if let Some(mut c) = self.progress.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// ---- Without transactions: the .swu, its signature, the handler's checks ----

/// The .swu: sw-description first, then its signature, the manifest, the archives and the
/// handler; SWUpdate accepts it signed with the device's certificate and refuses it with
/// another, and refuses an update for other hardware.
#[test]
fn the_swu_is_signed_and_swupdate_checks_it() {
    let s = Swu::new();
    let a = s.dir.path().join("app.tar");
    std::fs::write(&a, b"an archive").unwrap();
    let swu = s.build(
        "check-1",
        &["vehicle/telemetry-sv74m@55778fbb9f".into()],
        &[a],
        &[],
    );
    let out = Command::new("cpio")
        .arg("-it")
        .stdin(std::fs::File::open(&swu).unwrap())
        .output()
        .unwrap();
    let names = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(
        names.lines().collect::<Vec<_>>(),
        [
            "sw-description",
            "sw-description.sig",
            "pods",
            "app.tar",
            "edgehub-swupdate"
        ]
    );
    let check = |cert: &Path, hw: &str| {
        run(
            Command::new("swupdate")
                .arg("-c")
                .arg("-H")
                .arg(format!("edgehub-test:{hw}"))
                .arg("-k")
                .arg(cert)
                .arg("-i")
                .arg(&swu),
            &s.env(&[]),
        )
    };
    // `swupdate -c` (a dry run) exits non-zero even when the check passes (it asks for the
    // post-update step over a control socket no daemon serves): its log says the verdict.
    let passed =
        |log: &str| log.contains("SWUPDATE successful") && !log.contains("SWUPDATE failed");
    let (_, log) = check(&s.cert, HWREV);
    assert!(passed(&log), "swupdate -c refused a good .swu:\n{log}");
    let other = Swu::new();
    let (_, log) = check(&other.cert, HWREV);
    assert!(
        !passed(&log) && log.contains("SWUPDATE failed"),
        "another certificate verified it:\n{log}"
    );
    let (_, log) = check(&s.cert, "2.0");
    assert!(
        !passed(&log) && log.contains("SWUPDATE failed"),
        "installs on other hardware:\n{log}"
    );
}

/// What a broken update gets from the handler: SWUpdate fails with the handler's reason
/// before edgehub is asked anything, and the staging directory is left empty.
#[test]
fn a_manifest_the_handler_cannot_trust_fails_the_update_before_edgehub_is_asked() {
    let s = Swu::new();
    let env = vec![("EDGEHUB".to_string(), "/nonexistent/edgehub".to_string())];
    for (case, targets, want) in [
        (
            "a bad name",
            vec!["vehicle/Bad_Name".to_string()],
            "manifest line 2: not NAMESPACE/POD[@REVISION]: vehicle/Bad_Name",
        ),
        (
            "a pod twice",
            vec!["vehicle/a".into(), "vehicle/a@b1".into()],
            "vehicle/a is named twice",
        ),
        (
            "a word for the shell",
            vec!["vehicle/a;reboot".into()],
            "not NAMESPACE/POD[@REVISION]: vehicle/a;reboot",
        ),
    ] {
        let swu = s.build("bad", &targets, &[], &[]);
        let (ok, log) = s.install(&env, &swu);
        assert!(!ok, "{case}: installed:\n{log}");
        assert!(
            log.contains(want),
            "{case}: SWUpdate does not say {want:?}:\n{log}"
        );
        assert!(
            !log.contains("nonexistent"),
            "{case}: asked edgehub:\n{log}"
        );
        assert!(
            ota::files_under(&s.staging()).is_empty(),
            "{case}: {:?}",
            ota::files_under(&s.staging())
        );
        assert_eq!(s.undecided(), None);
    }
    // The handler's own arguments.
    for args in [
        vec!["postinst"],
        vec!["postinst", "relative/dir"],
        vec!["postinst", "/var/../etc"],
        vec!["preinst", "/"],
        vec!["bogus"],
    ] {
        let (ok, log) = run(
            Command::new("busybox")
                .arg("sh")
                .arg(Swu::handler())
                .args(&args),
            &s.env(&env),
        );
        assert!(!ok, "{args:?}: {log}");
    }
    // Nothing undecided: the hooks have nothing to do, and say so.
    for hook in ["commit", "SUCCESS", "FAILURE", "rollback"] {
        let (ok, log) = run(
            Command::new("busybox")
                .arg("sh")
                .arg(Swu::handler())
                .arg(hook),
            &s.env(&env),
        );
        assert!(
            ok && log.contains("no undecided transaction"),
            "{hook}: {log}"
        );
    }
}

// ---- The transactions, end to end ----

/// A good update: SWUpdate succeeds, its post-update command commits, the new revision runs,
/// and still after edgehub restarts offline; the cloud hears UpgradeSucceeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_update_commits_and_the_new_revision_runs_after_an_offline_restart() {
    let mut f = fleet("sgood", &[Image::Good]).await;
    let mut s = Swu::new();
    s.start_progress(&f.env());
    let swu = s.build("good", &f.targets_at(), &f.archives(), &[]);
    let (ok, log) = s.install(&f.env(), &swu);
    assert!(ok, "swupdate:\n{log}\nedgehub:\n{}", f.n.log());
    assert!(log.contains("every pod is Verified"), "{log}");
    f.wait_transaction(30, &["Committed"]).await;
    f.wait_all_run(10, true).await;
    f.wait_for(
        10,
        "the handler forgets the decided transaction",
        |_| async { s.undecided().is_none() },
    )
    .await;
    assert!(ota::files_under(&s.staging()).is_empty());
    f.restart();
    f.wait_all_run(60, true).await;
    f.link_returns_and_the_cloud_hears("UpgradeSucceeded", true)
        .await;
    f.clean().await;
}

/// A new image that never passes its readiness probe: the transaction rolls back by itself
/// and SWUpdate's update fails with edgehub's reason; the old revision runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_that_fails_its_readiness_probe_fails_the_update_with_the_reason() {
    let f = fleet("sbroken", &[Image::Broken]).await;
    let mut s = Swu::new();
    s.start_progress(&f.env());
    let swu = s.build_for(&f, "broken", &[]);
    let (ok, log) = s.install(&f.env(), &swu);
    assert!(!ok, "installed:\n{log}");
    assert!(
        log.contains("not ready"),
        "SWUpdate does not say why:\n{log}"
    );
    let t = f.wait_transaction(10, &["RolledBack"]).await;
    assert!(
        t["reason"].as_str().unwrap_or("").contains("not ready"),
        "{t}"
    );
    f.wait_all_run(10, false).await;
    assert_eq!(s.undecided(), None);
    f.clean().await;
}

/// A step after edgehub's fails (the product's own postinstall script): SWUpdate's update
/// fails, its progress client hands FAILURE to the handler, and the old revision comes back
/// from Verified; the cloud hears why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_step_failing_brings_the_old_revision_back_from_verified() {
    let f = fleet("slater", &[Image::Good]).await;
    let mut s = Swu::new();
    s.start_progress(&f.env());
    let step = s.dir.path().join("product-step");
    std::fs::write(
        &step,
        "#!/bin/sh\necho 'the product step fails' >&2\nexit 1\n",
    )
    .unwrap();
    let swu = s.build_for(&f, "later", &[&step]);
    let (ok, log) = s.install(&f.env(), &swu);
    assert!(!ok, "installed:\n{log}");
    assert!(
        log.contains("every pod is Verified") && log.contains("the product step fails"),
        "edgehub's step reached Verified, then the product's failed:\n{log}"
    );
    f.wait_for(60, "the progress client's FAILURE rolls back", |f| async {
        let done = f
            .transactions()
            .is_ok_and(|t| t.first().is_some_and(|t| t["state"] == "RolledBack"));
        assert!(
            done || !s.progress_log().contains("Executed"),
            "the handler failed:\n{}",
            s.progress_log()
        );
        done
    })
    .await;
    let t = f.wait_transaction(1, &["RolledBack"]).await;
    assert_eq!(t["decision"], "rollback", "{t}\n{}", s.progress_log());
    assert!(
        t["reason"]
            .as_str()
            .unwrap_or("")
            .contains("swupdate: the update failed"),
        "{t}"
    );
    f.wait_all_run(10, false).await;
    f.wait_for(
        10,
        "the handler forgets the decided transaction",
        |_| async { s.undecided().is_none() },
    )
    .await;
    f.link_returns_and_the_cloud_hears("UpgradeRolledBack", false)
        .await;
    f.clean().await;
}

/// Two pods in one update, the second one's image broken: both end at their old revision and
/// the update fails naming the broken pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_the_second_broken_both_end_at_their_old_revision() {
    let f = fleet("stwo", &[Image::Good, Image::Broken]).await;
    let mut s = Swu::new();
    s.start_progress(&f.env());
    let swu = s.build_for(&f, "two", &[]);
    let (ok, log) = s.install(&f.env(), &swu);
    assert!(!ok, "installed:\n{log}");
    assert!(log.contains("gateway-v9hb2"), "{log}");
    f.wait_transaction(30, &["RolledBack"]).await;
    f.wait_all_run(30, false).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.undecided(), None);
    f.clean().await;
}

/// edgehub killed between the install and the commit: a product step after edgehub's kills
/// it while its pods wait at Verified; SWUpdate's post-update command waits for edgehub to
/// answer again (the test starts it again, as its service manager would) and commits. The
/// transaction ends committed or rolled back, and exactly one revision runs, the one it says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edgehub_killed_between_install_and_commit_ends_in_one_revision() {
    let mut f = fleet("skill", &[Image::Good]).await;
    let mut s = Swu::new();
    s.start_progress(&f.env());
    let pid = f.n.child.as_ref().unwrap().id();
    let step = s.dir.path().join("kill-edgehub");
    std::fs::write(&step, format!("#!/bin/sh\nkill -9 {pid}\n")).unwrap();
    let swu = s.build_for(&f, "kill", &[&step]);
    let log_path = s.dir.path().join("swupdate.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut swupdate = s
        .install_cmd(&swu)
        .envs(s.env(&f.env()))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(mut c) = f.n.child.take() {
            if c.try_wait().unwrap().is_some() {
                break;
            }
            f.n.child = Some(c);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the product step never killed edgehub:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    f.n.start();
    let status = loop {
        if let Some(st) = swupdate.try_wait().unwrap() {
            break st;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "swupdate does not end"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let out = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(out.contains("every pod is Verified"), "{out}");
    let end = f
        .wait_transaction(60, &["Committed", "RolledBack", "Failed"])
        .await;
    match end["state"].as_str() {
        Some("Committed") => {
            assert!(status.success(), "committed, but SWUpdate failed:\n{out}");
            f.wait_all_run(30, true).await;
        }
        Some("RolledBack") => {
            assert!(
                !status.success(),
                "rolled back, but SWUpdate succeeded:\n{out}"
            );
            f.wait_all_run(30, false).await;
        }
        _ => panic!("{end}\n{out}"),
    }
    println!(
        "after edgehub's restart the transaction ended {}",
        end["state"]
    );
    f.clean().await;
}

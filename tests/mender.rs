//! edgehub's Mender Update Module (integrations/mender/edgehub) under Debian's real Mender
//! client 3.4 in standalone mode (`mender install`, `commit`, `rollback`), with Artifacts
//! built by integrations/mender/edgehub-artifact and Debian's mender-artifact 3.9, against the
//! real edgehub, containerd and the fake apiserver, the link down. Needs root; without it (or
//! without the packages `scripts/setup.sh test` installs) these tests fail, loudly.
//!
//! Mender 3.4 runs Update Modules only from /usr/share/mender/modules/v3 (its ModulesPath is
//! not read from mender.conf) and reads /etc/mender/artifact_info until its first commit: each
//! test runs mender in a mount namespace of its own (`unshare -m`) with its own directories
//! bound over those two, so nothing on the machine changes and tests run side by side. The
//! config (`--config`), state (`--data`) and device_type (in the data dir) are the test's.

#[path = "common/archive.rs"]
mod archive;
mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/ota.rs"]
mod ota;

use ota::{fleet, repo, run, Fleet, Image};
use std::path::{Path, PathBuf};
use std::process::Command;

const DEVICE_TYPE: &str = "edgehub-test";

/// A standalone Mender client of its own: modules, /etc/mender and the data dir in a tempdir.
struct Mender {
    dir: tempfile::TempDir,
}

impl Mender {
    fn new() -> Mender {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for sub in ["modules", "etc", "data"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        // The module itself, as the Yocto layer installs it.
        let module = d.join("modules/edgehub");
        std::fs::copy(repo("integrations/mender/edgehub"), &module).unwrap();
        set_mode(&module, 0o755);
        std::fs::write(d.join("etc/mender.conf"), "{}\n").unwrap();
        std::fs::write(d.join("etc/artifact_info"), "artifact_name=factory\n").unwrap();
        std::fs::write(
            d.join("data/device_type"),
            format!("device_type={DEVICE_TYPE}\n"),
        )
        .unwrap();
        Mender { dir }
    }

    /// `mender ARGS...` with `env`: (success, everything it printed).
    fn run(&self, env: &[(String, String)], args: &[&str]) -> (bool, String) {
        let d = self.dir.path();
        let mut cmd = Command::new("unshare");
        cmd.args(["-m", "--propagation", "private", "sh", "-c"])
            .arg(
                "mount --bind \"$1\" /usr/share/mender/modules/v3 && \
                 mount --bind \"$2\" /etc/mender && shift 2 && exec mender --no-syslog \
                 --config \"$CONF\" --fallback-config \"$CONF.none\" --data \"$DATA\" \"$@\"",
            )
            .arg("mender")
            .arg(d.join("modules"))
            .arg(d.join("etc"))
            .args(args)
            .env("CONF", d.join("etc/mender.conf"))
            .env("DATA", d.join("data"));
        run(&mut cmd, env)
    }

    fn install(&self, env: &[(String, String)], artifact: &Path) -> (bool, String) {
        self.run(env, &["install", artifact.to_str().unwrap()])
    }

    fn show_artifact(&self) -> String {
        let (ok, out) = self.run(&[], &["show-artifact"]);
        assert!(ok, "{out}");
        out.lines()
            .find(|l| !l.contains("level="))
            .unwrap_or("")
            .trim()
            .to_string()
    }

    /// The module's working trees Mender keeps until Cleanup.
    fn payload_trees(&self) -> Vec<PathBuf> {
        ota::files_under(&self.dir.path().join("data/modules"))
    }

    fn set_verify_key(&self, pem: &Path) {
        std::fs::write(
            self.dir.path().join("etc/mender.conf"),
            format!("{{\"ArtifactVerifyKey\": \"{}\"}}\n", pem.display()),
        )
        .unwrap();
    }
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// `edgehub-artifact` with `args`: the Artifact's path.
fn artifact(dir: &Path, name: &str, args: &[String]) -> PathBuf {
    let out = dir.join(format!("{name}.mender"));
    let mut cmd = Command::new(repo("integrations/mender/edgehub-artifact"));
    cmd.args(["-n", name, "-t", DEVICE_TYPE, "-o"])
        .arg(&out)
        .args(args);
    let (ok, log) = run(&mut cmd, &[]);
    assert!(ok, "edgehub-artifact: {log}");
    out
}

/// The Artifact of a fleet's update: its pods and their archives.
fn fleet_artifact(f: &Fleet, name: &str) -> PathBuf {
    fleet_artifact_of(f, name, f.targets())
}

fn fleet_artifact_of(f: &Fleet, name: &str, targets: Vec<String>) -> PathBuf {
    let mut args = Vec::new();
    for t in targets {
        args.push("-p".to_string());
        args.push(t);
    }
    for a in f.archives() {
        args.push(a.display().to_string());
    }
    artifact(f.work.path(), name, &args)
}

// ---- Without transactions: the Artifact, the module's checks, edgehub refusing an image ----

/// The Artifact carries the manifest and the archives as one payload of type edgehub, and a
/// signed one installs only with the key that verifies it.
#[test]
fn the_artifact_carries_the_manifest_and_the_archives_and_its_signature_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("app.tar");
    std::fs::write(&a, b"not really an archive").unwrap();
    let key = dir.path().join("key.pem");
    let (ok, log) = run(
        // mender-artifact 3.9 reads an RSA key in PKCS#1 form, not OpenSSL 3's PKCS#8 default.
        Command::new("openssl")
            .args(["genrsa", "-traditional", "-out"])
            .arg(&key)
            .arg("2048"),
        &[],
    );
    assert!(ok, "{log}");
    let public = dir.path().join("public.pem");
    let (ok, log) = run(
        Command::new("openssl")
            .args(["pkey", "-pubout", "-in"])
            .arg(&key)
            .arg("-out")
            .arg(&public),
        &[],
    );
    assert!(ok, "{log}");
    let signed = artifact(
        dir.path(),
        "signed-1",
        &[
            "-k".into(),
            key.display().to_string(),
            "-p".into(),
            "vehicle/telemetry-sv74m@55778fbb9f".into(),
            "-p".into(),
            "vehicle/gateway-v9hb2".into(),
            a.display().to_string(),
        ],
    );
    let (ok, read) = run(
        Command::new("mender-artifact")
            .arg("read")
            .arg(&signed)
            .arg("-k")
            .arg(&public),
        &[],
    );
    assert!(ok, "{read}");
    for want in [
        "Type:   edgehub",
        "name:     pods",
        "name:     app.tar",
        "Signature: signed and verified correctly",
        &format!("Compatible devices: '[{DEVICE_TYPE}]'"),
    ] {
        assert!(
            read.contains(want),
            "mender-artifact read lacks {want:?}:\n{read}"
        );
    }
    // The manifest as the module will read it.
    let (ok, log) = run(
        Command::new("sh").arg("-c").arg(format!(
            "tar -xOf {} data/0000.tar.gz | tar -xzO pods",
            signed.display()
        )),
        &[],
    );
    assert!(ok, "{log}");
    let pods: Vec<&str> = log.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        pods,
        [
            "vehicle/telemetry-sv74m@55778fbb9f",
            "vehicle/gateway-v9hb2"
        ]
    );

    // A device that verifies Artifacts refuses an unsigned one before any module runs.
    let unsigned = artifact(
        dir.path(),
        "unsigned-1",
        &["-p".into(), "vehicle/telemetry-sv74m".into()],
    );
    let m = Mender::new();
    m.set_verify_key(&public);
    let env = [("EDGEHUB".to_string(), "/nonexistent/edgehub".to_string())];
    let (ok, out) = m.install(&env, &unsigned);
    assert!(!ok, "an unsigned Artifact installed:\n{out}");
    assert!(
        !out.contains("edgehub-mender-module"),
        "the module ran:\n{out}"
    );
    assert_eq!(m.show_artifact(), "factory");
}

/// A hostile payload: what it is, its files as (name, content), what the install must say.
type Case = (&'static str, Vec<(&'static str, String)>, &'static str);

/// What a hostile or broken Artifact gets: the install fails with the module's reason before
/// edgehub is asked anything (EDGEHUB names no binary: asking it would fail otherwise), Mender
/// keeps its old Artifact and removes the module's tree.
#[test]
fn a_payload_the_module_cannot_trust_fails_the_install_before_edgehub_is_asked() {
    let dir = tempfile::tempdir().unwrap();
    let m = Mender::new();
    let env = [("EDGEHUB".to_string(), "/nonexistent/edgehub".to_string())];
    let many: String = (0..17).map(|i| format!("vehicle/pod-{i}\n")).collect();
    let huge = format!("vehicle/telemetry-sv74m\n#{}\n", "x".repeat(70_000));
    let cases: Vec<Case> = vec![
        (
            "no manifest",
            vec![("app.tar", "x".into())],
            "the payload has no manifest 'pods'",
        ),
        (
            "an empty manifest",
            vec![("pods", "# nothing\n\n".into())],
            "the manifest names no pod",
        ),
        (
            "an upper-case name",
            vec![("pods", "vehicle/Telemetry\n".into())],
            "manifest line 1: not NAMESPACE/POD[@REVISION]: vehicle/Telemetry",
        ),
        (
            "no namespace",
            vec![("pods", "telemetry-sv74m\n".into())],
            "manifest line 1: not NAMESPACE/POD[@REVISION]",
        ),
        (
            "a path",
            vec![("pods", "vehicle/../etc\n".into())],
            "manifest line 1: not NAMESPACE/POD[@REVISION]: vehicle/../etc",
        ),
        (
            "a shell word",
            vec![("pods", "vehicle/$(reboot)\n".into())],
            "manifest line 1: not NAMESPACE/POD[@REVISION]",
        ),
        (
            "an option",
            vec![("pods", "--force\n".into())],
            "manifest line 1: not NAMESPACE/POD[@REVISION]: --force",
        ),
        (
            "two on a line",
            vec![("pods", "# c\nvehicle/a vehicle/b\n".into())],
            "manifest line 2: one NAMESPACE/POD[@REVISION] a line",
        ),
        (
            "an empty revision",
            vec![("pods", "vehicle/a@\n".into())],
            "manifest line 1: not NAMESPACE/POD[@REVISION]: vehicle/a@",
        ),
        (
            "a pod twice",
            vec![("pods", "vehicle/a\nvehicle/a@abc\n".into())],
            "manifest line 2: vehicle/a is named twice",
        ),
        (
            "carriage returns",
            vec![("pods", "vehicle/a\r\n".into())],
            "manifest line 1: not NAMESPACE/POD[@REVISION]",
        ),
        (
            "17 pods",
            vec![("pods", many)],
            "the manifest names more than 16 pods",
        ),
        (
            "a huge manifest",
            vec![("pods", huge)],
            "the manifest is over 65536 bytes",
        ),
        (
            "a script in the payload",
            vec![("pods", "vehicle/a\n".into()), ("evil.sh", "reboot".into())],
            "evil.sh is neither the manifest 'pods' nor an image archive",
        ),
    ];
    for (case, files, want) in &cases {
        let payload = dir.path().join(case.replace(' ', "-"));
        std::fs::create_dir_all(&payload).unwrap();
        let mut cmd = Command::new("mender-artifact");
        let out = payload.join("a.mender");
        cmd.args([
            "write",
            "module-image",
            "-T",
            "edgehub",
            "-n",
            "bad-1",
            "-t",
            DEVICE_TYPE,
            "-o",
        ])
        .arg(&out);
        for (name, content) in files {
            let p = payload.join(name);
            std::fs::write(&p, content).unwrap();
            cmd.arg("-f").arg(&p);
        }
        let (ok, log) = run(&mut cmd, &[]);
        assert!(ok, "{case}: mender-artifact: {log}");
        let (ok, log) = m.install(&env, &out);
        assert!(!ok, "{case}: installed:\n{log}");
        assert!(
            log.contains(want),
            "{case}: the install does not say {want:?}:\n{log}"
        );
        assert!(
            !log.contains("nonexistent"),
            "{case}: the module asked edgehub:\n{log}"
        );
        assert_eq!(m.show_artifact(), "factory", "{case}");
        assert!(
            m.payload_trees().is_empty(),
            "{case}: {:?}",
            m.payload_trees()
        );
    }

    // The same checks under busybox's shell (a Yocto image may have nothing else), on the
    // module called as Mender calls it.
    for (case, files, want) in &cases {
        let tree = dir.path().join(format!("tree-{}", case.replace(' ', "-")));
        std::fs::create_dir_all(tree.join("files")).unwrap();
        std::fs::create_dir_all(tree.join("tmp")).unwrap();
        for (name, content) in files {
            std::fs::write(tree.join("files").join(name), content).unwrap();
        }
        let (ok, log) = run(
            Command::new("busybox")
                .args(["sh"])
                .arg(repo("integrations/mender/edgehub"))
                .arg("ArtifactInstall")
                .arg(&tree),
            &env,
        );
        assert!(!ok && log.contains(want), "busybox sh, {case}: {log}");
    }
    // And the protocol's answers.
    for (state, want) in [
        ("SupportsRollback", "Yes\n"),
        ("NeedsArtifactReboot", "No\n"),
    ] {
        let out = Command::new("busybox")
            .args(["sh"])
            .arg(repo("integrations/mender/edgehub"))
            .arg(state)
            .arg(dir.path())
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), want, "{state}");
    }
}

/// An image edgehub refuses (no cached revision names it) fails the install with edgehub's
/// reason; no transaction starts, and the rollback Mender then runs finds nothing to undo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_edgehub_refuses_fails_the_install_and_starts_no_transaction() {
    let f = fleet("mrefuse", &[Image::Good]).await;
    let dir = tempfile::tempdir().unwrap();
    let stray = format!("127.0.0.1:1/stray-{}:9.9", std::process::id());
    let built = archive::build(dir.path(), &stray, "hello from nowhere", 0);
    let a = archive::oci_archive(&built, &dir.path().join("stray.tar"));
    let art = artifact(
        dir.path(),
        "stray-1",
        &["-p".into(), f.pods[0].target(), a.display().to_string()],
    );
    let m = Mender::new();
    let (ok, log) = m.install(&f.env(), &art);
    assert!(!ok, "installed:\n{log}");
    assert!(
        log.contains(&stray) && log.contains("edgehub could not load stray.tar"),
        "{log}"
    );
    assert!(
        log.contains("no transaction was started: nothing to roll back"),
        "{log}"
    );
    assert_eq!(m.show_artifact(), "factory");
    f.wait_all_run(10, false).await;
    f.clean().await;
}

// ---- The transactions, end to end ----

/// A good update (its manifest naming the revision): `mender install` ends with every pod
/// Verified, `mender commit` commits; the new revision runs, and still after edgehub restarts
/// offline; when the link returns, the cloud hears UpgradeSucceeded and the pod object goes
/// for its replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_update_commits_and_the_new_revision_runs_after_an_offline_restart() {
    let mut f = fleet("mgood", &[Image::Good]).await;
    // With the revision the pod must reach: edgehub checks it against its cache's target.
    let art = fleet_artifact_of(&f, "good-1", f.targets_at());
    let m = Mender::new();
    let (ok, log) = m.install(&f.env(), &art);
    assert!(ok, "mender install:\n{log}\nedgehub:\n{}", f.n.log());
    assert!(log.contains("every pod is Verified"), "{log}");
    let t = f.wait_transaction(5, &["Verified"]).await;
    f.wait_all_run(10, true).await;
    assert_eq!(m.show_artifact(), "factory", "not committed yet");

    let (ok, log) = m.run(&f.env(), &["commit"]);
    assert!(ok, "mender commit:\n{log}");
    let done = f.wait_transaction(5, &["Committed"]).await;
    assert_eq!(done["id"], t["id"]);
    assert_eq!(m.show_artifact(), "good-1");
    f.wait_all_run(10, true).await;

    f.restart();
    f.wait_all_run(60, true).await;
    f.link_returns_and_the_cloud_hears("UpgradeSucceeded", true)
        .await;
    f.clean().await;
}

/// A new image that never passes its readiness probe: the transaction rolls back by itself,
/// `mender install` fails with edgehub's reason, the old revision runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_that_fails_its_readiness_probe_rolls_back_and_the_install_says_why() {
    let f = fleet("mbroken", &[Image::Broken]).await;
    let art = fleet_artifact(&f, "broken-1");
    let m = Mender::new();
    let (ok, log) = m.install(&f.env(), &art);
    assert!(!ok, "installed:\n{log}");
    assert!(
        log.contains("not ready"),
        "the install does not say why:\n{log}"
    );
    assert!(
        log.contains("the transaction did not reach Verified"),
        "{log}"
    );
    let t = f.wait_transaction(5, &["RolledBack"]).await;
    assert!(
        t["reason"].as_str().unwrap_or("").contains("not ready"),
        "{t}"
    );
    f.wait_all_run(10, false).await;
    assert_eq!(m.show_artifact(), "factory");
    assert!(m.payload_trees().is_empty());
    f.clean().await;
}

/// The manager decides against the update after the install (its commit deadline set to 10
/// minutes): `mender rollback` brings the old revision back from Verified, and the cloud hears
/// why when the link returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mender_rollback_brings_the_old_revision_back_from_verified() {
    let f = fleet("mrollback", &[Image::Good]).await;
    let art = fleet_artifact(&f, "rollback-1");
    let m = Mender::new();
    // The commit deadline the module passes on (`--timeout`).
    let mut env = f.env();
    env.push(("EDGEHUB_OTA_TIMEOUT".into(), "10m".into()));
    let (ok, log) = m.install(&env, &art);
    assert!(ok, "mender install:\n{log}");
    let t = f.wait_transaction(5, &["Verified"]).await;
    assert_eq!(t["commitTimeoutSeconds"], 600, "{t}");
    f.wait_all_run(10, true).await;

    let (ok, log) = m.run(&f.env(), &["rollback"]);
    assert!(ok, "mender rollback:\n{log}");
    let t = f.wait_transaction(30, &["RolledBack"]).await;
    assert_eq!(t["decision"], "rollback", "{t}");
    assert!(
        t["reason"]
            .as_str()
            .unwrap_or("")
            .contains("mender: ArtifactRollback"),
        "{t}"
    );
    f.wait_all_run(10, false).await;
    assert_eq!(m.show_artifact(), "factory");
    f.link_returns_and_the_cloud_hears("UpgradeRolledBack", false)
        .await;
    f.clean().await;
}

/// edgehub killed between `mender install` and `mender commit`: after its restart the commit
/// ends the transaction committed, or Mender's failure path rolls it back; either way exactly
/// one revision runs, the one the transaction's end says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edgehub_killed_between_install_and_commit_ends_in_one_revision() {
    let mut f = fleet("mkill", &[Image::Good]).await;
    let art = fleet_artifact(&f, "kill-1");
    let m = Mender::new();
    let (ok, log) = m.install(&f.env(), &art);
    assert!(ok, "mender install:\n{log}");
    f.wait_transaction(5, &["Verified"]).await;
    f.restart();
    let (ok, log) = m.run(&f.env(), &["commit"]);
    let end = f
        .wait_transaction(60, &["Committed", "RolledBack", "Failed"])
        .await;
    match end["state"].as_str() {
        Some("Committed") => {
            assert!(ok, "committed, but mender commit failed:\n{log}");
            assert_eq!(m.show_artifact(), "kill-1");
            f.wait_all_run(30, true).await;
        }
        Some("RolledBack") => {
            assert!(!ok, "rolled back, but mender commit succeeded:\n{log}");
            assert_eq!(m.show_artifact(), "factory");
            f.wait_all_run(30, false).await;
        }
        _ => panic!("{end}\n{log}"),
    }
    println!(
        "after edgehub's restart the transaction ended {}",
        end["state"]
    );
    f.clean().await;
}

/// Two pods in one transaction, the second one's image broken: the first, already Verified,
/// rolls back too, and both end at their old revision; the install names the broken pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_the_second_broken_both_end_at_their_old_revision() {
    let f = fleet("mtwo", &[Image::Good, Image::Broken]).await;
    let art = fleet_artifact(&f, "two-1");
    let m = Mender::new();
    let (ok, log) = m.install(&f.env(), &art);
    assert!(!ok, "installed:\n{log}");
    assert!(
        log.contains("gateway-v9hb2"),
        "the install names the broken pod:\n{log}"
    );
    let t = f.wait_transaction(30, &["RolledBack"]).await;
    assert!(
        t["reason"].as_str().unwrap_or("").contains("gateway-v9hb2"),
        "{t}"
    );
    f.wait_all_run(30, false).await;
    assert_eq!(m.show_artifact(), "factory");
    f.link_returns_and_the_cloud_hears("UpgradeRolledBack", false)
        .await;
    f.clean().await;
}

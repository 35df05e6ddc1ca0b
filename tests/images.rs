//! Side-loaded images end to end (issue 23): archives of images no registry has, built the
//! way scripts/cri-stack.sh builds its test images, loaded into the shared real containerd
//! through the edgehub binary (CLI, local API, drop directory), with the fake apiserver's
//! cached revisions deciding what may go in. "Offline" is both the apiserver link cut and
//! an image whose registry cannot be reached (`127.0.0.1:1`, where nothing listens). Needs
//! root; without it these tests fail, loudly.

#[path = "common/archive.rs"]
mod archive;
mod common;
#[path = "common/edge.rs"]
mod edge;

use edge::{node, Node};
use edgehub::containerd::Containerd;
use edgehub::cri::CriRuntime;
use std::io::Write;
use std::time::{Duration, Instant};

fn containerd() -> Containerd {
    Containerd::new(&common::cri_stack())
}

/// `edgehub images load ARGS...` against the node's API: (success, stdout + stderr).
fn load(n: &Node, args: &[&str]) -> (bool, String) {
    let mut all = vec!["images", "load"];
    all.extend_from_slice(args);
    let out = n.cmd(&all).output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Waits until nothing of an import is left in containerd: none of `blobs`, no image whose
/// name contains `image`, no lease of the node's imports.
async fn nothing_left(n: &Node, blobs: &[String], image: &str) {
    let cd = containerd();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let have: Vec<String> = cd
            .blobs()
            .await
            .unwrap()
            .into_iter()
            .map(|b| b.digest)
            .collect();
        let stray_blobs: Vec<&String> = blobs.iter().filter(|b| have.contains(b)).collect();
        let names: Vec<String> = cd
            .image_names()
            .await
            .unwrap()
            .into_iter()
            .filter(|i| i.contains(image))
            .collect();
        let leases = cd
            .leases(&format!("labels.\"edgehub.io/import\"=={}", n.name))
            .await
            .unwrap();
        if stray_blobs.is_empty() && names.is_empty() && leases.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "left behind: blobs {stray_blobs:?}, images {names:?}, leases {leases:?}\n{}",
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn remove_images(part: &str) {
    let cd = containerd();
    for name in cd.image_names().await.unwrap_or_default() {
        if name.contains(part) {
            let _ = cd.delete_image(&name).await;
        }
    }
}

/// The first case: an image no registry has, loaded with the link down and its
/// registry unreachable; `PodImageReady` turns True; the offline in-place upgrade to the
/// revision naming it ends Done, and the new container prints the new line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_side_loaded_image_no_registry_has_upgrades_offline() {
    let repo = format!("sideload-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:3.0");
    let mut n = node("sideload").await;
    n.rolled_to_and_offline(Some(&image)).await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 412, "{body}");
    assert!(
        body.contains(&image) && body.contains("edgehub images load"),
        "{body}"
    );

    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), &image, "hello from 3.0 (side-loaded)", 0);
    let file = archive::oci_archive(&built, &dir.path().join("app.tar.gz"));
    let (ok, out) = load(&n, &[file.to_str().unwrap()]);
    assert!(ok, "{out}\n{}", n.log());
    assert!(out.contains(&format!("loaded {image}")), "{out}");
    let img = n.cri.image_status(&image).await.unwrap();
    assert!(img.is_some(), "the CRI sees the side-loaded image at once");

    n.wait_for(
        30,
        "PodImageReady True for the side-loaded revision",
        |n| async move {
            n.condition("PodImageReady")
                .is_some_and(|c| c["status"] == "True")
        },
    )
    .await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let done = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(done["state"], "Done", "{done}\n{}", n.log());
    let app = n.running("app").await;
    assert_eq!(app.len(), 1);
    assert_eq!(app[0].image.as_ref().unwrap().image, image);
    let attempt = app[0].metadata.as_ref().unwrap().attempt;
    n.wait_for(
        15,
        "the side-loaded container prints its line",
        |n| async move {
            n.pod_log("app", attempt)
                .contains("hello from 3.0 (side-loaded)")
        },
    )
    .await;
    n.clean().await;
    remove_images(&repo).await;
}

/// A template that pins a digest takes that manifest byte for byte: an archive whose
/// manifest differs by one byte is refused and leaves nothing; the right one goes in under
/// the pinned name, which the CRI resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_digest_takes_only_that_manifest() {
    let repo = format!("pinned-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let good = archive::build(dir.path(), &format!("127.0.0.1:1/{repo}:2.0"), "pinned", 0);
    let good_file = archive::oci_archive(&good, &dir.path().join("good.tar"));
    let pinned = format!("127.0.0.1:1/{repo}@{}", good.manifest);
    let mut n = node("pinned").await;
    n.start();
    n.roll();
    let hash = edge::third_revision(&n.server, &pinned);
    let want = format!("controllerrevision: {hash}");
    n.wait_for(30, "the pinned revision is cached", |n| {
        let want = want.clone();
        async move { n.need().is_some_and(|c| c["message"] == want.as_str()) }
    })
    .await;

    let mut one_more = good.manifest_json.clone();
    one_more.push(b'\n');
    // The same layer and config, the manifest one byte longer.
    let same = archive::Built {
        layout: good.layout.clone(),
        manifest: String::new(),
        blobs: good.blobs.clone(),
        layer_tar: good.layer_tar.clone(),
        config_json: good.config_json.clone(),
        manifest_json: Vec::new(),
    };
    let bad = archive::with_manifest(same, one_more, &format!("127.0.0.1:1/{repo}:2.0"));
    let bad_file = archive::oci_archive(&bad, &dir.path().join("bad.tar"));
    let (ok, out) = load(&n, &[bad_file.to_str().unwrap()]);
    assert!(
        !ok,
        "a manifest the template does not pin was accepted: {out}"
    );
    assert!(
        out.contains(&good.manifest) && out.contains("(403)"),
        "{out}"
    );
    nothing_left(&n, &bad.blobs, &repo).await;

    let (ok, out) = load(&n, &[good_file.to_str().unwrap()]);
    assert!(ok, "{out}\n{}", n.log());
    assert!(out.contains(&format!("loaded {pinned}")), "{out}");
    assert!(n.cri.image_status(&pinned).await.unwrap().is_some());
    n.clean().await;
    remove_images(&repo).await;
}

/// A truncated archive, an upload cut off halfway, and an edgehub killed halfway through an
/// import: none leaves an image, a tag, a lease or a blob of the archive behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_and_killed_imports_leave_nothing() {
    let repo = format!("trunc-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:1.0");
    let dir = tempfile::tempdir().unwrap();
    // 4 MiB of padding: big enough to be caught mid-stream.
    let built = archive::build(dir.path(), &image, "never runs", 4 << 20);
    let full = std::fs::read(archive::oci_archive(&built, &dir.path().join("a.tar.gz"))).unwrap();
    let mut n = node("trunc").await;
    n.start();
    n.roll();
    let hash = edge::third_revision(&n.server, &image);
    let want = format!("controllerrevision: {hash}");
    n.wait_for(30, "the revision is cached", |n| {
        let want = want.clone();
        async move { n.need().is_some_and(|c| c["message"] == want.as_str()) }
    })
    .await;

    // Truncated at 60 %.
    let cut = dir.path().join("cut.tar.gz");
    std::fs::write(&cut, &full[..full.len() * 6 / 10]).unwrap();
    let (ok, out) = load(&n, &[cut.to_str().unwrap()]);
    assert!(!ok, "a truncated archive was accepted: {out}");
    assert!(out.contains("(400)"), "{out}");
    nothing_left(&n, &built.blobs, &repo).await;

    // The client goes away halfway.
    let upload_half = |n: &Node| {
        let mut s = std::os::unix::net::UnixStream::connect(n.socket()).unwrap();
        write!(
            s,
            "POST /v1/images/load HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n",
            full.len()
        )
        .unwrap();
        s.write_all(&full[..full.len() / 2]).unwrap();
        s.flush().unwrap();
        s
    };
    let s = upload_half(&n);
    std::thread::sleep(Duration::from_millis(500));
    drop(s);
    nothing_left(&n, &built.blobs, &repo).await;

    // edgehub itself is killed halfway; the next start removes what the import left.
    let s = upload_half(&n);
    let cd = containerd();
    let filter = format!("labels.\"edgehub.io/import\"=={}", n.name);
    let deadline = Instant::now() + Duration::from_secs(10);
    while cd.leases(&filter).await.unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the import never started\n{}",
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    n.kill9();
    drop(s);
    assert!(
        !cd.leases(&filter).await.unwrap().is_empty(),
        "the lease outlives the killed edgehub"
    );
    n.start();
    nothing_left(&n, &built.blobs, &repo).await;
    assert!(
        n.log()
            .contains("removed what an interrupted image import left"),
        "{}",
        n.log()
    );
    n.clean().await;
}

/// An archive of an image no cached revision names is refused with a message naming it,
/// and goes in with the override; here as a docker-archive (`docker save`'s layout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_no_revision_names_is_refused_naming_it_and_loads_with_the_override() {
    let repo = format!("stray-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:1.0");
    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), &image, "stray", 0);
    let file = archive::docker_archive(&built, &image, &dir.path().join("docker.tar"));
    let mut n = node("stray").await;
    n.start();
    n.wait_for(
        30,
        "the cache is served",
        |n| async move { n.need().is_some() },
    )
    .await;

    let (ok, out) = load(&n, &[file.to_str().unwrap()]);
    assert!(!ok, "{out}");
    assert!(out.contains(&image) && out.contains("(403)"), "{out}");
    nothing_left(&n, &built.blobs[..2], &repo).await;

    // From standard input, with the override.
    let mut child = n
        .cmd(&["images", "load", "--force", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&std::fs::read(&file).unwrap())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}\n{}", n.log());
    assert!(text.contains(&format!("loaded {image}")), "{text}");
    let img = n.cri.image_status(&image).await.unwrap();
    assert!(img.is_some(), "the CRI sees the docker-archive's image");
    n.clean().await;
    remove_images(&repo).await;
}

/// The drop directory: a file written slowly under its final name is read only once it
/// stopped changing, imported once, whole, and removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drop_directory_imports_a_slowly_written_file_once_whole() {
    let repo = format!("drop-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:1.0");
    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), &image, "dropped", 1 << 20);
    let bytes = std::fs::read(archive::oci_archive(&built, &dir.path().join("a.tar"))).unwrap();
    let mut n = node("drop").await;
    n.edit_config(|c| format!("{c}[images]\ndrop_interval_secs = 1\n"));
    n.start();
    n.roll();
    let hash = edge::third_revision(&n.server, &image);
    let want = format!("controllerrevision: {hash}");
    n.wait_for(30, "the revision is cached", |n| {
        let want = want.clone();
        async move { n.need().is_some_and(|c| c["message"] == want.as_str()) }
    })
    .await;

    let drop_dir = n.dir.path().join("data/images");
    let target = drop_dir.join("app.tar");
    let mut f = std::fs::File::create(&target).unwrap();
    for chunk in bytes.chunks(bytes.len() / 8 + 1) {
        f.write_all(chunk).unwrap();
        f.flush().unwrap();
        std::thread::sleep(Duration::from_millis(400));
    }
    drop(f);
    n.wait_for(30, "the dropped file is imported and removed", |n| {
        let target = target.clone();
        async move { !target.exists() && n.log().contains("dropped image archive imported") }
    })
    .await;
    assert!(n.cri.image_status(&image).await.unwrap().is_some());
    let log = n.log();
    assert_eq!(
        log.matches("importing a dropped image archive").count(),
        1,
        "{log}"
    );
    assert!(!log.contains("dropped image archive refused"), "{log}");
    let left: Vec<_> = std::fs::read_dir(&drop_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    n.clean().await;
    remove_images(&repo).await;
}

/// Free space is checked first: with more kept free than the image filesystem has, the
/// import is refused with 507 before its first blob, and nothing stays (tests/images_space.rs
/// has the archive bigger than a small filesystem's free space).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_that_does_not_fit_is_refused_before_it_writes() {
    let repo = format!("nospace-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:1.0");
    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), &image, "no room", 0);
    let file = archive::oci_archive(&built, &dir.path().join("a.tar"));
    let mut n = node("nospace").await;
    // 1 TiB kept free: more than any test machine's image filesystem has.
    n.edit_config(|c| format!("{c}[images]\nreserve_mib = 1048576\n"));
    n.start();
    n.wait_for(
        30,
        "the cache is served",
        |n| async move { n.need().is_some() },
    )
    .await;
    let (ok, out) = load(&n, &["--force", file.to_str().unwrap()]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("not enough space") && out.contains("(507)"),
        "{out}"
    );
    nothing_left(&n, &built.blobs, &repo).await;
    n.clean().await;
}

/// A blob whose bytes do not hash to its name, early in a large archive: refused (400) with
/// the reason, which the client gets whole although it was still sending, and nothing stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_blob_is_refused_with_its_reason_and_leaves_nothing() {
    let repo = format!("corrupt-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:1.0");
    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), &image, "corrupt", 8 << 20);
    // The config's bytes changed (its length kept), and it comes first, before the 8 MiB layer.
    let config = built.blobs[1].trim_start_matches("sha256:").to_string();
    let path = built.layout.join("blobs/sha256").join(&config);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[2] ^= 0x20;
    std::fs::write(&path, bytes).unwrap();
    let file = dir.path().join("corrupt.tar");
    let names: Vec<String> = [1usize, 0, 2]
        .iter()
        .map(|&i| {
            format!(
                "blobs/sha256/{}",
                built.blobs[i].trim_start_matches("sha256:")
            )
        })
        .collect();
    let out = std::process::Command::new("tar")
        .arg("-C")
        .arg(&built.layout)
        .arg("-cf")
        .arg(&file)
        .arg("oci-layout")
        .args(&names)
        .arg("index.json")
        .output()
        .unwrap();
    assert!(out.status.success());
    let mut n = node("corrupt").await;
    n.start();
    n.wait_for(
        30,
        "the cache is served",
        |n| async move { n.need().is_some() },
    )
    .await;
    let (ok, out) = load(&n, &["--force", file.to_str().unwrap()]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("digest mismatch") && out.contains("(400)"),
        "{out}"
    );
    nothing_left(&n, &built.blobs, &repo).await;
    n.clean().await;
}

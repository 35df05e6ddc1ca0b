//! Issue 23's space check, end to end: free space is checked first, against the bytes the
//! archive will add, before edgehub takes a lease or writes a blob. The edgehub binary runs
//! against a containerd of this test's own on a 64 MiB tmpfs root, so an archive can be
//! bigger than its free space; the content store and containerd's metadata are compared
//! before and after. Needs root; without it these tests fail, loudly.

#[path = "common/archive.rs"]
mod archive;
mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/small_containerd.rs"]
mod small_containerd;

use edge::{node, Node};
use edgehub::containerd::Containerd;
use edgehub::images::{declare, scan};
use small_containerd::SmallContainerd;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// Each big image's random padding: one fits the small filesystem, two do not.
const PAD: usize = 34 << 20;

/// What containerd holds, byte for byte where it matters: every file and directory of the
/// content store with its size and mtime, the metadata database's digest, the images.
#[derive(Debug, PartialEq)]
struct Held {
    content: BTreeMap<String, (u64, Option<SystemTime>)>,
    meta_db: String,
    images: Vec<String>,
}

fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, (u64, Option<SystemTime>)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let m = e.metadata().unwrap();
        let rel = e.path().strip_prefix(base).unwrap().display().to_string();
        out.insert(
            rel,
            (if m.is_dir() { 0 } else { m.len() }, m.modified().ok()),
        );
        if m.is_dir() {
            walk(base, &e.path(), out);
        }
    }
}

async fn held(small: &SmallContainerd) -> Held {
    let content = small.root.join("io.containerd.content.v1.content");
    let mut files = BTreeMap::new();
    let m = std::fs::metadata(&content).unwrap();
    files.insert(".".into(), (0, m.modified().ok()));
    walk(&content, &content, &mut files);
    let db = std::fs::read(small.root.join("io.containerd.metadata.v1.bolt/meta.db")).unwrap();
    let d = ring::digest::digest(&ring::digest::SHA256, &db);
    let mut images = Containerd::new(&small.socket).image_names().await.unwrap();
    images.sort();
    Held {
        content: files,
        meta_db: d.as_ref().iter().map(|b| format!("{b:02x}")).collect(),
        images,
    }
}

/// What containerd holds once it stopped changing (containerd and edgehub settle after start).
async fn settled(small: &SmallContainerd) -> Held {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = held(small).await;
    loop {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let now = held(small).await;
        if now == last {
            return now;
        }
        assert!(Instant::now() < deadline, "containerd never settled");
        last = now;
    }
}

/// An edgehub node on `small`'s containerd, with no pod to run (nothing else may write to the
/// content store), 1 MiB kept free, and the drop directory looked at every second.
async fn space_node(tag: &str, small: &SmallContainerd) -> Node {
    let mut n = node(tag).await;
    n.server.remove("pods", "vehicle", "telemetry-sv74m");
    let shared = common::cri_stack().display().to_string();
    let own = small.socket.display().to_string();
    n.edit_config(|c| {
        format!(
            "{}[images]\nreserve_mib = 1\ndrop_interval_secs = 1\n",
            c.replace(&shared, &own)
        )
    });
    n.start();
    n.wait_for(30, "the local API lists images", |n| async move {
        n.http("GET", "/v1/images").0 == 200
    })
    .await;
    n
}

/// `edgehub images load ARGS...`: (success, stdout + stderr).
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

/// `POST path` with `file` as the body and `headers` added: (status, body).
fn post(n: &Node, path: &str, headers: &[(&str, String)], file: &Path) -> (u16, String) {
    // A privileged route: root on the socket.
    let mut s = std::os::unix::net::UnixStream::connect(n.socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let len = std::fs::metadata(file).unwrap().len();
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len}\r\nConnection: close\r\n"
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut w = s.try_clone().unwrap();
    let file = file.to_path_buf();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(head.as_bytes());
        let mut f = std::fs::File::open(file).unwrap();
        let _ = std::io::copy(&mut f, &mut w);
    });
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let _ = writer.join();
    let out = String::from_utf8_lossy(&out).into_owned();
    let code = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body)
}

/// The declaration `edgehub images load FILE` sends for `file`.
fn declaration(file: &Path) -> String {
    let s = scan::scan(std::fs::File::open(file).unwrap()).unwrap();
    declare::format(&declare::from_scan(&s))
}

/// Images `a` and `b` in one OCI archive (plain tar), `a`'s blobs first.
fn two_images(a: &archive::Built, b: &archive::Built, out: &Path) -> PathBuf {
    let layout = out.with_extension("d");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let mut names = vec!["oci-layout".to_string()];
    let mut manifests = Vec::new();
    for built in [a, b] {
        for d in &built.blobs {
            let hex = d.trim_start_matches("sha256:");
            std::fs::copy(built.layout.join("blobs/sha256").join(hex), blobs.join(hex)).unwrap();
            names.push(format!("blobs/sha256/{hex}"));
        }
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(built.layout.join("index.json")).unwrap())
                .unwrap();
        manifests.push(index["manifests"][0].clone());
    }
    std::fs::copy(a.layout.join("oci-layout"), layout.join("oci-layout")).unwrap();
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "manifests": manifests}))
            .unwrap(),
    )
    .unwrap();
    names.push("index.json".into());
    let st = std::process::Command::new("tar")
        .arg("-C")
        .arg(&layout)
        .arg("-cf")
        .arg(out)
        .args(&names)
        .status()
        .unwrap();
    assert!(st.success());
    out.to_path_buf()
}

fn blob_sizes(b: &archive::Built) -> u64 {
    b.blobs
        .iter()
        .map(|d| {
            let p = b
                .layout
                .join("blobs/sha256")
                .join(d.trim_start_matches("sha256:"));
            std::fs::metadata(p).unwrap().len()
        })
        .sum()
}

/// Two images whose blobs each fit the free space and together do not, in one archive: the
/// CLI (FILE, scanned), the API with the declaration (plain and gzip), and the drop directory
/// (gzip) each refuse it
/// with 507 naming the bytes it adds, and containerd's content store and metadata are the
/// same as before, byte for byte: no lease was taken, no blob written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_bigger_than_the_free_space_is_refused_before_anything_is_written() {
    let small = SmallContainerd::start().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = format!("127.0.0.1:1/space-{}", std::process::id());
    let built: Vec<archive::Built> = ["a", "b"]
        .iter()
        .map(|t| {
            let d = dir.path().join(t);
            std::fs::create_dir_all(&d).unwrap();
            archive::build(&d, &format!("{repo}:{t}"), t, PAD)
        })
        .collect();
    let file = two_images(&built[0], &built[1], &dir.path().join("two.tar"));
    let need = blob_sizes(&built[0]) + blob_sizes(&built[1]);
    let n = space_node("space", &small).await;
    let free = edgehub::images::free_bytes(&small.root).unwrap();
    assert!(
        need > free && blob_sizes(&built[0]) + (1 << 20) < free,
        "one image fits, two do not: need {need}, free {free}"
    );
    let before = settled(&small).await;
    let says_need =
        |out: &str| out.contains("not enough space") && out.contains(&format!("{need} more bytes"));

    // The CLI scans the file and declares its blobs.
    let (ok, out) = load(&n, &["--force", file.to_str().unwrap()]);
    assert!(!ok, "{out}");
    assert!(
        says_need(&out) && out.contains("(507)"),
        "{out}\n{}",
        n.log()
    );
    assert_eq!(held(&small).await, before, "the CLI's load wrote nothing");

    // The API with the declaration.
    let (code, body) = post(
        &n,
        "/v1/images/load?force=true",
        &[("Edgehub-Blobs", declaration(&file))],
        &file,
    );
    assert_eq!(code, 507, "{body}");
    assert!(says_need(&body), "{body}");
    assert_eq!(held(&small).await, before, "the API's load wrote nothing");

    // The same, gzip-compressed: the declaration is of the blobs inside.
    let gz = dir.path().join("two.tar.gz");
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "gzip -1 -n -c '{}' > '{}'",
            file.display(),
            gz.display()
        ))
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(declaration(&gz), declaration(&file));
    let (code, body) = post(
        &n,
        "/v1/images/load?force=true",
        &[("Edgehub-Blobs", declaration(&gz))],
        &gz,
    );
    assert_eq!(code, 507, "{body}");
    assert!(says_need(&body), "{body}");
    assert_eq!(held(&small).await, before, "the gzip load wrote nothing");

    // The drop directory scans the file itself, here the gzip one as a stream (its import is
    // not forced: the space check comes before the question whether a revision names the
    // images).
    let drop_dir = n.dir.path().join("data/images");
    std::fs::copy(&gz, drop_dir.join("two.tar.gz.part")).unwrap();
    std::fs::rename(
        drop_dir.join("two.tar.gz.part"),
        drop_dir.join("two.tar.gz"),
    )
    .unwrap();
    let note = drop_dir.join("two.tar.gz.failed.txt");
    n.wait_for(30, "the dropped archive is refused", |_| {
        let note = note.clone();
        async move { note.exists() }
    })
    .await;
    let why = std::fs::read_to_string(&note).unwrap();
    assert!(says_need(&why), "{why}");
    assert_eq!(
        held(&small).await,
        before,
        "the drop directory wrote nothing"
    );
    n.clean().await;
}

/// A delta archive: its big blob is already in containerd, so it adds only a manifest's
/// worth, and is accepted although it is bigger than the free space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_archive_whose_big_blobs_are_present_is_accepted_beyond_the_free_space() {
    let small = SmallContainerd::start().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = format!("127.0.0.1:1/delta-{}", std::process::id());
    let first = format!("{repo}:1.0");
    let built = archive::build(dir.path(), &first, "delta", PAD);
    let file = archive::oci_archive(&built, &dir.path().join("first.tar"));
    let n = space_node("delta", &small).await;
    let (ok, out) = load(&n, &["--force", file.to_str().unwrap()]);
    assert!(ok, "{out}\n{}", n.log());

    // The same blobs named anew: an archive of the second name, whose layer is present.
    let second = format!("{repo}:2.0");
    let manifest = built.manifest_json.clone();
    let renamed = archive::with_manifest(built, manifest, &second);
    let delta = archive::oci_archive(&renamed, &dir.path().join("delta.tar"));
    let size = std::fs::metadata(&delta).unwrap().len();
    let free = edgehub::images::free_bytes(&small.root).unwrap();
    assert!(
        size > free,
        "the archive ({size}) exceeds the free space ({free})"
    );
    let (ok, out) = load(&n, &["--force", delta.to_str().unwrap()]);
    assert!(ok, "{out}\n{}", n.log());
    assert!(out.contains(&format!("loaded {second}")), "{out}");
    let names = Containerd::new(&small.socket).image_names().await.unwrap();
    assert!(
        names.contains(&first) && names.contains(&second),
        "{names:?}"
    );
    n.clean().await;
}

/// The blob files and ingests of the content store, with their sizes (the directories that
/// hold them stay once made).
fn blob_files(small: &SmallContainerd) -> BTreeMap<String, u64> {
    let mut all = BTreeMap::new();
    let content = small.root.join("io.containerd.content.v1.content");
    walk(&content, &content, &mut all);
    all.into_iter()
        .filter(|(p, _)| p.starts_with("blobs/sha256/") || p.starts_with("ingest/"))
        .map(|(p, (len, _))| (p, len))
        .collect()
}

/// A declaration that lies (a blob it does not list, a blob of another size) is refused with
/// 400, and what the import had written meanwhile is gone: no blob, ingest, image or lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declaration_that_lies_is_refused_and_leaves_nothing() {
    let small = SmallContainerd::start().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = format!("127.0.0.1:1/lie-{}", std::process::id());
    let built = archive::build(dir.path(), &format!("{repo}:1.0"), "lie", 1 << 20);
    let file = archive::oci_archive(&built, &dir.path().join("lie.tar"));
    let n = space_node("lie", &small).await;
    settled(&small).await;
    let before = blob_files(&small);
    let cd = Containerd::new(&small.socket);
    let images = cd.image_names().await.unwrap();
    let truth = scan::scan(std::fs::File::open(&file).unwrap()).unwrap();
    // The archive holds the layer, the config and the manifest, in that order.
    assert_eq!(truth.blobs.len(), 3, "{truth:?}");
    let mut without_manifest = declare::from_scan(&truth);
    without_manifest.pop();
    let mut wrong_size = declare::from_scan(&truth);
    wrong_size[0].size += 1;
    for (lie, says) in [
        (without_manifest, "is not in the edgehub-blobs header"),
        (wrong_size, "the edgehub-blobs header declared"),
    ] {
        let (code, body) = post(
            &n,
            "/v1/images/load?force=true",
            &[("Edgehub-Blobs", declare::format(&lie))],
            &file,
        );
        assert_eq!(code, 400, "{body}\n{}", n.log());
        assert!(
            body.contains("does not match its declaration") && body.contains(says),
            "{body}"
        );
        assert_eq!(blob_files(&small), before, "{body}");
        assert_eq!(cd.image_names().await.unwrap(), images);
        let leases = cd
            .leases(&format!("labels.\"edgehub.io/import\"=={}", n.name))
            .await
            .unwrap();
        assert!(leases.is_empty(), "{leases:?}");
    }
    // A header that is not a declaration at all.
    let (code, body) = post(
        &n,
        "/v1/images/load?force=true",
        &[("Edgehub-Blobs", "sha256:12=3".into())],
        &file,
    );
    assert_eq!(code, 400, "{body}");
    // The truth loads.
    let (code, body) = post(
        &n,
        "/v1/images/load?force=true",
        &[("Edgehub-Blobs", declaration(&file))],
        &file,
    );
    assert_eq!(code, 200, "{body}\n{}", n.log());
    n.clean().await;
}

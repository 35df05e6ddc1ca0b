//! Image side-loads against hostile input (issue 31): archives small on the wire that declare
//! a gibibyte in a header, a drop directory with planted links and FIFOs, a runtime that goes
//! away, and a client that trickles. The edgehub binary runs against the shared real
//! containerd (or a small one of the test's own where containerd must stop); its peak memory
//! is read from /proc. Needs root; without it these tests fail, loudly.

#[path = "common/archive.rs"]
mod archive;
mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/small_containerd.rs"]
mod small_containerd;

use edge::{node, Node};
use edgehub::cri::CriRuntime;
use edgehub_testsupport::hostile_archive as hostile;
use std::io::{Read, Write};
use std::time::Duration;

/// The peak resident memory of process `pid` (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb << 10)
        .expect("VmHWM in /proc/PID/status")
}

/// A node with no pod to run (edgehub's memory is then its own), the drop directory looked at
/// every second, `extra` added to its `[images]` section; started, its local API up.
async fn quiet_node(tag: &str, extra: &str) -> Node {
    let mut n = node(tag).await;
    n.server.remove("pods", "vehicle", "telemetry-sv74m");
    n.edit_config(|c| format!("{c}[images]\ndrop_interval_secs = 1\n{extra}"));
    n.start();
    n.wait_for(30, "the local API lists images", |n| async move {
        n.http("GET", "/v1/images").0 == 200
    })
    .await;
    n
}

/// Puts `bytes` into the drop directory as `name`, the way the contract asks (written under
/// another name, then renamed).
fn drop_file(n: &Node, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = n.dir.path().join("data/images");
    std::fs::create_dir_all(&dir).unwrap();
    let part = dir.join(format!("{name}.part"));
    std::fs::write(&part, bytes).unwrap();
    let target = dir.join(name);
    std::fs::rename(&part, &target).unwrap();
    target
}

/// Issue 31 item 2: the three hostile shapes (a GNU long name and a PAX header each declaring
/// a gibibyte, and a gibibyte of zeros), each about a mebibyte of gzip, POSTed and dropped:
/// refused (400, naming the limit where there is one), and edgehub's peak memory stays within
/// 32 MiB of what it was idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_archives_are_refused_in_bounded_memory() {
    const BUDGET: u64 = 32 << 20;
    let n = quiet_node("hostile", "").await;
    let pid = n.child.as_ref().unwrap().id();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = peak_rss(pid);
    let shapes = hostile::all(1 << 30);
    for (what, bytes) in &shapes {
        let (code, body) = n.post_on_socket("/v1/images/load?force=true", bytes);
        let peak = peak_rss(pid);
        eprintln!(
            "{what}: {code} after {} bytes; peak RSS {} MiB, {} MiB idle: {body}",
            bytes.len(),
            peak >> 20,
            idle >> 20
        );
        assert!(
            peak < idle + BUDGET,
            "{what}: peak RSS {} MiB, {} MiB idle",
            peak >> 20,
            idle >> 20
        );
        assert_eq!(code, 400, "{what}: {body}\n{}", n.log());
        if *what != "gzip-of-zeros" {
            assert!(body.contains("65536 bytes"), "{what}: {body}");
        }
    }
    // The drop directory scans a file before it imports it: the same bound.
    let dropped: Vec<_> = shapes
        .iter()
        .map(|(what, bytes)| drop_file(&n, &format!("{what}.tar.gz"), bytes))
        .collect();
    for f in &dropped {
        let reason = std::path::PathBuf::from(format!("{}.failed.txt", f.display()));
        n.wait_for(60, "the hostile file is parked with its reason", |_| {
            let reason = reason.clone();
            async move { reason.exists() }
        })
        .await;
        let why = std::fs::read_to_string(&reason).unwrap();
        assert!(!f.exists(), "{why}");
        if !f.display().to_string().contains("zeros") {
            assert!(why.contains("65536 bytes"), "{}: {why}", f.display());
        }
    }
    let peak = peak_rss(pid);
    assert!(
        peak < idle + BUDGET,
        "drop directory: peak RSS {} MiB, {} MiB idle",
        peak >> 20,
        idle >> 20
    );
    n.clean().await;
}

/// The reason file of a parked `file`.
fn reason_of(file: &std::path::Path) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("{}.failed.txt", file.display()))
}

/// Issue 31 item 7: nothing in the drop directory is trusted. A symlink planted at a refused
/// file's reason name is replaced, not written through (edgehub runs as root); a FIFO under
/// an archive's name is refused without hanging the agent; a symlink payload is refused, not
/// followed; and an archive dropped after all of them is imported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drop_directory_trusts_none_of_its_files() {
    let repo = format!("dropsafe-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:1.0");
    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), &image, "dropped safely", 0);
    let good = archive::oci_archive(&built, &dir.path().join("good.tar"));
    let mut n = node("dropsafe").await;
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
    std::fs::create_dir_all(&drop_dir).unwrap();
    // A file outside, which a reason written through the planted link would overwrite.
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    std::os::unix::fs::symlink(&victim, drop_dir.join("bad.tar.failed.txt")).unwrap();
    let bad = drop_file(&n, "bad.tar", b"not an archive at all");
    let fifo = drop_dir.join("fifo.tar");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let link = drop_dir.join("link.tar");
    std::os::unix::fs::symlink(&good, &link).unwrap();

    for (f, why) in [
        (&bad, "not a usable image archive"),
        (&fifo, "not a regular file (a FIFO)"),
        (&link, "symbolic link"),
    ] {
        let reason = reason_of(f);
        // A regular file (the planted link replaced), not what reads through the link.
        n.wait_for(30, "the file is parked with its reason", |_| {
            let reason = reason.clone();
            async move { std::fs::symlink_metadata(&reason).is_ok_and(|m| m.file_type().is_file()) }
        })
        .await;
        let text = std::fs::read_to_string(&reason).unwrap();
        assert!(text.contains(why), "{}: {text}", f.display());
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    assert!(good.exists(), "the link's target is left alone");

    let dropped = drop_file(&n, "good.tar", &std::fs::read(&good).unwrap());
    n.wait_for(30, "the archive dropped after them is imported", |n| {
        let dropped = dropped.clone();
        async move { !dropped.exists() && n.log().contains("dropped image archive imported") }
    })
    .await;
    assert!(n.cri.image_status(&image).await.unwrap().is_some());
    n.clean().await;
    let cri = edgehub::cri::CriClient::new(&common::cri_stack());
    let _ = cri.remove_image(&image).await;
}

/// Issue 31 item 7: a containerd that is away (stopped, as at a boot or an update) when an
/// archive is dropped fails the import for a reason that passes: the archive stays, is tried
/// again with a backoff, and is imported once containerd is back, never parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_archive_waits_out_a_containerd_outage() {
    let mut small = small_containerd::SmallContainerd::start().await;
    // The image the seeded revision 1 names: in this containerd of the test's own, not the
    // shared one.
    let image = "127.0.0.1:5000/busybox:1.0";
    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), image, "after the outage", 0);
    let file = archive::oci_archive(&built, &dir.path().join("a.tar"));
    let mut n = node("outage").await;
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
    n.wait_for(30, "the revisions are cached", |n| async move {
        let (_, m) = n.http("GET", "/metrics");
        m.lines().any(|l| {
            l.starts_with("edgehub_cache_objects{kind=\"ControllerRevision\"}")
                && !l.ends_with(" 0")
        })
    })
    .await;

    small.stop();
    let dropped = drop_file(&n, "app.tar", &std::fs::read(&file).unwrap());
    n.wait_for(
        60,
        "the import failed twice and is tried again",
        |n| async move { n.log().matches("it stays and is tried again").count() >= 2 },
    )
    .await;
    assert!(dropped.exists(), "{}", n.log());
    assert!(!reason_of(&dropped).exists(), "parked:\n{}", n.log());

    small.start_again().await;
    n.wait_for(90, "the archive is imported once containerd is back", |n| {
        let dropped = dropped.clone();
        async move { !dropped.exists() && n.log().contains("dropped image archive imported") }
    })
    .await;
    let cd = edgehub::containerd::Containerd::new(&small.socket);
    assert!(cd.image(image).await.unwrap().is_some());
    assert!(!reason_of(&dropped).exists());
    n.kill9();
}

/// An upload whose body trickles: the head and `first`, then `byte` every `every`, until the
/// answer comes or `give_up` passes. Returns (status, body, how long the answer took); status
/// 0 for none.
fn trickle(
    n: &Node,
    first: &[u8],
    byte: &[u8],
    every: Duration,
    give_up: Duration,
) -> (u16, String, Duration) {
    let start = std::time::Instant::now();
    // The route is privileged: root on the unix socket (the tests run as root).
    let mut s = std::os::unix::net::UnixStream::connect(n.socket()).unwrap();
    s.write_all(
        b"POST /v1/images/load?force=true HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2097152\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    s.write_all(first).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut out = Vec::new();
    while start.elapsed() < give_up {
        let mut buf = [0u8; 4096];
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => out.extend_from_slice(&buf[..k]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if out.windows(4).any(|w| w == b"\r\n\r\n") && !out.is_empty() {
                    // Head and maybe body: give the body a moment, then stop.
                    std::thread::sleep(Duration::from_millis(300));
                    let _ = s.read_to_end(&mut out);
                    break;
                }
                if s.write_all(byte).is_err() {
                    break;
                }
                std::thread::sleep(every);
            }
            Err(_) => break,
        }
    }
    let took = start.elapsed();
    let out = String::from_utf8_lossy(&out).into_owned();
    let code = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body, took)
}

/// Issue 31 item 11: a client that sends a byte every second keeps under the per-frame idle
/// timeout but holds the one import slot; it is cut for sending too little in a window, and
/// an import that came after it goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_upload_is_cut_and_does_not_hold_other_imports() {
    let repo = format!("trickle-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:1.0");
    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), &image, "after the trickle", 0);
    let file = archive::oci_archive(&built, &dir.path().join("a.tar"));
    let bytes = std::fs::read(&file).unwrap();
    let n = quiet_node("trickle", "upload_window_secs = 4\nupload_min_kib = 16\n").await;
    let slow = std::thread::scope(|sc| {
        let slow = sc.spawn(|| {
            trickle(
                &n,
                b"",
                b"\0",
                Duration::from_secs(1),
                Duration::from_secs(40),
            )
        });
        std::thread::sleep(Duration::from_secs(2));
        let started = std::time::Instant::now();
        let (code, body) = n.post_on_socket("/v1/images/load?force=true", &bytes);
        let took = started.elapsed();
        eprintln!("the import after the trickle: {code} after {took:?}");
        assert_eq!(
            code,
            200,
            "the import after the trickle: {body}\n{}",
            n.log()
        );
        assert!(took < Duration::from_secs(30), "{took:?}");
        slow.join().unwrap()
    });
    let (code, body, took) = slow;
    eprintln!("the trickle: {code} after {took:?}: {body}");
    assert_eq!(code, 408, "the trickle after {took:?}: {body}\n{}", n.log());
    assert!(body.contains("images.upload_min_kib"), "{body}");
    assert!(took < Duration::from_secs(15), "{took:?}");
    n.clean().await;
    let cri = edgehub::cri::CriClient::new(&common::cri_stack());
    let _ = cri.remove_image(&image).await;
}

/// Issue 31 item 11: an upload that keeps the pace but is slow holds the one import slot; an
/// import behind it waits `import_wait_secs` at most and is answered 503 (the drop directory
/// would try again later), and one after the slow upload ends goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_waits_for_the_one_before_it_a_bounded_time() {
    let repo = format!("waits-{}", std::process::id());
    let image = format!("127.0.0.1:1/{repo}:1.0");
    let dir = tempfile::tempdir().unwrap();
    let built = archive::build(dir.path(), &image, "after the slow one", 0);
    let file = archive::oci_archive(&built, &dir.path().join("a.tar"));
    let bytes = std::fs::read(&file).unwrap();
    let n = quiet_node(
        "waits",
        "upload_window_secs = 4\nupload_min_kib = 1\nimport_wait_secs = 3\n",
    )
    .await;
    // A blob of 1 MiB, sent 2 KiB a second: within the pace, and slow.
    let blob = format!("blobs/sha256/{}", "ab".repeat(32));
    let head = hostile::tar_header(&blob, b'0', 1 << 20);
    std::thread::scope(|sc| {
        let slow = sc.spawn(|| {
            trickle(
                &n,
                &head,
                &[7u8; 2048],
                Duration::from_secs(1),
                Duration::from_secs(12),
            )
        });
        std::thread::sleep(Duration::from_secs(2));
        let started = std::time::Instant::now();
        let (code, body) = n.post_on_socket("/v1/images/load?force=true", &bytes);
        let took = started.elapsed();
        eprintln!("behind the slow upload: {code} after {took:?}: {body}");
        assert_eq!(code, 503, "{body}\n{}", n.log());
        assert!(body.contains("another image import"), "{body}");
        assert!(took < Duration::from_secs(8), "{took:?}");
        let (code, _, _) = slow.join().unwrap();
        assert_eq!(
            code, 0,
            "the slow upload was not cut while it kept the pace"
        );
    });
    let (code, body) = n.post_on_socket("/v1/images/load?force=true", &bytes);
    assert_eq!(code, 200, "once the slow upload ended: {body}\n{}", n.log());
    n.clean().await;
    let cri = edgehub::cri::CriClient::new(&common::cri_stack());
    let _ = cri.remove_image(&image).await;
}

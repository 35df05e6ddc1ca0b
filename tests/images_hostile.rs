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

use edge::{node, Node};
use edgehub_testsupport::hostile;
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

/// `POST path` with `body` and its length: (status, body).
fn post(n: &Node, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(&n.api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut w = s.try_clone().unwrap();
    let body = body.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(head.as_bytes());
        let _ = w.write_all(&body);
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
    (code, out.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
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
        let (code, body) = post(&n, "/v1/images/load?force=true", bytes);
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

//! Side-load speed and memory (issue 23): a 100 MB oci-archive (busybox-static plus 100 MB of
//! random bytes in its one gzip layer) imported by `edgehub images load` through the local API
//! into the shared containerd's `k8s.io`, beside `ctr images import --no-unpack` of the same
//! file in the same run (both write the content store and name the image; neither unpacks).
//! Between runs edgehub's image is deleted and the bench waits until containerd collected its
//! blobs; ctr imports into a fresh namespace each run (content it imported was not collected
//! after its image was deleted, in containerd 1.6.20). So every run writes every blob.
//! While edgehub imports, its RSS is sampled every 10 ms: the peak minus its idle RSS before
//! the import shows whether it streams (budget: +4 MiB) or buffers.
//!
//! Prints numbers and `METRIC` lines; asserts nothing about time. Run as root with the CRI test
//! stack: `cargo bench --bench images`.

#[path = "../tests/common/archive.rs"]
mod archive;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/edge.rs"]
mod edge;
mod support;

use edgehub::containerd::Containerd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{metric, proc_status_kib};

const PAD: usize = 100 << 20;
const RUNS: usize = 3;

/// Deletes the image and waits until its blobs are gone, so the next run writes them all.
/// containerd's CRI plugin labels every new image (`io.cri-containerd.image=managed`) on its
/// create event, and an image deleted before that lands is created again: wait for the label
/// first.
async fn remove(cd: &Containerd, image: &str, blobs: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match cd.image(image).await.expect("get the image") {
            None => {}
            Some(i) if i.labels.contains_key("io.cri-containerd.image") => {
                cd.delete_image(image).await.expect("delete the image");
            }
            Some(_) => {}
        }
        let mut left = 0;
        for b in blobs {
            if cd.info(b).await.expect("content info").is_some() {
                left += 1;
            }
        }
        if left == 0 && cd.image(image).await.expect("get the image").is_none() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the image's content stays: {left} blobs"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn ctr(socket: &std::path::Path, ns: &str, args: &[&str]) -> std::process::Output {
    Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(["-n", ns])
        .args(args)
        .output()
        .expect("ctr runs")
}

/// Removes a namespace ctr imported into: its images, its content, then itself.
fn drop_namespace(socket: &std::path::Path, ns: &str) {
    let list = |what: &str| -> Vec<String> {
        String::from_utf8_lossy(&ctr(socket, ns, &[what, "ls", "-q"]).stdout)
            .lines()
            .map(str::to_string)
            .collect()
    };
    for i in list("images") {
        ctr(socket, ns, &["images", "rm", "--sync", &i]);
    }
    for c in list("content") {
        ctr(socket, ns, &["content", "rm", &c]);
    }
    let out = Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(["namespaces", "rm", ns])
        .output()
        .expect("ctr runs");
    if !out.status.success() {
        println!(
            "note: namespace {ns} stays: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let socket = common::cri_stack();
    let cd = Containerd::new(&socket);
    let image = format!("127.0.0.1:1/bench-sideload-{}:1.0", std::process::id());
    let dir = tempfile::tempdir().expect("tempdir");
    let built = archive::build(dir.path(), &image, "bench", PAD);
    let file = archive::oci_archive(&built, &dir.path().join("bench.tar"));
    let bytes = std::fs::metadata(&file).expect("archive").len();
    let mb = bytes as f64 / 1e6;
    println!("archive: {} ({bytes} bytes)", file.display());

    let mut n = edge::node("bench-img").await;
    n.start();
    let up = support::wait_for(30, || n.http("GET", "/v1/healthz").0 == 200).await;
    assert!(up, "edgehub did not start:\n{}", n.log());
    let pid = n.child.as_ref().map(|c| c.id()).expect("edgehub runs");
    // Settle: the first pass and the pod's start are not the import's.
    tokio::time::sleep(Duration::from_secs(5)).await;

    let (mut ours, mut theirs, mut rss_delta) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..RUNS {
        remove(&cd, &image, &built.blobs).await;
        let idle = proc_status_kib(pid, "VmRSS").unwrap_or(0);
        let peak = Arc::new(AtomicU64::new(idle));
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(r) = proc_status_kib(pid, "VmRSS") {
                        peak.fetch_max(r, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        let t = Instant::now();
        let out = n
            .cmd(&[
                "images",
                "load",
                "--force",
                file.to_str().unwrap_or_default(),
            ])
            .output()
            .expect("edgehub images load runs");
        let secs = t.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        let _ = sampler.join();
        assert!(
            out.status.success(),
            "edgehub images load failed: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            n.log()
        );
        let delta = peak.load(Ordering::Relaxed).saturating_sub(idle);
        println!(
            "run {run}: edgehub {secs:.2} s ({:.1} MB/s), RSS idle {idle} KiB, peak +{delta} KiB",
            mb / secs
        );
        ours.push(mb / secs);
        rss_delta.push(delta as f64);

        remove(&cd, &image, &built.blobs).await;
        // ctr into a namespace of its own per run: containerd's metadata is per namespace, so
        // ctr writes every blob, as edgehub did.
        let ns = format!("edgehub-bench-{}-{run}", std::process::id());
        let t = Instant::now();
        let out = ctr(
            &socket,
            &ns,
            &[
                "images",
                "import",
                "--no-unpack",
                file.to_str().unwrap_or_default(),
            ],
        );
        let secs = t.elapsed().as_secs_f64();
        assert!(
            out.status.success(),
            "ctr images import failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!(
            "run {run}: ctr images import {secs:.2} s ({:.1} MB/s)",
            mb / secs
        );
        theirs.push(mb / secs);
        drop_namespace(&socket, &ns);
    }
    remove(&cd, &image, &built.blobs).await;
    n.clean().await;

    let (o, t) = (support::median(ours), support::median(theirs));
    let d = support::median(rss_delta);
    println!();
    println!("import of a {mb:.0} MB archive, median of {RUNS}:");
    println!("  edgehub images load      {o:8.1} MB/s");
    println!("  ctr images import        {t:8.1} MB/s");
    println!(
        "  ratio                    {:8.0} %   (budget: at least 80 %)",
        100.0 * o / t
    );
    println!("  edgehub peak RSS over idle {d:6.0} KiB (budget: 4096 KiB)");
    metric("image_import_mb_per_s", o, "MB/s");
    metric("ctr_import_mb_per_s", t, "MB/s");
    metric("image_import_vs_ctr_percent", 100.0 * o / t, "%");
    metric("image_import_peak_rss_over_idle_kib", d, "KiB");
}

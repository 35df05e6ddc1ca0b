//! Image garbage collection end to end (issue 23): the edgehub binary upgrading the telemetry
//! pod three times on the shared real containerd, with images of this test's own (built the
//! way scripts/cri-stack.sh builds its test images and pushed under a name no other test
//! uses, so collecting them cannot take another test's image). Needs root; without it these
//! tests fail, loudly.

#[path = "common/archive.rs"]
mod archive;
mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/small_containerd.rs"]
mod small_containerd;

use edge::node;
use edgehub::cri::CriRuntime;
use serde_json::Value;
use std::process::Command;

/// Builds an image printing `line` and pushes it to the stack's registry as `image`.
fn push(dir: &std::path::Path, image: &str, line: &str) {
    let built = archive::build(dir, image, line, 0);
    let out = Command::new("skopeo")
        .args(["copy", "-q", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:{image}", built.layout.display()))
        .arg(format!("docker://{image}"))
        .output()
        .expect("skopeo runs");
    assert!(
        out.status.success(),
        "skopeo copy to {image}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Revision `n` of telemetry: the recorded revision 2 with the app's image set to `image`.
fn revision(n: i64, image: &str) -> (Value, String) {
    let mut cr = edgehub_testsupport::fixture_body("controllerrevisions_list_rev2")["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["metadata"]["name"] == "telemetry-55778fbb9f")
        .unwrap()
        .clone();
    let hash = format!("gc{n}{:x}", std::process::id());
    cr["metadata"]["name"] = format!("telemetry-{hash}").into();
    cr["metadata"]["labels"]["controller-revision-hash"] = hash.clone().into();
    cr["metadata"]["uid"] = format!("uid-{hash}").into();
    cr["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    cr["revision"] = n.into();
    let spec = &mut cr["data"]["spec"]["template"]["spec"];
    spec["containers"][0]["image"] = image.into();
    if let Some(c) = spec["containers"][0].as_object_mut() {
        c.remove("command");
    }
    (cr, hash)
}

/// After three upgrades of a pod, exactly the current and the previous revision's images of
/// the app remain; the first two went when the upgrades that made them old committed. The
/// sidecar's image, named by every revision, stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_three_upgrades_only_the_current_and_previous_images_remain() {
    let repo = format!("127.0.0.1:5000/gc-{}", std::process::id());
    let images: Vec<String> = (1..=4).map(|v| format!("{repo}:{v}.0")).collect();
    let dir = tempfile::tempdir().unwrap();
    for (i, image) in images.iter().enumerate() {
        let d = dir.path().join(format!("img{i}"));
        std::fs::create_dir_all(&d).unwrap();
        push(&d, image, &format!("hello from gc {}.0", i + 1));
    }
    let mut n = node("gc").await;
    // Revision 1 and the pod run this test's first image, not the shared busybox.
    let first = images[0].clone();
    n.server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["spec"]["containers"][0]["image"] = first.clone().into();
    });
    let first = images[0].clone();
    n.server.modify(
        "controllerrevisions",
        "vehicle",
        "telemetry-768bcc7446",
        move |c| {
            c["data"]["spec"]["template"]["spec"]["containers"][0]["image"] = first.into();
        },
    );
    let images = &images;
    n.start();
    n.wait_for(90, "the pod runs its first image", |n| async move {
        n.running("sidecar").await.len() == 1
            && n.running("app")
                .await
                .first()
                .is_some_and(|c| c.image.as_ref().unwrap().image == images[0])
    })
    .await;
    let sidecar = n.running("sidecar").await[0]
        .image
        .as_ref()
        .unwrap()
        .image
        .clone();
    n.server.apply(
        "daemonsets",
        edgehub_testsupport::fixture_body("daemonset_after_update"),
    );
    for (k, image) in images.iter().enumerate().skip(1) {
        let (cr, hash) = revision(k as i64 + 1, image);
        n.server.apply("controllerrevisions", cr);
        let want = format!("controllerrevision: {hash}");
        let want = &want;
        n.wait_for(
            30,
            "PodNeedUpgrade True for the new revision",
            |n| async move {
                n.need()
                    .is_some_and(|c| c["status"] == "True" && c["message"] == want.as_str())
            },
        )
        .await;
        let (code, body) = n.http("POST", &n.upgrade_path());
        assert_eq!(code, 200, "upgrade to {image}: {body}\n{}", n.log());
        n.wait_for(
            90,
            "the upgrade to the new image ends Done",
            |n| async move {
                n.state().is_some_and(|s| s["state"] == "Done")
                    && n.running("app")
                        .await
                        .first()
                        .is_some_and(|c| c.image.as_ref().unwrap().image == *image)
            },
        )
        .await;
    }
    // Collection follows the commit: wait for the two old images to go.
    n.wait_for(
        30,
        "the images of revisions 1 and 2 are removed",
        |n| async move {
            n.cri.image_status(&images[0]).await.unwrap().is_none()
                && n.cri.image_status(&images[1]).await.unwrap().is_none()
        },
    )
    .await;
    for (what, image) in [
        ("previous", &images[2]),
        ("current", &images[3]),
        ("sidecar", &sidecar),
    ] {
        assert!(
            n.cri.image_status(image).await.unwrap().is_some(),
            "the {what} image {image} was kept\n{}",
            n.log()
        );
    }
    let log = n.log();
    assert!(
        log.contains("removed an image") && log.contains("only older revisions name it"),
        "{log}"
    );
    // `edgehub images` says which is which and what collection would do.
    let out = n.cmd(&["images"]).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |image: &str| {
        table
            .lines()
            .find(|l| l.starts_with(&format!("{image} ")))
            .unwrap_or_else(|| panic!("{image} in\n{table}"))
            .to_string()
    };
    assert!(row(&images[3]).contains("in use"), "{table}");
    let prev = row(&images[2]);
    assert!(
        prev.contains("previous") && prev.ends_with("under disk pressure"),
        "{table}"
    );
    let (_, metrics) = n.http("GET", "/metrics");
    let removed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("edgehub_image_gc_removed_total "))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert_eq!(removed, Some(2), "{metrics}");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("edgehub_image_fs_capacity_bytes ") && !l.ends_with(" 0")),
        "{metrics}"
    );
    let cri = edgehub::cri::CriClient::new(&common::cri_stack());
    n.clean().await;
    for image in &images[2..] {
        let _ = cri.remove_image(image).await;
    }
}

/// A ControllerRevision of DaemonSet `owner` naming `image`.
fn cr(owner: &str, n: i64, image: &str) -> edgehub::store::StoredObject {
    let name = format!("{owner}-r{n}");
    let raw = serde_json::json!({
        "apiVersion": "apps/v1", "kind": "ControllerRevision",
        "metadata": {"name": name, "namespace": "vehicle", "uid": format!("uid-{name}"),
            "resourceVersion": "1",
            "labels": {"controller-revision-hash": format!("h{name}")},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": owner,
                "uid": format!("uid-{owner}"), "controller": true}]},
        "revision": n,
        "data": {"spec": {"template": {"spec": {"containers": [{"name": "app", "image": image}]}}}}
    });
    edgehub::store::StoredObject::from_raw(
        edgehub::object::Kind::ControllerRevision,
        raw.to_string(),
    )
    .unwrap()
}

/// The image filesystem past the high threshold: with every image a current revision's,
/// nothing may go and the Node's pressure comes; once the revisions make some old, unused
/// images go, the older revisions' first, then the unnamed, down to the low threshold, and
/// the pressure goes. Each pass's removals are what the pure plan says for the filesystem and
/// the images the real containerd reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_image_filesystem_is_relieved_and_disk_pressure_comes_and_goes() {
    use edgehub::images::gc::{self, GcPolicy, NodeImage};
    use edgehub::store::{Change, OpenMode, Store};
    use std::collections::HashSet;
    use std::sync::Arc;

    let small = small_containerd::SmallContainerd::start().await;
    let cri = edgehub::cri::CriClient::new(&small.socket);
    let repo = format!("127.0.0.1:5000/gcfull-{}", std::process::id());
    let images: Vec<String> = (0..4).map(|v| format!("{repo}:{v}")).collect();
    let dir = tempfile::tempdir().unwrap();
    for (i, image) in images.iter().enumerate() {
        let d = dir.path().join(format!("img{i}"));
        std::fs::create_dir_all(&d).unwrap();
        // 6 MiB of random data each: incompressible, so each image costs its size twice on
        // the small filesystem (the compressed layer and its unpacked snapshot).
        let built = archive::build(&d, image, &format!("full {i}"), 6 << 20);
        let out = Command::new("skopeo")
            .args(["copy", "-q", "--dest-tls-verify=false"])
            .arg(format!("oci:{}:{image}", built.layout.display()))
            .arg(format!("docker://{image}"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        cri.pull_image(image, None).await.unwrap();
    }
    let mountpoint = cri
        .image_fs_mountpoint()
        .await
        .unwrap()
        .expect("ImageFsInfo names it");
    let fs = edgehub::images::fs_use(&mountpoint).unwrap();
    let listed = cri.list_images().await.unwrap();
    let size = |image: &str| {
        listed
            .iter()
            .find(|i| i.repo_tags.iter().any(|t| t == image))
            .map(|i| i.size)
            .unwrap()
    };
    let s = size(&images[1]);
    // Thresholds around what the filesystem holds now: over the high one, and a low one that
    // the plan reaches with two images' (reported) sizes, not one.
    let pct = |b: u64| b * 100 / fs.capacity_bytes;
    let high = (fs.percent() - 1) as u8;
    let low = (pct(fs.used_bytes - 2 * s) + 1) as u8;
    assert!(
        low < high && pct(fs.used_bytes - s) > u64::from(low),
        "{fs:?} {s}"
    );
    let policy = GcPolicy {
        keep_previous: true,
        high_percent: high,
        low_percent: low,
    };

    let sdir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&sdir.path().join("edgehub.db"), OpenMode::Normal).unwrap());
    // Phase 1: four DaemonSets, each image its current revision's.
    let all_current: Vec<Change> = images
        .iter()
        .enumerate()
        .map(|(i, img)| Change::Upsert(cr(&format!("ds{i}"), 1, img)))
        .collect();
    store
        .apply(
            edgehub::object::Kind::ControllerRevision,
            &all_current,
            None,
        )
        .unwrap();
    let (mut gc_task, pressure) = edgehub::images::ImageGc::new(cri.clone(), store.clone(), policy);
    let r = gc_task.pass().await.unwrap();
    assert!(r.removed.is_empty(), "{:?}", r.removed);
    let why = pressure
        .borrow()
        .clone()
        .expect("the Node's DiskPressure comes");
    assert!(why.contains("full") && r.pressure.is_some(), "{why}");

    // Phase 2: one DaemonSet with three revisions (1 older, 2 previous, 3 current); image 0
    // is named by nothing.
    let mut changes: Vec<Change> = (0..4)
        .map(|i| Change::Delete {
            namespace: "vehicle".into(),
            name: format!("ds{i}-r1"),
        })
        .collect();
    for n in 1..=3 {
        changes.push(Change::Upsert(cr("app", n, &images[n as usize])));
    }
    store
        .apply(edgehub::object::Kind::ControllerRevision, &changes, None)
        .unwrap();
    let now = edgehub::images::fs_use(&mountpoint).unwrap();
    let node_images: Vec<NodeImage> = cri
        .list_images()
        .await
        .unwrap()
        .into_iter()
        .map(|i| NodeImage {
            names: i.repo_tags.iter().chain(&i.repo_digests).cloned().collect(),
            id: i.id,
            size: i.size,
            pinned: i.pinned,
            first_seen_ms: 0,
        })
        .collect();
    let named = edgehub::images::named_images(&store).unwrap();
    let plan = gc::under_pressure_removals(&node_images, &HashSet::new(), &named, &now, &policy);
    let r = gc_task.pass().await.unwrap();
    let ids = |v: &[gc::Removal]| v.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&r.removed), ids(&plan));
    // In the order they went.
    let gone: Vec<&String> = r
        .removed
        .iter()
        .filter_map(|x| images.iter().find(|i| x.names.contains(i)))
        .collect();
    assert_eq!(gone, [&images[1], &images[0]], "older first, then unnamed");
    for kept in [&images[2], &images[3]] {
        assert!(
            cri.image_status(kept).await.unwrap().is_some(),
            "{kept} stays"
        );
    }
    assert_eq!(*pressure.borrow(), None, "the Node's DiskPressure goes");
    assert!(r.fs.unwrap().percent() <= high, "{:?}", r.fs);
    for image in &images {
        let _ = cri.remove_image(image).await;
    }
}

/// A cached pod of DaemonSet `owner` at the revision `hash`, running `image`.
fn pod(owner: &str, hash: &str, image: &str) -> edgehub::store::StoredObject {
    let raw = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{owner}-x1"), "namespace": "vehicle",
            "uid": format!("uid-pod-{owner}"), "resourceVersion": "1",
            "labels": {"controller-revision-hash": hash},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": owner,
                "uid": format!("uid-{owner}"), "controller": true}]},
        "spec": {"nodeName": "gc-node", "containers": [{"name": "app", "image": image}]}
    });
    edgehub::store::StoredObject::from_raw(edgehub::object::Kind::Pod, raw.to_string()).unwrap()
}

/// Issue 31 item 8: after a reboot, between the runtime's removal of a pod's old containers
/// and its creation of the new ones, no container uses the image the pod is about to run; a
/// pod two revisions behind its DaemonSet names an "older" image, and the sandbox (pause)
/// image, which containerd 1.6 does not pin, is named by no revision. Collection under
/// pressure, told to take all it may, takes neither; it takes an image nothing names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collection_never_takes_a_cached_pods_image_nor_the_sandbox_image() {
    use edgehub::images::gc::GcPolicy;
    use edgehub::object::Kind;
    use edgehub::store::{Change, OpenMode, Store};
    use std::sync::Arc;

    let small = small_containerd::SmallContainerd::start().await;
    let cri = edgehub::cri::CriClient::new(&small.socket);
    let repo = format!("127.0.0.1:5000/gcpod-{}", std::process::id());
    let images: Vec<String> = (1..=4).map(|v| format!("{repo}:{v}")).collect();
    let dir = tempfile::tempdir().unwrap();
    for (i, image) in images.iter().enumerate() {
        let d = dir.path().join(format!("img{i}"));
        std::fs::create_dir_all(&d).unwrap();
        push(&d, image, &format!("gc pod {i}"));
        cri.pull_image(image, None).await.unwrap();
    }
    // The small containerd's configured sandbox image, pulled as a sandbox start would.
    let pause = "127.0.0.1:5000/pause:1.0";
    cri.pull_image(pause, None).await.unwrap();

    let sdir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&sdir.path().join("edgehub.db"), OpenMode::Normal).unwrap());
    // Revisions 1 (older), 2 (previous) and 3 (current) of `app`; the cached pod still at 1.
    let crs: Vec<Change> = (1..=3)
        .map(|n| Change::Upsert(cr("app", n, &images[n as usize - 1])))
        .collect();
    store.apply(Kind::ControllerRevision, &crs, None).unwrap();
    store
        .apply(
            Kind::Pod,
            &[Change::Upsert(pod("app", "happ-r1", &images[0]))],
            None,
        )
        .unwrap();
    let mountpoint = cri.image_fs_mountpoint().await.unwrap().unwrap();
    let fs = edgehub::images::fs_use(&mountpoint).unwrap();
    // Over the high threshold, and a low one nothing reaches: all that may go, goes.
    let policy = GcPolicy {
        keep_previous: true,
        high_percent: (fs.percent() - 1) as u8,
        low_percent: 0,
    };
    let (mut gc_task, _) = edgehub::images::ImageGc::new(cri.clone(), store.clone(), policy);
    let r = gc_task.pass().await.unwrap();
    let gone: Vec<String> = r.removed.iter().flat_map(|x| x.names.clone()).collect();
    assert!(
        gone.contains(&images[3]),
        "the unnamed image goes (collection ran): {gone:?}"
    );
    for (what, image) in [
        ("the pod's own", &images[0]),
        ("the sandbox", &pause.to_string()),
    ] {
        assert!(
            cri.image_status(image).await.unwrap().is_some(),
            "{what} image {image} was kept; removed: {gone:?}"
        );
    }
    for image in &images {
        let _ = cri.remove_image(image).await;
    }
}

/// Issue 31 item 8: naming an image that exists (a side-load of a new build under the same
/// tag) moves its target and sets edgehub's label, and keeps the labels it did not set (the
/// CRI's pin on the sandbox image: `Images.Update` without a mask replaced them all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naming_an_existing_image_keeps_its_other_labels() {
    use edgehub_containerd_api::types::Descriptor;
    use std::collections::HashMap;

    let small = small_containerd::SmallContainerd::start().await;
    let cri = edgehub::cri::CriClient::new(&small.socket);
    let cd = edgehub::containerd::Containerd::new(&small.socket);
    let pause = "127.0.0.1:5000/pause:1.0";
    cri.pull_image(pause, None).await.unwrap();
    let before = cd.image(pause).await.unwrap().unwrap();
    let target = before.target.clone().unwrap();
    let name = format!("127.0.0.1:5000/pinned-{}:1", std::process::id());
    let pinned = HashMap::from([
        ("io.cri-containerd.image".to_string(), "managed".to_string()),
        ("io.cri-containerd.pinned".to_string(), "pinned".to_string()),
    ]);
    cd.put_image(&name, target.clone(), pinned, None)
        .await
        .unwrap();
    let managed = HashMap::from([("io.cri-containerd.image".to_string(), "managed".to_string())]);
    let moved = Descriptor {
        annotations: HashMap::from([("moved".to_string(), "yes".to_string())]),
        ..target.clone()
    };
    cd.put_image(&name, moved, managed, None).await.unwrap();
    let after = cd.image(&name).await.unwrap().unwrap();
    assert_eq!(
        after
            .labels
            .get("io.cri-containerd.pinned")
            .map(String::as_str),
        Some("pinned"),
        "{:?}",
        after.labels
    );
    assert_eq!(
        after
            .target
            .unwrap()
            .annotations
            .get("moved")
            .map(String::as_str),
        Some("yes"),
        "the target moved"
    );
    cd.delete_image(&name).await.unwrap();
}

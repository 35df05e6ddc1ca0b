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

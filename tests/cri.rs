//! The CRI client against a real containerd (scripts/cri-stack.sh starts an isolated one with
//! a local registry and test images). Needs root; without it these tests fail, loudly.

use edgehub::cri::{api, labels, CriClient, CriError, CriRuntime};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

mod common;

fn stack() -> PathBuf {
    common::cri_stack()
}

const IMAGE_1: &str = "127.0.0.1:5000/busybox:1.0";

fn sandbox_config(name: &str, uid: &str, log_dir: &std::path::Path) -> api::PodSandboxConfig {
    common::host_network_sandbox(
        name,
        uid,
        "cri-test",
        log_dir,
        HashMap::from([
            (labels::POD_NAME.into(), name.into()),
            (labels::POD_NAMESPACE.into(), "cri-test".into()),
            (labels::POD_UID.into(), uid.into()),
            (labels::MANAGED_BY.into(), "edgehub".into()),
        ]),
    )
}

#[tokio::test]
async fn version_says_containerd_and_cri_v1() {
    let (c, v) = CriClient::connect(&stack()).await.unwrap();
    assert_eq!(v.runtime_name, "containerd");
    assert_eq!(v.runtime_api_version, "v1");
    assert!(CriClient::runtime_version_string(&v).starts_with("containerd://1."));
    let st = c.status().await.unwrap();
    let runtime_ready = st
        .status
        .unwrap()
        .conditions
        .iter()
        .any(|c| c.r#type == "RuntimeReady" && c.status);
    assert!(runtime_ready);
}

#[tokio::test]
async fn a_missing_socket_is_a_clear_error_and_recovers_when_it_appears() {
    let real = stack();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cri.sock");
    let c = CriClient::new(&path);
    let e = c.version().await.unwrap_err();
    assert!(matches!(e, CriError::Unavailable { .. }), "{e}");
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    // The socket appears (containerd started late): the same client now works.
    std::os::unix::fs::symlink(&real, &path).unwrap();
    let mut ok = false;
    for _ in 0..50 {
        if c.version().await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the client recovers once the socket exists");
}

#[tokio::test]
async fn a_pod_lifecycle_with_real_containers() {
    let (c, _) = CriClient::connect(&stack()).await.unwrap();
    let logs = tempfile::tempdir().unwrap();
    let uid = format!("cri-test-{}", std::process::id());
    let sb_cfg = sandbox_config("lifecycle", &uid, logs.path());

    let image_ref = c.pull_image(IMAGE_1, None).await.unwrap();
    assert!(image_ref.starts_with("sha256:"), "{image_ref}");
    let img = c
        .image_status(IMAGE_1)
        .await
        .unwrap()
        .expect("pulled image is present");
    assert!(img.repo_tags.iter().any(|t| t == IMAGE_1));
    assert!(c
        .image_status("127.0.0.1:5000/busybox:9.9")
        .await
        .unwrap()
        .is_none());

    let sb = c.run_pod_sandbox(sb_cfg.clone()).await.unwrap();
    let st = c.pod_sandbox_status(&sb).await.unwrap().unwrap();
    assert_eq!(st.state, api::PodSandboxState::SandboxReady as i32);

    let cfg = api::ContainerConfig {
        metadata: Some(api::ContainerMetadata {
            name: "app".into(),
            attempt: 0,
        }),
        image: Some(api::ImageSpec {
            image: IMAGE_1.into(),
            ..Default::default()
        }),
        log_path: "app_0.log".into(),
        labels: HashMap::from([
            (labels::POD_UID.into(), uid.clone()),
            (labels::CONTAINER_NAME.into(), "app".into()),
            (labels::MANAGED_BY.into(), "edgehub".into()),
        ]),
        ..Default::default()
    };
    let ctr = c.create_container(&sb, cfg, sb_cfg.clone()).await.unwrap();
    c.start_container(&ctr).await.unwrap();
    let st = c.container_status(&ctr).await.unwrap().unwrap();
    assert_eq!(st.state, api::ContainerState::ContainerRunning as i32);
    // The image ID a pod status reports: the repo digest the runtime resolved.
    assert!(
        img.repo_digests.contains(&st.image_ref),
        "{} not in {:?}",
        st.image_ref,
        img.repo_digests
    );

    // The process really runs: it writes to its CRI log, and answers exec.
    let log = logs.path().join("app_0.log");
    let mut seen = false;
    for _ in 0..50 {
        if std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("hello from 1.0")
        {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen, "the container's output reaches its log file");
    let out = c
        .exec_sync(
            &ctr,
            vec!["echo".into(), "probe-ok".into()],
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(
        (out.exit_code, String::from_utf8_lossy(&out.stdout).trim()),
        (0, "probe-ok")
    );
    let fail = c
        .exec_sync(&ctr, vec!["false".into()], Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(fail.exit_code, 1);

    let mine = HashMap::from([(labels::POD_UID.to_string(), uid.clone())]);
    assert_eq!(c.list_containers(mine.clone()).await.unwrap().len(), 1);
    assert_eq!(c.list_pod_sandbox(mine.clone()).await.unwrap().len(), 1);

    c.stop_container(&ctr, 0).await.unwrap();
    let st = c.container_status(&ctr).await.unwrap().unwrap();
    assert_eq!(st.state, api::ContainerState::ContainerExited as i32);
    c.remove_container(&ctr).await.unwrap();
    let gone = c.container_status(&ctr).await.unwrap_err();
    assert!(gone.is_not_found(), "{gone}");
    c.stop_pod_sandbox(&sb).await.unwrap();
    c.remove_pod_sandbox(&sb).await.unwrap();
    assert!(c.list_pod_sandbox(mine.clone()).await.unwrap().is_empty());
    assert!(c.list_containers(mine).await.unwrap().is_empty());
}

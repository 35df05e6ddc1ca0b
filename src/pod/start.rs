//! The CRI steps the runtime and the upgrade engine both take on a pod: start a container
//! (pulled per its policy), and stop and remove containers and sandboxes. One copy, so the
//! two agree on attempt numbers, log paths, pull auth and what "already gone" means.

use crate::cri::{api, CriError, CriRuntime};
use crate::podspec::{ContainerPlan, PullPolicy};

/// The kubelet's reason for a pod the runtime refused.
pub fn failure_reason(e: &CriError) -> &'static str {
    match e {
        CriError::Call {
            method: "PullImage",
            ..
        }
        | CriError::Timeout {
            method: "PullImage",
            ..
        } => "ErrImagePull",
        CriError::Call { code, .. } if code == "ImageNotPresent" => "ErrImageNeverPull",
        CriError::Call {
            method: "RunPodSandbox",
            ..
        } => "FailedCreatePodSandBox",
        CriError::Call {
            method: "StartContainer",
            ..
        } => "RunContainerError",
        _ => "CreateContainerError",
    }
}

/// A removal of something already gone is done: the runtime, a restart or a power cut got
/// there first.
pub fn ignore_missing(r: Result<(), CriError>) -> Result<(), CriError> {
    match r {
        Err(e) if e.is_not_found() => Ok(()),
        other => other,
    }
}

/// The credentials a container's image is pulled with. No server_address: the credentials
/// were already matched to the image's registry, and containerd parses that field as a URL,
/// so a plain `host:port` (the usual docker config key) makes every pull fail.
pub fn pull_auth(c: &ContainerPlan) -> Option<api::AuthConfig> {
    c.auth.as_ref().map(|a| api::AuthConfig {
        username: a.username.clone(),
        password: a.password.clone(),
        ..Default::default()
    })
}

/// The container's CRI config as attempt `attempt`: the attempt in its metadata, and its log
/// file named for the attempt (a name that cannot name a file is refused, not written outside
/// the pod's log dir).
pub fn attempt_config(c: &ContainerPlan, attempt: u32) -> Result<api::ContainerConfig, CriError> {
    let mut cfg = c.config.clone();
    if let Some(m) = cfg.metadata.as_mut() {
        m.attempt = attempt;
    }
    cfg.log_path =
        crate::names::log_file_name(&c.name, attempt).map_err(|reason| CriError::Call {
            method: "CreateContainer",
            code: "InvalidArgument".into(),
            message: reason,
        })?;
    Ok(cfg)
}

/// Pulls the image per policy, then creates and starts the container.
pub async fn create_and_start<R: CriRuntime>(
    cri: &R,
    pod: &str,
    sandbox_id: &str,
    sandbox_config: &api::PodSandboxConfig,
    c: &ContainerPlan,
    attempt: u32,
) -> Result<String, CriError> {
    let present = cri.image_status(&c.image).await?.is_some();
    match (c.pull_policy, present) {
        (PullPolicy::Never, false) => {
            return Err(CriError::Call {
                method: "CreateContainer",
                code: "ImageNotPresent".into(),
                message: format!(
                    "image {} is not on the node and imagePullPolicy is Never",
                    c.image
                ),
            })
        }
        (PullPolicy::Always, _) | (PullPolicy::IfNotPresent, false) => {
            super::slots::pull(cri, &c.image, pull_auth(c)).await?;
        }
        _ => {}
    }
    let cfg = attempt_config(c, attempt)?;
    let id = cri
        .create_container(sandbox_id, cfg, sandbox_config.clone())
        .await?;
    cri.start_container(&id).await?;
    tracing::info!(pod = %pod, container = %c.name, id = %id, attempt, "container started");
    Ok(id)
}

/// Stops the containers all at once, as the kubelet stops a pod's containers (a pod takes
/// one grace period to stop, not one per container), then removes them and the sandboxes.
pub async fn stop_and_remove<R: CriRuntime>(
    cri: &R,
    sandboxes: &[String],
    containers: &[String],
    grace_secs: i64,
) -> Result<(), CriError> {
    stop_all(cri, containers, grace_secs).await?;
    for c in containers {
        ignore_missing(cri.remove_container(c).await)?;
    }
    for s in sandboxes {
        ignore_missing(cri.stop_pod_sandbox(s).await)?;
        ignore_missing(cri.remove_pod_sandbox(s).await)?;
    }
    Ok(())
}

/// Stops the containers all at once (a pod takes one grace period to stop, not one per
/// container), keeping them.
pub async fn stop_all<R: CriRuntime>(
    cri: &R,
    containers: &[String],
    grace_secs: i64,
) -> Result<(), CriError> {
    let stops = containers
        .iter()
        .map(|c| async move { ignore_missing(cri.stop_container(c, grace_secs).await) });
    for stopped in join_all(stops.collect()).await {
        stopped?;
    }
    Ok(())
}

/// Runs the futures together and returns their outputs in order (a pod's few containers: no
/// dependency for it).
async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *out = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

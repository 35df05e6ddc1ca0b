//! PodSpec → CRI configuration, as a pure function of the cached pod and the node's facts.
//!
//! edgehub runs a supported subset of the PodSpec. Anything outside it is an [`Unsupported`]
//! error that names the field, so the reconciler can set a pod condition and carry on with the
//! other pods instead of running something different from what was asked.

use crate::cri::{api, labels};
use crate::sources::{self, Data, Lookup, RegistryAuth, Sources};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;

/// A field edgehub cannot run, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct Unsupported {
    pub field: String,
    pub reason: String,
}

fn unsupported(field: impl Into<String>, reason: impl Into<String>) -> Unsupported {
    Unsupported {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Something the pod references that edgehub does not have (yet): a ConfigMap, Secret or
/// service-account token that was never fetched, or that the apiserver says does not exist.
/// Unlike [`Unsupported`] this can clear up by itself once the link returns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Missing {
    /// The condition reason: `ConfigMapUnavailable`, `SecretUnavailable` or
    /// `ServiceAccountTokenUnavailable`.
    pub reason: &'static str,
    pub message: String,
    /// The apiserver said it does not exist. Otherwise it was never fetched (a new pod whose
    /// sources are on their way, or no link since it arrived): the pod waits quietly, with a
    /// condition but no Warning Event.
    pub known_absent: bool,
}

/// Why a pod cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
    #[error(transparent)]
    Missing(#[from] Missing),
}

/// What the translation needs besides the pod.
#[derive(Debug, Clone)]
pub struct PodContext {
    pub node_name: String,
    pub host_ip: Option<String>,
    /// Where this pod's volumes live (`<data_dir>/pods/<uid>/volumes`).
    pub volume_dir: PathBuf,
    /// Where its container logs go (`<data_dir>/pods/<uid>/logs`).
    pub log_dir: PathBuf,
    /// Sandbox attempt: bumped each time the sandbox is recreated.
    pub attempt: u32,
    /// The sandbox's address when it has its own network namespace (CNI); host-network pods
    /// use `host_ip`.
    pub pod_ip: Option<String>,
    /// The ConfigMaps, Secrets and tokens the pod references, as cached.
    pub sources: Sources,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartPolicy {
    Always,
    OnFailure,
    Never,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullPolicy {
    Always,
    IfNotPresent,
    Never,
}

/// A volume the runtime must prepare on the host before containers start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumePlan {
    /// `hostPath`: `kind` is the PodSpec type ("" means no check).
    HostPath {
        name: String,
        path: PathBuf,
        kind: String,
    },
    /// `emptyDir`: a directory under the pod's volume dir.
    EmptyDir { name: String, path: PathBuf },
    /// `configMap`, `secret`, `downwardAPI` and `projected`: files edgehub writes (and
    /// rewrites atomically when their sources change) under the pod's volume dir.
    Files {
        name: String,
        path: PathBuf,
        files: Vec<VolumeFile>,
        /// Kept in memory (a tmpfs), never on flash: Secret, projected (tokens) and
        /// downwardAPI volumes, as the kubelet keeps them.
        memory: bool,
    },
}

/// One file of a [`VolumePlan::Files`] volume.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VolumeFile {
    /// Relative, without `..` (checked).
    pub path: String,
    pub data: Vec<u8>,
    pub mode: u32,
}

impl VolumePlan {
    pub fn name(&self) -> &str {
        match self {
            VolumePlan::HostPath { name, .. }
            | VolumePlan::EmptyDir { name, .. }
            | VolumePlan::Files { name, .. } => name,
        }
    }

    pub fn host_path(&self) -> &PathBuf {
        match self {
            VolumePlan::HostPath { path, .. }
            | VolumePlan::EmptyDir { path, .. }
            | VolumePlan::Files { path, .. } => path,
        }
    }
}

/// One container, ready for CreateContainer (attempt set by the caller).
#[derive(Debug, Clone)]
pub struct ContainerPlan {
    pub name: String,
    pub image: String,
    pub pull_policy: PullPolicy,
    /// Registry credentials from the pod's imagePullSecrets, when one names the image's
    /// registry.
    pub auth: Option<RegistryAuth>,
    pub liveness: Option<ProbeSpec>,
    pub readiness: Option<ProbeSpec>,
    pub config: api::ContainerConfig,
}

/// Everything the runtime needs to run the pod.
#[derive(Debug, Clone)]
pub struct PodPlan {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub sandbox: api::PodSandboxConfig,
    pub init_containers: Vec<ContainerPlan>,
    pub containers: Vec<ContainerPlan>,
    pub volumes: Vec<VolumePlan>,
    pub restart_policy: RestartPolicy,
    pub grace_period_secs: i64,
    pub host_network: bool,
    /// The node's address for host-network pods, the sandbox's for the others (once known).
    pub pod_ip: Option<String>,
}

/// The elements of the array at `key` with their index; none when absent or not an array.
fn items<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = (usize, &'a Value)> {
    v.get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
}

/// The strings of a JSON array (other elements skipped); empty when absent.
fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect()
}

fn s<'a>(v: &'a Value, p: &str) -> &'a str {
    v.pointer(p).and_then(Value::as_str).unwrap_or("")
}

/// The pod's namespace (empty when it has none).
fn pod_ns(pod: &Value) -> String {
    s(pod, "/metadata/namespace").to_string()
}

/// A ConfigMap or Secret a pod needs that the cache does not hold: `not_found` when the
/// apiserver said it does not exist, else not fetched yet. Volumes and env both refer to them.
fn missing_object(kind: &str, ns: &str, name: &str, not_found: bool) -> Missing {
    let (reason, what) = if kind == "secrets" {
        ("SecretUnavailable", "secret")
    } else {
        ("ConfigMapUnavailable", "configmap")
    };
    Missing {
        reason,
        known_absent: not_found,
        message: if not_found {
            format!("{what} \"{ns}/{name}\" not found")
        } else {
            format!("{what} \"{ns}/{name}\" is not cached yet: edgehub has not fetched it from the apiserver since the pod arrived")
        },
    }
}

/// Pod-level fields edgehub does not run. (Those it handles, or can safely ignore as a node
/// agent without those features, are not listed.)
const UNSUPPORTED_POD_FIELDS: &[&str] = &[
    "ephemeralContainers",
    "runtimeClassName",
    "shareProcessNamespace",
    "hostUsers",
    "os",
    "overhead",
    "resourceClaims",
    "schedulingGates",
    "hostAliases",
];

const UNSUPPORTED_CONTAINER_FIELDS: &[&str] = &[
    "lifecycle",
    "startupProbe",
    "volumeDevices",
    "resizePolicy",
    "restartPolicy",
    "stdin",
    "tty",
];

/// Translates a cached pod.
pub fn translate(pod: &Value, ctx: &PodContext) -> Result<PodPlan, PlanError> {
    let spec = pod
        .get("spec")
        .filter(|s| s.is_object())
        .ok_or_else(|| unsupported("spec", "missing"))?;
    for f in UNSUPPORTED_POD_FIELDS {
        if spec.get(*f).is_some_and(|v| !v.is_null()) {
            return Err(unsupported(format!("spec.{f}"), "not supported by edgehub").into());
        }
    }
    let uid = s(pod, "/metadata/uid").to_string();
    let namespace = s(pod, "/metadata/namespace").to_string();
    let name = s(pod, "/metadata/name").to_string();
    let flag = |k: &str| spec.get(k).and_then(Value::as_bool).unwrap_or(false);
    let host_network = flag("hostNetwork");
    let mode = |on: bool| {
        if on {
            api::NamespaceMode::Node as i32
        } else {
            api::NamespaceMode::Pod as i32
        }
    };
    let restart_policy = match s(spec, "/restartPolicy") {
        "" | "Always" => RestartPolicy::Always,
        "OnFailure" => RestartPolicy::OnFailure,
        "Never" => RestartPolicy::Never,
        other => {
            return Err(
                unsupported("spec.restartPolicy", format!("unknown value {other:?}")).into(),
            )
        }
    };
    let grace_period_secs = spec
        .get("terminationGracePeriodSeconds")
        .and_then(Value::as_i64)
        .unwrap_or(30)
        .max(0);

    let mut sandbox_labels = HashMap::from([
        (labels::POD_NAME.to_string(), name.clone()),
        (labels::POD_NAMESPACE.to_string(), namespace.clone()),
        (labels::POD_UID.to_string(), uid.clone()),
        (labels::MANAGED_BY.to_string(), "edgehub".to_string()),
        (labels::NODE.to_string(), ctx.node_name.clone()),
    ]);
    if let Some(h) = pod
        .pointer("/metadata/labels/controller-revision-hash")
        .and_then(Value::as_str)
    {
        sandbox_labels.insert(labels::REVISION_HASH.to_string(), h.to_string());
    }
    let pod_ports = collect_ports(spec)?;
    let sandbox = api::PodSandboxConfig {
        metadata: Some(api::PodSandboxMetadata {
            name: name.clone(),
            uid: uid.clone(),
            namespace: namespace.clone(),
            attempt: ctx.attempt,
        }),
        // Host-network pods leave the hostname empty, as the kubelet does (runc cannot set a
        // hostname without a private UTS namespace); others get spec.hostname or the name.
        hostname: if host_network {
            String::new()
        } else {
            match s(spec, "/hostname") {
                "" => name.clone(),
                h => h.to_string(),
            }
        },
        log_directory: ctx.log_dir.display().to_string(),
        port_mappings: pod_ports,
        labels: sandbox_labels.clone(),
        // As the kubelet does: a sandbox whose pod left the cache is stopped with the grace
        // period its pod asked for.
        annotations: HashMap::from([(
            labels::GRACE_PERIOD.to_string(),
            grace_period_secs.to_string(),
        )]),
        linux: Some(api::LinuxPodSandboxConfig {
            security_context: Some(api::LinuxSandboxSecurityContext {
                namespace_options: Some(api::NamespaceOption {
                    network: mode(host_network),
                    pid: if flag("hostPID") {
                        api::NamespaceMode::Node as i32
                    } else {
                        api::NamespaceMode::Container as i32
                    },
                    ipc: mode(flag("hostIPC")),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };

    let volumes = volumes(pod, spec, ctx)?;
    let pull_secrets: Vec<&Data> = items(spec, "imagePullSecrets")
        .filter_map(|(_, p)| match ctx.sources.secret(s(p, "/name")) {
            Lookup::Found(d) => Some(d),
            _ => None,
        })
        .collect();
    let mut plans = Vec::new();
    for (field, init) in [("initContainers", true), ("containers", false)] {
        let list = spec
            .get(field)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut out = Vec::new();
        for (i, c) in list.iter().enumerate() {
            out.push(container(
                pod,
                c,
                &format!("spec.{field}[{i}]"),
                &volumes,
                ctx,
                init,
                &pull_secrets,
            )?);
        }
        plans.push(out);
    }
    let containers = plans.pop().unwrap_or_default();
    let init_containers = plans.pop().unwrap_or_default();
    if containers.is_empty() {
        return Err(unsupported("spec.containers", "a pod needs at least one container").into());
    }
    Ok(PodPlan {
        uid,
        namespace,
        name,
        sandbox,
        init_containers,
        containers,
        volumes,
        restart_policy,
        grace_period_secs,
        host_network,
        pod_ip: if host_network {
            ctx.host_ip.clone()
        } else {
            ctx.pod_ip.clone()
        },
    })
}

fn collect_ports(spec: &Value) -> Result<Vec<api::PortMapping>, Unsupported> {
    let mut out = Vec::new();
    for (ci, c) in items(spec, "containers") {
        for (pi, p) in items(c, "ports") {
            let field = format!("spec.containers[{ci}].ports[{pi}]");
            let protocol = match s(p, "/protocol") {
                "" | "TCP" => api::Protocol::Tcp,
                "UDP" => api::Protocol::Udp,
                "SCTP" => api::Protocol::Sctp,
                other => return Err(unsupported(field, format!("unknown protocol {other:?}"))),
            };
            let container_port = p.get("containerPort").and_then(Value::as_i64).unwrap_or(0) as i32;
            let host_port = p.get("hostPort").and_then(Value::as_i64).unwrap_or(0) as i32;
            if host_port > 0 {
                out.push(api::PortMapping {
                    protocol: protocol as i32,
                    container_port,
                    host_port,
                    host_ip: s(p, "/hostIP").to_string(),
                });
            }
        }
    }
    Ok(out)
}

mod container;
mod env;
mod probe;
mod resources;
mod volumes;

use container::container;
pub use probe::{ProbeAction, ProbeSpec};
pub use resources::{parse_bytes, parse_cpu_millis};
use volumes::volumes;

#[cfg(test)]
mod tests;

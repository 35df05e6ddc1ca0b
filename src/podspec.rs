//! PodSpec → CRI configuration, as a pure function of the cached pod and the node's facts.
//!
//! edgehub runs a supported subset of the PodSpec. Anything outside it is an [`Unsupported`]
//! error that names the field, so the reconciler can set a pod condition and carry on with the
//! other pods instead of running something different from what was asked.

use crate::cri::{api, labels};
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
}

impl VolumePlan {
    pub fn host_path(&self) -> &PathBuf {
        match self {
            VolumePlan::HostPath { path, .. } | VolumePlan::EmptyDir { path, .. } => path,
        }
    }
}

/// One container, ready for CreateContainer (attempt set by the caller).
#[derive(Debug, Clone)]
pub struct ContainerPlan {
    pub name: String,
    pub image: String,
    pub pull_policy: PullPolicy,
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
}

/// The elements of the array at `key` with their index; none when absent or not an array.
fn items<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = (usize, &'a Value)> {
    v.get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
}

fn s<'a>(v: &'a Value, p: &str) -> &'a str {
    v.pointer(p).and_then(Value::as_str).unwrap_or("")
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
pub fn translate(pod: &Value, ctx: &PodContext) -> Result<PodPlan, Unsupported> {
    let spec = pod
        .get("spec")
        .filter(|s| s.is_object())
        .ok_or_else(|| unsupported("spec", "missing"))?;
    for f in UNSUPPORTED_POD_FIELDS {
        if spec.get(*f).is_some_and(|v| !v.is_null()) {
            return Err(unsupported(format!("spec.{f}"), "not supported by edgehub"));
        }
    }
    let uid = s(pod, "/metadata/uid").to_string();
    let namespace = s(pod, "/metadata/namespace").to_string();
    let name = s(pod, "/metadata/name").to_string();
    let flag = |k: &str| spec.get(k).and_then(Value::as_bool).unwrap_or(false);
    let host_network = flag("hostNetwork");
    if !host_network {
        return Err(unsupported(
            "spec.hostNetwork",
            "only host-network pods are run (pod networking through CNI is not set up yet)",
        ));
    }
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
            return Err(unsupported(
                "spec.restartPolicy",
                format!("unknown value {other:?}"),
            ))
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
        // hostname without a private UTS namespace).
        hostname: String::new(),
        log_directory: ctx.log_dir.display().to_string(),
        port_mappings: pod_ports,
        labels: sandbox_labels.clone(),
        annotations: HashMap::new(),
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

    let volumes = volumes(spec, ctx)?;
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
                &uid,
                ctx,
                init,
            )?);
        }
        plans.push(out);
    }
    let containers = plans.pop().unwrap_or_default();
    let init_containers = plans.pop().unwrap_or_default();
    if containers.is_empty() {
        return Err(unsupported(
            "spec.containers",
            "a pod needs at least one container",
        ));
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

fn volumes(spec: &Value, ctx: &PodContext) -> Result<Vec<VolumePlan>, Unsupported> {
    let mut out = Vec::new();
    for (i, v) in items(spec, "volumes") {
        let name = s(v, "/name").to_string();
        let field = format!("spec.volumes[{i}]");
        if let Some(hp) = v.get("hostPath") {
            let path = s(hp, "/path");
            if !path.starts_with('/') {
                return Err(unsupported(
                    format!("{field}.hostPath.path"),
                    "must be an absolute path",
                ));
            }
            let kind = s(hp, "/type").to_string();
            const TYPES: &[&str] = &[
                "",
                "DirectoryOrCreate",
                "Directory",
                "FileOrCreate",
                "File",
                "Socket",
                "CharDevice",
                "BlockDevice",
            ];
            if !TYPES.contains(&kind.as_str()) {
                return Err(unsupported(
                    format!("{field}.hostPath.type"),
                    format!("unknown type {kind:?}"),
                ));
            }
            out.push(VolumePlan::HostPath {
                name,
                path: PathBuf::from(path),
                kind,
            });
        } else if v.get("emptyDir").is_some() {
            if s(v, "/emptyDir/medium") == "Memory" {
                return Err(unsupported(
                    format!("{field}.emptyDir.medium"),
                    "Memory (tmpfs) is not supported",
                ));
            }
            out.push(VolumePlan::EmptyDir {
                path: ctx.volume_dir.join("empty-dir").join(&name),
                name,
            });
        } else {
            let kind = v
                .as_object()
                .and_then(|m| m.keys().find(|k| *k != "name").cloned())
                .unwrap_or_else(|| "?".into());
            return Err(unsupported(
                format!("{field}.{kind}"),
                "this volume type is not supported yet",
            ));
        }
    }
    Ok(out)
}

/// CPU quantity in millicores ("200m", "1", "0.5").
pub fn parse_cpu_millis(q: &str) -> Option<i64> {
    if let Some(m) = q.strip_suffix('m') {
        return m.parse().ok();
    }
    q.parse::<f64>().ok().map(|c| (c * 1000.0).round() as i64)
}

/// Memory quantity in bytes ("64Mi", "1G", "128974848", "1.5Gi").
pub fn parse_bytes(q: &str) -> Option<i64> {
    const SUFFIXES: &[(&str, f64)] = &[
        ("Ki", 1024.0),
        ("Mi", 1_048_576.0),
        ("Gi", 1_073_741_824.0),
        ("Ti", 1_099_511_627_776.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ];
    for (suf, mul) in SUFFIXES {
        if let Some(n) = q.strip_suffix(suf) {
            return n.parse::<f64>().ok().map(|v| (v * mul) as i64);
        }
    }
    q.parse::<f64>().ok().map(|v| v as i64)
}

fn resources(c: &Value, field: &str) -> Result<api::LinuxContainerResources, Unsupported> {
    let mut r = api::LinuxContainerResources::default();
    if let Some(cpu) = c.pointer("/resources/limits/cpu").and_then(Value::as_str) {
        let m = parse_cpu_millis(cpu).ok_or_else(|| {
            unsupported(
                format!("{field}.resources.limits.cpu"),
                format!("bad quantity {cpu:?}"),
            )
        })?;
        r.cpu_period = 100_000;
        r.cpu_quota = (m * 100).max(1000);
    }
    let req_cpu = c
        .pointer("/resources/requests/cpu")
        .or_else(|| c.pointer("/resources/limits/cpu"));
    if let Some(cpu) = req_cpu.and_then(Value::as_str) {
        let m = parse_cpu_millis(cpu).ok_or_else(|| {
            unsupported(
                format!("{field}.resources.requests.cpu"),
                format!("bad quantity {cpu:?}"),
            )
        })?;
        // The kubelet's milliCPU -> shares conversion, clamped to the kernel's minimum.
        r.cpu_shares = (m * 1024 / 1000).max(2);
    }
    if let Some(mem) = c
        .pointer("/resources/limits/memory")
        .and_then(Value::as_str)
    {
        r.memory_limit_in_bytes = parse_bytes(mem).ok_or_else(|| {
            unsupported(
                format!("{field}.resources.limits.memory"),
                format!("bad quantity {mem:?}"),
            )
        })?;
    }
    Ok(r)
}

fn env_value(
    pod: &Value,
    c: &Value,
    e: &Value,
    field: &str,
    ctx: &PodContext,
) -> Result<String, Unsupported> {
    if let Some(v) = e.get("value").and_then(Value::as_str) {
        return Ok(v.to_string());
    }
    let Some(from) = e.get("valueFrom") else {
        return Ok(String::new());
    };
    if let Some(fr) = from.get("fieldRef") {
        let path = s(fr, "/fieldPath");
        return match path {
            "metadata.name" => Ok(s(pod, "/metadata/name").into()),
            "metadata.namespace" => Ok(s(pod, "/metadata/namespace").into()),
            "metadata.uid" => Ok(s(pod, "/metadata/uid").into()),
            "spec.nodeName" => Ok(ctx.node_name.clone()),
            // Host-network pods share the node's address.
            "status.podIP" | "status.hostIP" => Ok(ctx.host_ip.clone().unwrap_or_default()),
            other => Err(unsupported(
                format!("{field}.valueFrom.fieldRef.fieldPath"),
                format!("{other:?} is not supported"),
            )),
        };
    }
    if let Some(rr) = from.get("resourceFieldRef") {
        let res = s(rr, "/resource");
        let target = if s(rr, "/containerName").is_empty() {
            c
        } else {
            let want = s(rr, "/containerName");
            pod.pointer("/spec/containers")
                .and_then(Value::as_array)
                .and_then(|cs| cs.iter().find(|x| s(x, "/name") == want))
                .ok_or_else(|| {
                    unsupported(
                        format!("{field}.valueFrom.resourceFieldRef.containerName"),
                        format!("no container {want:?}"),
                    )
                })?
        };
        let (kind, which) = res.split_once('.').unwrap_or(("", ""));
        let q = target
            .pointer(&format!("/resources/{kind}/{which}"))
            .and_then(Value::as_str);
        let divisor = s(rr, "/divisor");
        return match (which, q) {
            ("cpu", q) => {
                let m = q.and_then(parse_cpu_millis).unwrap_or(0);
                let d = if divisor.is_empty() {
                    1000
                } else {
                    parse_cpu_millis(divisor).unwrap_or(1000).max(1)
                };
                // Rounded up, as the kubelet does.
                Ok(((m + d - 1) / d).to_string())
            }
            ("memory", q) => {
                let b = q.and_then(parse_bytes).unwrap_or(0);
                let d = if divisor.is_empty() {
                    1
                } else {
                    parse_bytes(divisor).unwrap_or(1).max(1)
                };
                Ok(((b + d - 1) / d).to_string())
            }
            _ => Err(unsupported(
                format!("{field}.valueFrom.resourceFieldRef.resource"),
                format!("{res:?} is not supported"),
            )),
        };
    }
    let kind = from
        .as_object()
        .and_then(|m| m.keys().next().cloned())
        .unwrap_or_default();
    Err(unsupported(
        format!("{field}.valueFrom.{kind}"),
        "not supported yet (ConfigMap and Secret references need the API)",
    ))
}

fn container(
    pod: &Value,
    c: &Value,
    field: &str,
    volumes: &[VolumePlan],
    uid: &str,
    ctx: &PodContext,
    init: bool,
) -> Result<ContainerPlan, Unsupported> {
    for f in UNSUPPORTED_CONTAINER_FIELDS {
        if c.get(*f)
            .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
        {
            return Err(unsupported(
                format!("{field}.{f}"),
                "not supported by edgehub",
            ));
        }
    }
    if c.get("envFrom")
        .is_some_and(|v| v.as_array().is_some_and(|a| !a.is_empty()))
    {
        return Err(unsupported(
            format!("{field}.envFrom"),
            "not supported yet (ConfigMap and Secret references need the API)",
        ));
    }
    let name = s(c, "/name").to_string();
    let image = s(c, "/image").to_string();
    if name.is_empty() || image.is_empty() {
        return Err(unsupported(field, "a container needs a name and an image"));
    }
    let pull_policy = match s(c, "/imagePullPolicy") {
        "Always" => PullPolicy::Always,
        "Never" => PullPolicy::Never,
        "IfNotPresent" => PullPolicy::IfNotPresent,
        "" if image.ends_with(":latest")
            || !image.rsplit('/').next().unwrap_or("").contains(':') =>
        {
            PullPolicy::Always
        }
        "" => PullPolicy::IfNotPresent,
        other => {
            return Err(unsupported(
                format!("{field}.imagePullPolicy"),
                format!("unknown value {other:?}"),
            ))
        }
    };
    let strings = |k: &str| -> Vec<String> {
        c.get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut envs = Vec::new();
    for (i, e) in items(c, "env") {
        let f = format!("{field}.env[{i}]");
        envs.push(api::KeyValue {
            key: s(e, "/name").to_string(),
            value: env_value(pod, c, e, &f, ctx)?,
        });
    }
    let mut mounts = Vec::new();
    for (i, m) in items(c, "volumeMounts") {
        let vname = s(m, "/name");
        let vol = volumes
            .iter()
            .find(|v| matches!(v, VolumePlan::HostPath { name, .. } | VolumePlan::EmptyDir { name, .. } if name == vname))
            .ok_or_else(|| unsupported(format!("{field}.volumeMounts[{i}]"), format!("no volume named {vname:?}")))?;
        if m.get("subPath").is_some() || m.get("subPathExpr").is_some() {
            return Err(unsupported(
                format!("{field}.volumeMounts[{i}].subPath"),
                "not supported yet",
            ));
        }
        mounts.push(api::Mount {
            container_path: s(m, "/mountPath").to_string(),
            host_path: vol.host_path().display().to_string(),
            readonly: m.get("readOnly").and_then(Value::as_bool).unwrap_or(false),
            ..Default::default()
        });
    }
    let sc = c.get("securityContext");
    let caps = |k: &str| -> Vec<String> {
        sc.and_then(|s| s.pointer(&format!("/capabilities/{k}")))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let int = |k: &str| {
        sc.and_then(|s| s.get(k))
            .and_then(Value::as_i64)
            .map(|value| api::Int64Value { value })
    };
    let security = api::LinuxContainerSecurityContext {
        capabilities: Some(api::Capability {
            add_capabilities: caps("add"),
            drop_capabilities: caps("drop"),
            ..Default::default()
        }),
        privileged: sc
            .and_then(|s| s.get("privileged"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        run_as_user: int("runAsUser"),
        run_as_group: int("runAsGroup"),
        readonly_rootfs: sc
            .and_then(|s| s.get("readOnlyRootFilesystem"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        no_new_privs: sc
            .and_then(|s| s.get("allowPrivilegeEscalation"))
            .and_then(Value::as_bool)
            == Some(false),
        ..Default::default()
    };
    let mut ctr_labels = HashMap::from([
        (
            labels::POD_NAME.to_string(),
            s(pod, "/metadata/name").to_string(),
        ),
        (
            labels::POD_NAMESPACE.to_string(),
            s(pod, "/metadata/namespace").to_string(),
        ),
        (labels::POD_UID.to_string(), uid.to_string()),
        (labels::CONTAINER_NAME.to_string(), name.clone()),
        (labels::MANAGED_BY.to_string(), "edgehub".to_string()),
        (labels::NODE.to_string(), ctx.node_name.clone()),
    ]);
    if init {
        ctr_labels.insert("edgehub.io/init".into(), "true".into());
    }
    if let Some(h) = pod
        .pointer("/metadata/labels/controller-revision-hash")
        .and_then(Value::as_str)
    {
        ctr_labels.insert(labels::REVISION_HASH.to_string(), h.to_string());
    }
    let config = api::ContainerConfig {
        metadata: Some(api::ContainerMetadata {
            name: name.clone(),
            attempt: 0,
        }),
        image: Some(api::ImageSpec {
            image: image.clone(),
            ..Default::default()
        }),
        command: strings("command"),
        args: strings("args"),
        working_dir: s(c, "/workingDir").to_string(),
        envs,
        mounts,
        labels: ctr_labels,
        log_path: format!("{name}_0.log"),
        linux: Some(api::LinuxContainerConfig {
            resources: Some(resources(c, field)?),
            security_context: Some(security),
        }),
        ..Default::default()
    };
    Ok(ContainerPlan {
        name,
        image,
        pull_policy,
        config,
    })
}

#[cfg(test)]
mod tests;

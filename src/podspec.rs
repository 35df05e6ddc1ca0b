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

fn volumes(pod: &Value, spec: &Value, ctx: &PodContext) -> Result<Vec<VolumePlan>, PlanError> {
    let mut out = Vec::new();
    for (i, v) in items(spec, "volumes") {
        let name = s(v, "/name").to_string();
        let field = format!("spec.volumes[{i}]");
        // The name becomes a directory under the pod's volume dir: a DNS-1123 label, as the
        // apiserver validates it, so `..` or `a/b` never reaches a path.
        crate::names::check_label(&name)
            .map_err(|r| unsupported(format!("{field}.name"), format!("{name:?}: {r}")))?;
        let mode_of = |key: &str, default: u32| -> Result<u32, Unsupported> {
            match v.pointer(key) {
                None | Some(Value::Null) => Ok(default),
                Some(m) => file_mode(m, &format!("{field}{}", key.replace('/', "."))),
            }
        };
        let files_at = |kind: &str, files: Vec<VolumeFile>| VolumePlan::Files {
            path: ctx.volume_dir.join(kind).join(&name),
            name: name.clone(),
            files,
            memory: kind != "configmap",
        };
        if let Some(hp) = v.get("hostPath") {
            let path = s(hp, "/path");
            if !path.starts_with('/') {
                return Err(unsupported(
                    format!("{field}.hostPath.path"),
                    "must be an absolute path",
                )
                .into());
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
                )
                .into());
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
                )
                .into());
            }
            out.push(VolumePlan::EmptyDir {
                path: ctx.volume_dir.join("empty-dir").join(&name),
                name,
            });
        } else if let Some((key, src)) = ["configMap", "secret"]
            .into_iter()
            .find_map(|k| v.get(k).map(|src| (k, src)))
        {
            let (kind, dir) = if key == "secret" {
                ("secrets", "secret")
            } else {
                ("configmaps", "configmap")
            };
            let mode = mode_of(&format!("/{key}/defaultMode"), 0o644)?;
            let field = format!("{field}.{key}");
            let files = object_files(src, kind, &ctx.sources, mode, &field, &pod_ns(pod))?;
            out.push(files_at(dir, files));
        } else if let Some(dapi) = v.get("downwardAPI") {
            let mode = mode_of("/downwardAPI/defaultMode", 0o644)?;
            let files = downward_files(pod, dapi, mode, &format!("{field}.downwardAPI"))?;
            out.push(files_at("downward-api", files));
        } else if let Some(proj) = v.get("projected") {
            let mode = mode_of("/projected/defaultMode", 0o644)?;
            let mut files = Vec::new();
            for (j, src) in items(proj, "sources") {
                let f = format!("{field}.projected.sources[{j}]");
                if let Some(cm) = src.get("configMap") {
                    files.extend(object_files(
                        cm,
                        "configmaps",
                        &ctx.sources,
                        mode,
                        &format!("{f}.configMap"),
                        &pod_ns(pod),
                    )?);
                } else if let Some(sec) = src.get("secret") {
                    files.extend(object_files(
                        sec,
                        "secrets",
                        &ctx.sources,
                        mode,
                        &format!("{f}.secret"),
                        &pod_ns(pod),
                    )?);
                } else if let Some(d) = src.get("downwardAPI") {
                    files.extend(downward_files(pod, d, mode, &format!("{f}.downwardAPI"))?);
                } else if let Some(t) = src.get("serviceAccountToken") {
                    let (audience, exp) = sources::token_params(t);
                    let path =
                        checked_path(s(t, "/path"), &format!("{f}.serviceAccountToken.path"))?;
                    let Some(token) = ctx.sources.token(&audience, exp) else {
                        return Err(Missing {
                            reason: "ServiceAccountTokenUnavailable",
                            message: format!(
                                "no token for service account {:?} yet: edgehub requests it from the apiserver (TokenRequest) and has not been able to",
                                sources::service_account(pod)
                            ),
                            known_absent: false,
                        }
                        .into());
                    };
                    files.push(VolumeFile {
                        path,
                        data: token.as_bytes().to_vec(),
                        mode,
                    });
                } else {
                    let kind = src
                        .as_object()
                        .and_then(|m| m.keys().next().cloned())
                        .unwrap_or_else(|| "?".into());
                    return Err(unsupported(
                        format!("{f}.{kind}"),
                        "this projected source is not supported",
                    )
                    .into());
                }
            }
            out.push(files_at("projected", files));
        } else {
            let kind = v
                .as_object()
                .and_then(|m| m.keys().find(|k| *k != "name").cloned())
                .unwrap_or_else(|| "?".into());
            return Err(unsupported(
                format!("{field}.{kind}"),
                "this volume type is not supported",
            )
            .into());
        }
    }
    Ok(out)
}

fn pod_ns(pod: &Value) -> String {
    s(pod, "/metadata/namespace").to_string()
}

/// A file mode from the API (decimal JSON number, such as 420 for 0644).
fn file_mode(v: &Value, field: &str) -> Result<u32, Unsupported> {
    v.as_u64()
        .filter(|m| *m <= 0o777)
        .map(|m| m as u32)
        .ok_or_else(|| unsupported(field, format!("{v} is not a file mode (0 to 0777)")))
}

/// A volume item's path: relative, no `..` element, not empty, as the apiserver validates
/// it. Checked again here because the cache is not trusted to have been validated.
fn checked_path(p: &str, field: &str) -> Result<String, Unsupported> {
    let bad = p.is_empty()
        || p.starts_with('/')
        || p.split('/').any(|e| e == ".." || e.is_empty())
        || p.starts_with("..");
    if bad {
        return Err(unsupported(
            field,
            format!("{p:?} must be a relative path without '..'"),
        ));
    }
    Ok(p.to_string())
}

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

/// The files of a `configMap` or `secret` volume (or projected source): every key, or the
/// listed `items`.
fn object_files(
    src: &Value,
    kind: &str,
    sources: &Sources,
    default_mode: u32,
    field: &str,
    ns: &str,
) -> Result<Vec<VolumeFile>, PlanError> {
    let name = if kind == "secrets" && src.get("secretName").is_some() {
        s(src, "/secretName")
    } else {
        s(src, "/name")
    };
    let optional = src
        .get("optional")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let lookup = if kind == "secrets" {
        sources.secret(name)
    } else {
        sources.configmap(name)
    };
    let data = match lookup {
        Lookup::Found(d) => d,
        Lookup::NotFound if optional => return Ok(Vec::new()),
        Lookup::NotFound => return Err(missing_object(kind, ns, name, true).into()),
        Lookup::Unknown => return Err(missing_object(kind, ns, name, false).into()),
    };
    let mut out = Vec::new();
    match src.get("items").and_then(Value::as_array) {
        Some(list) if !list.is_empty() => {
            for (i, it) in list.iter().enumerate() {
                let key = s(it, "/key");
                let path = checked_path(s(it, "/path"), &format!("{field}.items[{i}].path"))?;
                let mode = match it.get("mode") {
                    None | Some(Value::Null) => default_mode,
                    Some(m) => file_mode(m, &format!("{field}.items[{i}].mode"))?,
                };
                match data.get(key) {
                    Some(bytes) => out.push(VolumeFile {
                        path,
                        data: bytes.clone(),
                        mode,
                    }),
                    None if optional => {}
                    None => {
                        let mut m = missing_object(kind, ns, name, true);
                        m.message = format!(
                            "{} has no key {key:?}",
                            m.message.trim_end_matches(" not found")
                        );
                        return Err(m.into());
                    }
                }
            }
        }
        _ => {
            for (key, bytes) in data {
                out.push(VolumeFile {
                    path: checked_path(key, field)?,
                    data: bytes.clone(),
                    mode: default_mode,
                });
            }
        }
    }
    Ok(out)
}

/// `metadata.labels` and `.annotations` as the downward API writes them: sorted
/// `key="value"` lines, values quoted as Go's %q does for plain text.
fn kv_lines(m: Option<&serde_json::Map<String, Value>>) -> String {
    let mut lines: Vec<String> = m
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            format!(
                "{k}={}",
                serde_json::to_string(v.as_str().unwrap_or("")).unwrap_or_default()
            )
        })
        .collect();
    lines.sort();
    lines.join("\n")
}

fn downward_files(
    pod: &Value,
    src: &Value,
    default_mode: u32,
    field: &str,
) -> Result<Vec<VolumeFile>, PlanError> {
    let mut out = Vec::new();
    for (i, it) in items(src, "items") {
        let f = format!("{field}.items[{i}]");
        let path = checked_path(s(it, "/path"), &format!("{f}.path"))?;
        let mode = match it.get("mode") {
            None | Some(Value::Null) => default_mode,
            Some(m) => file_mode(m, &format!("{f}.mode"))?,
        };
        let text = if let Some(fr) = it.get("fieldRef") {
            match s(fr, "/fieldPath") {
                "metadata.name" => s(pod, "/metadata/name").to_string(),
                "metadata.namespace" => s(pod, "/metadata/namespace").to_string(),
                "metadata.uid" => s(pod, "/metadata/uid").to_string(),
                "metadata.labels" => {
                    kv_lines(pod.pointer("/metadata/labels").and_then(Value::as_object))
                }
                "metadata.annotations" => kv_lines(
                    pod.pointer("/metadata/annotations")
                        .and_then(Value::as_object),
                ),
                other => {
                    if let Some(key) = other
                        .strip_prefix("metadata.labels['")
                        .or_else(|| other.strip_prefix("metadata.annotations['"))
                        .and_then(|k| k.strip_suffix("']"))
                    {
                        let which = if other.starts_with("metadata.labels") {
                            "labels"
                        } else {
                            "annotations"
                        };
                        pod.pointer("/metadata")
                            .and_then(|m| m.get(which))
                            .and_then(|m| m.get(key))
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string()
                    } else {
                        return Err(unsupported(
                            format!("{f}.fieldRef.fieldPath"),
                            format!("{other:?} is not supported"),
                        )
                        .into());
                    }
                }
            }
        } else if it.get("resourceFieldRef").is_some() {
            resource_field(
                pod,
                None,
                it.get("resourceFieldRef").unwrap_or(&Value::Null),
                &f,
            )?
        } else {
            return Err(unsupported(f, "needs fieldRef or resourceFieldRef").into());
        };
        out.push(VolumeFile {
            path,
            data: text.into_bytes(),
            mode,
        });
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

/// A `resourceFieldRef` value: the container's limit or request, divided (rounded up, as
/// the kubelet does). `c` is the referencing container; `containerName` may name another.
fn resource_field(
    pod: &Value,
    c: Option<&Value>,
    rr: &Value,
    field: &str,
) -> Result<String, Unsupported> {
    let res = s(rr, "/resource");
    let want = s(rr, "/containerName");
    let target = match (want, c) {
        ("", Some(c)) => c,
        _ => pod
            .pointer("/spec/containers")
            .and_then(Value::as_array)
            .and_then(|cs| cs.iter().find(|x| s(x, "/name") == want))
            .ok_or_else(|| {
                unsupported(
                    format!("{field}.resourceFieldRef.containerName"),
                    format!("no container {want:?}"),
                )
            })?,
    };
    let (kind, which) = res.split_once('.').unwrap_or(("", ""));
    let q = target
        .pointer(&format!("/resources/{kind}/{which}"))
        .and_then(Value::as_str);
    let divisor = s(rr, "/divisor");
    match (which, q) {
        ("cpu", q) => {
            let m = q.and_then(parse_cpu_millis).unwrap_or(0);
            let d = if divisor.is_empty() {
                1000
            } else {
                parse_cpu_millis(divisor).unwrap_or(1000).max(1)
            };
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
            format!("{field}.resourceFieldRef.resource"),
            format!("{res:?} is not supported"),
        )),
    }
}

/// A key of a referenced ConfigMap or Secret for `valueFrom`; `None` when an optional
/// reference or key is absent (the variable is then left out, as the kubelet does).
fn key_ref(
    r: &Value,
    kind: &str,
    sources: &Sources,
    ns: &str,
    field: &str,
) -> Result<Option<String>, PlanError> {
    let (name, key) = (s(r, "/name"), s(r, "/key"));
    let optional = r.get("optional").and_then(Value::as_bool).unwrap_or(false);
    let lookup = if kind == "secrets" {
        sources.secret(name)
    } else {
        sources.configmap(name)
    };
    match lookup {
        Lookup::Found(d) => match d.get(key) {
            Some(bytes) => String::from_utf8(bytes.clone()).map(Some).map_err(|_| {
                unsupported(field, format!("key {key:?} of {name:?} is not UTF-8 text")).into()
            }),
            None if optional => Ok(None),
            None => {
                let mut m = missing_object(kind, ns, name, true);
                m.message = format!(
                    "{} has no key {key:?}",
                    m.message.trim_end_matches(" not found")
                );
                Err(m.into())
            }
        },
        Lookup::NotFound | Lookup::Unknown if optional => Ok(None),
        Lookup::NotFound => Err(missing_object(kind, ns, name, true).into()),
        Lookup::Unknown => Err(missing_object(kind, ns, name, false).into()),
    }
}

/// An env var's value; `None` leaves it out.
fn env_value(
    pod: &Value,
    c: &Value,
    e: &Value,
    field: &str,
    ctx: &PodContext,
) -> Result<Option<String>, PlanError> {
    if let Some(v) = e.get("value").and_then(Value::as_str) {
        return Ok(Some(v.to_string()));
    }
    let Some(from) = e.get("valueFrom") else {
        return Ok(Some(String::new()));
    };
    let host_network = pod
        .pointer("/spec/hostNetwork")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if let Some(fr) = from.get("fieldRef") {
        let path = s(fr, "/fieldPath");
        return match path {
            "metadata.name" => Ok(Some(s(pod, "/metadata/name").into())),
            "metadata.namespace" => Ok(Some(s(pod, "/metadata/namespace").into())),
            "metadata.uid" => Ok(Some(s(pod, "/metadata/uid").into())),
            "spec.nodeName" => Ok(Some(ctx.node_name.clone())),
            "spec.serviceAccountName" => Ok(Some(sources::service_account(pod))),
            "status.hostIP" => Ok(Some(ctx.host_ip.clone().unwrap_or_default())),
            // Host-network pods share the node's address.
            "status.podIP" if host_network => Ok(Some(ctx.host_ip.clone().unwrap_or_default())),
            "status.podIP" => Ok(Some(ctx.pod_ip.clone().unwrap_or_default())),
            other => Err(unsupported(
                format!("{field}.valueFrom.fieldRef.fieldPath"),
                format!("{other:?} is not supported"),
            )
            .into()),
        };
    }
    if let Some(rr) = from.get("resourceFieldRef") {
        return Ok(Some(resource_field(
            pod,
            Some(c),
            rr,
            &format!("{field}.valueFrom"),
        )?));
    }
    let ns = pod_ns(pod);
    if let Some(r) = from.get("configMapKeyRef") {
        return key_ref(
            r,
            "configmaps",
            &ctx.sources,
            &ns,
            &format!("{field}.valueFrom.configMapKeyRef"),
        );
    }
    if let Some(r) = from.get("secretKeyRef") {
        return key_ref(
            r,
            "secrets",
            &ctx.sources,
            &ns,
            &format!("{field}.valueFrom.secretKeyRef"),
        );
    }
    let kind = from
        .as_object()
        .and_then(|m| m.keys().next().cloned())
        .unwrap_or_default();
    Err(unsupported(format!("{field}.valueFrom.{kind}"), "not supported").into())
}

/// A C identifier-ish env name, as the kubelet accepts from `envFrom` keys (others are
/// skipped).
fn env_name_ok(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// `envFrom`: every key of the referenced ConfigMaps and Secrets, with the prefix.
fn env_from(
    c: &Value,
    field: &str,
    ctx: &PodContext,
    ns: &str,
) -> Result<Vec<api::KeyValue>, PlanError> {
    let mut out = Vec::new();
    for (i, ef) in items(c, "envFrom") {
        let f = format!("{field}.envFrom[{i}]");
        let (kind, r) = if let Some(r) = ef.get("configMapRef") {
            ("configmaps", r)
        } else if let Some(r) = ef.get("secretRef") {
            ("secrets", r)
        } else {
            return Err(unsupported(f, "needs configMapRef or secretRef").into());
        };
        let name = s(r, "/name");
        let optional = r.get("optional").and_then(Value::as_bool).unwrap_or(false);
        let lookup = if kind == "secrets" {
            ctx.sources.secret(name)
        } else {
            ctx.sources.configmap(name)
        };
        let data = match lookup {
            Lookup::Found(d) => d,
            Lookup::NotFound | Lookup::Unknown if optional => continue,
            Lookup::NotFound => return Err(missing_object(kind, ns, name, true).into()),
            Lookup::Unknown => return Err(missing_object(kind, ns, name, false).into()),
        };
        let prefix = s(ef, "/prefix");
        for (k, v) in data {
            let key = format!("{prefix}{k}");
            if !env_name_ok(&key) {
                tracing::debug!(key = %key, "envFrom key is not a valid variable name; skipped");
                continue;
            }
            let Ok(value) = String::from_utf8(v.clone()) else {
                continue;
            };
            out.push(api::KeyValue { key, value });
        }
    }
    Ok(out)
}

fn container(
    pod: &Value,
    c: &Value,
    field: &str,
    volumes: &[VolumePlan],
    ctx: &PodContext,
    init: bool,
    pull_secrets: &[&Data],
) -> Result<ContainerPlan, PlanError> {
    let uid = s(pod, "/metadata/uid");
    for f in UNSUPPORTED_CONTAINER_FIELDS {
        if c.get(*f)
            .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
        {
            return Err(unsupported(format!("{field}.{f}"), "not supported by edgehub").into());
        }
    }
    let name = s(c, "/name").to_string();
    let image = s(c, "/image").to_string();
    if name.is_empty() || image.is_empty() {
        return Err(unsupported(field, "a container needs a name and an image").into());
    }
    // The name becomes its log file's name (`<name>_<attempt>.log` in the pod's log dir):
    // a DNS-1123 label, as the apiserver validates it, so it never leaves that directory.
    crate::names::check_label(&name)
        .map_err(|r| unsupported(format!("{field}.name"), format!("{name:?}: {r}")))?;
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
            )
            .into())
        }
    };
    // envFrom first, then env, so an explicit variable wins (as with the kubelet).
    let mut envs = env_from(c, field, ctx, &pod_ns(pod))?;
    for (i, e) in items(c, "env") {
        let f = format!("{field}.env[{i}]");
        if let Some(value) = env_value(pod, c, e, &f, ctx)? {
            let key = s(e, "/name").to_string();
            envs.retain(|kv| kv.key != key);
            envs.push(api::KeyValue { key, value });
        }
    }
    let mut mounts = Vec::new();
    for (i, m) in items(c, "volumeMounts") {
        let vname = s(m, "/name");
        let vol = volumes.iter().find(|v| v.name() == vname).ok_or_else(|| {
            unsupported(
                format!("{field}.volumeMounts[{i}]"),
                format!("no volume named {vname:?}"),
            )
        })?;
        if m.get("subPath").is_some() || m.get("subPathExpr").is_some() {
            return Err(unsupported(
                format!("{field}.volumeMounts[{i}].subPath"),
                "not supported yet",
            )
            .into());
        }
        // File volumes are written by edgehub; containers only read them.
        let files = matches!(vol, VolumePlan::Files { .. });
        mounts.push(api::Mount {
            container_path: s(m, "/mountPath").to_string(),
            host_path: vol.host_path().display().to_string(),
            readonly: files || m.get("readOnly").and_then(Value::as_bool).unwrap_or(false),
            ..Default::default()
        });
    }
    let sc = c.get("securityContext");
    let caps = |k: &str| strings(sc.and_then(|s| s.pointer(&format!("/capabilities/{k}"))));
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
        command: strings(c.get("command")),
        args: strings(c.get("args")),
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
    let auth = sources::auth_for(&image, pull_secrets);
    // Init containers run to completion; probes on them are refused by the apiserver.
    let (liveness, readiness) = if init {
        (None, None)
    } else {
        (
            probe(c, "livenessProbe", field)?,
            probe(c, "readinessProbe", field)?,
        )
    };
    Ok(ContainerPlan {
        name,
        image,
        pull_policy,
        auth,
        liveness,
        readiness,
        config,
    })
}

/// A probe port: a number, or the name of one of the container's ports.
fn probe_port(c: &Value, v: Option<&Value>, field: &str) -> Result<u16, Unsupported> {
    let port = match v {
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(name)) => items(c, "ports")
            .find(|(_, p)| s(p, "/name") == name)
            .and_then(|(_, p)| p.get("containerPort").and_then(Value::as_u64)),
        _ => None,
    };
    port.filter(|p| (1..=65535).contains(p))
        .map(|p| p as u16)
        .ok_or_else(|| {
            unsupported(
                format!("{field}.port"),
                "not a port number or a named container port",
            )
        })
}

fn probe(c: &Value, key: &str, field: &str) -> Result<Option<ProbeSpec>, Unsupported> {
    let Some(p) = c.get(key).filter(|p| !p.is_null()) else {
        return Ok(None);
    };
    let field = format!("{field}.{key}");
    let secs = |k: &str, default: u64| {
        std::time::Duration::from_secs(p.get(k).and_then(Value::as_u64).unwrap_or(default))
    };
    let count = |k: &str, default: u64| {
        p.get(k)
            .and_then(Value::as_u64)
            .unwrap_or(default)
            .clamp(1, 1_000) as u32
    };
    let action = if let Some(e) = p.get("exec") {
        let cmd = strings(e.get("command"));
        if cmd.is_empty() {
            return Err(unsupported(
                format!("{field}.exec.command"),
                "must not be empty",
            ));
        }
        ProbeAction::Exec(cmd)
    } else if let Some(h) = p.get("httpGet") {
        let f = format!("{field}.httpGet");
        let https = match s(h, "/scheme") {
            "" | "HTTP" => false,
            "HTTPS" => true,
            other => {
                return Err(unsupported(
                    format!("{f}.scheme"),
                    format!("unknown scheme {other:?}"),
                ))
            }
        };
        let path = match s(h, "/path") {
            "" => "/".to_string(),
            p if p.starts_with('/') => p.to_string(),
            p => format!("/{p}"),
        };
        ProbeAction::HttpGet {
            https,
            host: Some(s(h, "/host").to_string()).filter(|h| !h.is_empty()),
            port: probe_port(c, h.get("port"), &f)?,
            path,
            headers: items(h, "httpHeaders")
                .map(|(_, kv)| (s(kv, "/name").to_string(), s(kv, "/value").to_string()))
                .filter(|(k, _)| !k.is_empty())
                .collect(),
        }
    } else if let Some(t) = p.get("tcpSocket") {
        let f = format!("{field}.tcpSocket");
        ProbeAction::TcpSocket {
            host: Some(s(t, "/host").to_string()).filter(|h| !h.is_empty()),
            port: probe_port(c, t.get("port"), &f)?,
        }
    } else {
        let kind = p
            .as_object()
            .and_then(|m| {
                m.keys()
                    .find(|k| !k.ends_with("Seconds") && !k.ends_with("Threshold"))
                    .cloned()
            })
            .unwrap_or_else(|| "handler".into());
        return Err(unsupported(
            format!("{field}.{kind}"),
            "only exec, httpGet and tcpSocket probes are supported",
        ));
    };
    Ok(Some(ProbeSpec {
        action,
        initial_delay: secs("initialDelaySeconds", 0),
        period: secs("periodSeconds", 10).max(std::time::Duration::from_secs(1)),
        timeout: secs("timeoutSeconds", 1).max(std::time::Duration::from_secs(1)),
        success_threshold: count("successThreshold", 1),
        failure_threshold: count("failureThreshold", 3),
    }))
}

/// What a probe does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeAction {
    Exec(Vec<String>),
    HttpGet {
        /// `scheme: HTTPS`. As with the kubelet, the certificate is not verified.
        https: bool,
        /// `None`: the pod's address.
        host: Option<String>,
        port: u16,
        path: String,
        headers: Vec<(String, String)>,
    },
    TcpSocket {
        host: Option<String>,
        port: u16,
    },
}

/// A probe as the pod spec defines it, with the API's defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSpec {
    pub action: ProbeAction,
    pub initial_delay: std::time::Duration,
    pub period: std::time::Duration,
    pub timeout: std::time::Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

#[cfg(test)]
mod tests;

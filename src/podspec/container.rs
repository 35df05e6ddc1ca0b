//! One container of the pod as a CRI ContainerConfig: image, command, mounts, env,
//! resources, security context and probes.

use super::env::{env_from, env_value};
use super::probe::probe;
use super::resources::resources;
use super::*;

pub(super) fn container(
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

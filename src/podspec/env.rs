//! A container's environment: `env` with its `valueFrom` references (ConfigMap and Secret
//! keys, the downward API, resource fields) and `envFrom`.

use super::*;

/// A `resourceFieldRef` value: the container's limit or request, divided (rounded up, as
/// the kubelet does). `c` is the referencing container; `containerName` may name another.
pub(super) fn resource_field(
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
pub(super) fn key_ref(
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
pub(super) fn env_value(
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
pub(super) fn env_name_ok(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// `envFrom`: every key of the referenced ConfigMaps and Secrets, with the prefix.
pub(super) fn env_from(
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

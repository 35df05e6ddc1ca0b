//! A pod's volumes as the runtime prepares them: hostPath and emptyDir checked, and the files
//! of configMap, secret, downwardAPI and projected volumes resolved from the cached sources.

use super::env::resource_field;
use super::*;

pub(super) fn volumes(
    pod: &Value,
    spec: &Value,
    ctx: &PodContext,
) -> Result<Vec<VolumePlan>, PlanError> {
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

/// A file mode from the API (decimal JSON number, such as 420 for 0644).
pub(super) fn file_mode(v: &Value, field: &str) -> Result<u32, Unsupported> {
    v.as_u64()
        .filter(|m| *m <= 0o777)
        .map(|m| m as u32)
        .ok_or_else(|| unsupported(field, format!("{v} is not a file mode (0 to 0777)")))
}

/// A volume item's path: relative, no `..` element, not empty, as the apiserver validates
/// it. Checked again here because the cache is not trusted to have been validated.
pub(super) fn checked_path(p: &str, field: &str) -> Result<String, Unsupported> {
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

/// The files of a `configMap` or `secret` volume (or projected source): every key, or the
/// listed `items`.
pub(super) fn object_files(
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
pub(super) fn kv_lines(m: Option<&serde_json::Map<String, Value>>) -> String {
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

pub(super) fn downward_files(
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

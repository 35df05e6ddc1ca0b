//! Object validation the apiserver does on create and update, for the objects whose rules a
//! client of the fake could break: a ConfigMap's name, data keys and size (the
//! attested-approval record of `edgehub controller` writes ConfigMaps). The messages are the
//! apiserver's validation texts (ValidateConfigMap, IsDNS1123Subdomain, IsConfigMapKey).

use super::*;

/// The most bytes a ConfigMap's data and binaryData may hold together (`MaxSecretSize`).
pub const MAX_CONFIGMAP_BYTES: usize = 1 << 20;

fn is_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

fn is_config_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 253
        && k != "."
        && k != ".."
        && !k.starts_with("..")
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// The 422 for a ConfigMap the apiserver would refuse, if it would.
pub(super) fn configmap(obj: &Value) -> Option<Response<Body>> {
    let name = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let mut causes: Vec<(String, String)> = Vec::new();
    if !is_subdomain(name) {
        causes.push(("metadata.name".into(), format!(
            "Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )));
    }
    let mut size = 0;
    for field in ["data", "binaryData"] {
        for (k, v) in obj
            .get(field)
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            if !is_config_key(k) {
                causes.push((format!("{field}[{k}]"), format!(
                    "Invalid value: \"{k}\": a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"
                )));
            }
            size += v.as_str().map_or(0, str::len);
        }
    }
    if size > MAX_CONFIGMAP_BYTES {
        causes.push((
            "[]".into(),
            format!("Too long: may not be more than {MAX_CONFIGMAP_BYTES} bytes"),
        ));
    }
    if causes.is_empty() {
        return None;
    }
    let text: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
    let details: Vec<Value> = causes
        .iter()
        .map(|(f, m)| json!({"reason": "FieldValueInvalid", "message": m, "field": f}))
        .collect();
    Some(status(
        422,
        "Invalid",
        &format!("ConfigMap \"{name}\" is invalid: {}", text.join(", ")),
        Some(json!({"name": name, "kind": "ConfigMap", "causes": details})),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_configmap_may_be() {
        let ok = json!({"metadata": {"name": "edgehub-attest-edge-1"},
            "data": {"sha256-00ff": "{}", "a.b_C-9": ""}});
        assert!(configmap(&ok).is_none());
        for bad in [
            json!({"metadata": {"name": "Edge_1"}}),
            json!({"metadata": {"name": "x"}, "data": {"a/b": ""}}),
            json!({"metadata": {"name": "x"}, "data": {"..a": ""}}),
            json!({"metadata": {"name": "x"}, "data": {"a": "x".repeat(MAX_CONFIGMAP_BYTES + 1)}}),
            json!({"metadata": {"name": "a".repeat(254)}}),
        ] {
            assert!(configmap(&bad).is_some(), "{bad}");
        }
    }
}

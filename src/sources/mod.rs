//! What a pod needs from the API besides itself: the ConfigMaps and Secrets its volumes, env
//! and image pulls reference, and its projected service-account tokens.
//!
//! This module is pure: [`references`] lists what a pod needs, and [`Sources`] is the resolved
//! set that [`crate::podspec::translate`] reads. [`fetch`] fills the cache from the apiserver
//! while the link is up, so that pods start from the cache when it is down.

pub mod fetch;

use base64::Engine;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

/// The kubelet's default projected-token lifetime when a pod names none.
pub const DEFAULT_TOKEN_SECS: i64 = 3600;
/// The apiserver refuses shorter token lifetimes.
pub const MIN_TOKEN_SECS: i64 = 600;

/// One thing a pod references.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SourceRef {
    ConfigMap {
        name: String,
    },
    Secret {
        name: String,
    },
    Token {
        service_account: String,
        audience: String,
        expiration_secs: i64,
    },
}

impl SourceRef {
    /// The store's kind for ConfigMaps and Secrets.
    pub fn kind(&self) -> &'static str {
        match self {
            SourceRef::ConfigMap { .. } => "configmaps",
            SourceRef::Secret { .. } => "secrets",
            SourceRef::Token { .. } => "token",
        }
    }
}

fn s<'a>(v: &'a Value, p: &str) -> &'a str {
    v.pointer(p).and_then(Value::as_str).unwrap_or("")
}

fn arr<'a>(v: &'a Value, p: &str) -> impl Iterator<Item = &'a Value> {
    v.pointer(p).and_then(Value::as_array).into_iter().flatten()
}

/// The pod's service account (`default` when unset, as the apiserver defaults it).
pub fn service_account(pod: &Value) -> String {
    match s(pod, "/spec/serviceAccountName") {
        "" => "default".into(),
        sa => sa.into(),
    }
}

/// A projected token source's (audience, expirationSeconds); empty audience means the
/// apiserver's default.
pub fn token_params(src: &Value) -> (String, i64) {
    let exp = src
        .get("expirationSeconds")
        .and_then(Value::as_i64)
        .unwrap_or(DEFAULT_TOKEN_SECS)
        .max(MIN_TOKEN_SECS);
    (s(src, "/audience").to_string(), exp)
}

/// Everything the pod references, sorted and without repeats. Pure, so what edgehub asks
/// the apiserver for is unit-tested against the recorded pods.
pub fn references(pod: &Value) -> Vec<SourceRef> {
    let mut out = Vec::new();
    let cm = |n: &str| SourceRef::ConfigMap { name: n.into() };
    let sec = |n: &str| SourceRef::Secret { name: n.into() };
    for v in arr(pod, "/spec/volumes") {
        if let Some(n) = v.pointer("/configMap/name").and_then(Value::as_str) {
            out.push(cm(n));
        }
        if let Some(n) = v.pointer("/secret/secretName").and_then(Value::as_str) {
            out.push(sec(n));
        }
        for src in arr(v, "/projected/sources") {
            if let Some(n) = src.pointer("/configMap/name").and_then(Value::as_str) {
                out.push(cm(n));
            }
            if let Some(n) = src.pointer("/secret/name").and_then(Value::as_str) {
                out.push(sec(n));
            }
            if let Some(t) = src.get("serviceAccountToken") {
                let (audience, expiration_secs) = token_params(t);
                out.push(SourceRef::Token {
                    service_account: service_account(pod),
                    audience,
                    expiration_secs,
                });
            }
        }
    }
    for list in ["/spec/initContainers", "/spec/containers"] {
        for c in arr(pod, list) {
            for e in arr(c, "/env") {
                if let Some(n) = e
                    .pointer("/valueFrom/configMapKeyRef/name")
                    .and_then(Value::as_str)
                {
                    out.push(cm(n));
                }
                if let Some(n) = e
                    .pointer("/valueFrom/secretKeyRef/name")
                    .and_then(Value::as_str)
                {
                    out.push(sec(n));
                }
            }
            for e in arr(c, "/envFrom") {
                if let Some(n) = e.pointer("/configMapRef/name").and_then(Value::as_str) {
                    out.push(cm(n));
                }
                if let Some(n) = e.pointer("/secretRef/name").and_then(Value::as_str) {
                    out.push(sec(n));
                }
            }
        }
    }
    for p in arr(pod, "/spec/imagePullSecrets") {
        if let Some(n) = p.get("name").and_then(Value::as_str) {
            out.push(sec(n));
        }
    }
    out.retain(|r| match r {
        SourceRef::ConfigMap { name } | SourceRef::Secret { name } => !name.is_empty(),
        SourceRef::Token { .. } => true,
    });
    out.sort();
    out.dedup();
    out
}

/// A ConfigMap's or Secret's keys and bytes. `data` of a ConfigMap is text, `binaryData` and
/// a Secret's `data` are base64.
pub type Data = BTreeMap<String, Vec<u8>>;

/// Whether a referenced object is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<'a> {
    Found(&'a Data),
    /// The apiserver said it does not exist.
    NotFound,
    /// Never fetched: edgehub has not been online since the pod arrived, or was refused.
    Unknown,
}

/// The resolved sources of one pod, as [`crate::podspec::translate`] reads them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sources {
    /// `None`: the apiserver said it does not exist.
    pub configmaps: HashMap<String, Option<Data>>,
    pub secrets: HashMap<String, Option<Data>>,
    /// Tokens by (audience, expirationSeconds).
    pub tokens: HashMap<(String, i64), String>,
}

impl Sources {
    pub fn configmap(&self, name: &str) -> Lookup<'_> {
        lookup(&self.configmaps, name)
    }

    pub fn secret(&self, name: &str) -> Lookup<'_> {
        lookup(&self.secrets, name)
    }

    pub fn token(&self, audience: &str, expiration_secs: i64) -> Option<&str> {
        self.tokens
            .get(&(audience.to_string(), expiration_secs))
            .map(String::as_str)
    }
}

fn lookup<'a>(m: &'a HashMap<String, Option<Data>>, name: &str) -> Lookup<'a> {
    match m.get(name) {
        Some(Some(d)) => Lookup::Found(d),
        Some(None) => Lookup::NotFound,
        None => Lookup::Unknown,
    }
}

/// Why a ConfigMap or Secret object could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(pub String);

/// The keys of a ConfigMap (`data` and `binaryData`) or Secret (`data`).
pub fn decode_data(kind: &str, raw: &str) -> Result<Data, DecodeError> {
    let v: Value = serde_json::from_str(raw).map_err(|e| DecodeError(format!("not JSON: {e}")))?;
    let mut out = Data::new();
    let b64 = base64::engine::general_purpose::STANDARD;
    let text_key = if kind == "secrets" {
        None
    } else {
        Some("data")
    };
    let binary_key = if kind == "secrets" {
        "data"
    } else {
        "binaryData"
    };
    if let Some(k) = text_key {
        for (key, val) in v.get(k).and_then(Value::as_object).into_iter().flatten() {
            let text = val
                .as_str()
                .ok_or_else(|| DecodeError(format!("{k}.{key} is not a string")))?;
            out.insert(key.clone(), text.as_bytes().to_vec());
        }
    }
    for (key, val) in v
        .get(binary_key)
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        let bytes = val
            .as_str()
            .and_then(|t| b64.decode(t).ok())
            .ok_or_else(|| DecodeError(format!("{binary_key}.{key} is not base64")))?;
        out.insert(key.clone(), bytes);
    }
    Ok(out)
}

/// Registry credentials for one image from `kubernetes.io/dockerconfigjson` (or legacy
/// `.dockercfg`) Secrets, in the order the pod lists them. The first Secret with an entry for
/// the image's registry wins, as with the kubelet's keyring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
    pub server: String,
}

/// The registry host of an image reference (`docker.io` when it names none).
pub fn registry_of(image: &str) -> &str {
    match image.split_once('/') {
        Some((first, _)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            first
        }
        _ => "docker.io",
    }
}

fn normalize_registry(key: &str) -> &str {
    let k = key
        .trim_start_matches("https://")
        .trim_start_matches("http://");
    let k = k.split('/').next().unwrap_or(k);
    match k {
        "index.docker.io" | "registry-1.docker.io" => "docker.io",
        other => other,
    }
}

/// Credentials for `image` from the pull secrets' data, if any names its registry.
pub fn auth_for(image: &str, secrets: &[&Data]) -> Option<RegistryAuth> {
    let want = registry_of(image);
    for data in secrets {
        let auths = if let Some(j) = data.get(".dockerconfigjson") {
            serde_json::from_slice::<Value>(j)
                .ok()
                .and_then(|v| v.get("auths").cloned())
        } else {
            data.get(".dockercfg")
                .and_then(|j| serde_json::from_slice::<Value>(j).ok())
        };
        let Some(Value::Object(auths)) = auths else {
            continue;
        };
        for (key, entry) in &auths {
            if normalize_registry(key) != want {
                continue;
            }
            let (mut user, mut pass) = (
                s(entry, "/username").to_string(),
                s(entry, "/password").to_string(),
            );
            if user.is_empty() {
                if let Some((u, p)) = base64::engine::general_purpose::STANDARD
                    .decode(s(entry, "/auth"))
                    .ok()
                    .and_then(|b| String::from_utf8(b).ok())
                    .and_then(|t| {
                        t.split_once(':')
                            .map(|(u, p)| (u.to_string(), p.to_string()))
                    })
                {
                    user = u;
                    pass = p;
                }
            }
            if !user.is_empty() {
                return Some(RegistryAuth {
                    username: user,
                    password: pass,
                    server: want.to_string(),
                });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests;

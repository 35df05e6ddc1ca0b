//! Liveness and readiness probes as the pod spec defines them, with the API's defaults filled
//! in; the runtime runs them (`pod::probes`).

use super::*;

/// A probe port: a number, or the name of one of the container's ports.
pub(super) fn probe_port(c: &Value, v: Option<&Value>, field: &str) -> Result<u16, Unsupported> {
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

pub(super) fn probe(c: &Value, key: &str, field: &str) -> Result<Option<ProbeSpec>, Unsupported> {
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

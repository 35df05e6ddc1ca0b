//! Reads a kubeconfig: the current context's server, CA, and credentials.
//!
//! Only what a device needs is supported: a bearer token (inline or file), a client
//! certificate and key (file or inline data), and a CA (file or data). Exec plugins, auth
//! providers and `insecure-skip-tls-verify` are refused with a clear error: a device must not
//! run arbitrary commands to log in, nor trust an unverified server.

use base64::Engine;
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error("kubeconfig {path} not found; set `kubeconfig` in the config file, EDGEHUB_KUBECONFIG, or --kubeconfig (deploy/kubeconfig.template.yaml shows the shape)")]
    Missing { path: PathBuf },
    #[error("kubeconfig {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kubeconfig {path}: not a valid kubeconfig: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("kubeconfig {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

/// What the client needs from a kubeconfig.
#[derive(Clone)]
pub struct Kubeconfig {
    /// `https://host:port`, without a trailing slash.
    pub server: String,
    /// PEM bundle of the CAs that may sign the server's certificate.
    pub ca_pem: Vec<u8>,
    /// Overrides the name checked in the server's certificate.
    pub tls_server_name: Option<String>,
    pub token: Option<TokenSource>,
    /// PEM certificate chain and PEM private key.
    pub client_cert: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Kubeconfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print credentials.
        f.debug_struct("Kubeconfig")
            .field("server", &self.server)
            .field("tls_server_name", &self.tls_server_name)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field(
                "client_cert",
                &self.client_cert.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// A bearer token, inline or re-read from a file on every request, since projected and
/// bootstrap tokens rotate.
#[derive(Clone)]
pub enum TokenSource {
    Inline(String),
    File(PathBuf),
}

#[derive(Deserialize)]
struct File {
    #[serde(rename = "current-context", default)]
    current_context: Option<String>,
    #[serde(default)]
    clusters: Vec<Named<Cluster>>,
    #[serde(default)]
    contexts: Vec<Named<Context>>,
    #[serde(default)]
    users: Vec<Named<User>>,
}

#[derive(Deserialize)]
struct Named<T> {
    name: String,
    #[serde(alias = "cluster", alias = "context", alias = "user")]
    value: Option<T>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
struct Cluster {
    server: Option<String>,
    certificate_authority: Option<PathBuf>,
    certificate_authority_data: Option<String>,
    #[serde(default)]
    insecure_skip_tls_verify: bool,
    tls_server_name: Option<String>,
    proxy_url: Option<String>,
}

#[derive(Deserialize)]
struct Context {
    cluster: String,
    user: String,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
struct User {
    token: Option<String>,
    #[serde(rename = "tokenFile")]
    token_file: Option<PathBuf>,
    client_certificate: Option<PathBuf>,
    client_certificate_data: Option<String>,
    client_key: Option<PathBuf>,
    client_key_data: Option<String>,
    exec: Option<serde_yaml_ng::Value>,
    auth_provider: Option<serde_yaml_ng::Value>,
    username: Option<String>,
}

/// System CA bundle used only when the kubeconfig names no CA.
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Largest kubeconfig, and largest file it names (a CA bundle, a certificate, a key), read.
/// Debian's whole system CA bundle is about 220 KB; a path that names `/dev/zero` or a
/// growing log must not take the agent's memory.
pub const MAX_FILE: u64 = 4 << 20;

/// Reads at most [`MAX_FILE`] bytes of `path`; a longer file is an error naming the limit.
pub fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_FILE + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > MAX_FILE {
        return Err(std::io::Error::other(format!(
            "larger than {} MiB, too large for a kubeconfig or a file it names",
            MAX_FILE >> 20
        )));
    }
    Ok(out)
}

impl Kubeconfig {
    pub fn load(path: &Path) -> Result<Kubeconfig, KubeconfigError> {
        let text = match read_bounded(path) {
            Ok(t) => String::from_utf8(t).map_err(|_| KubeconfigError::Parse {
                path: path.to_path_buf(),
                message: "not UTF-8 text".into(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(KubeconfigError::Missing {
                    path: path.to_path_buf(),
                })
            }
            Err(source) => {
                return Err(KubeconfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let base = path.parent().unwrap_or(Path::new("/"));
        Kubeconfig::parse(&text, path, base)
    }

    /// Parses kubeconfig text; relative file paths in it are relative to `base`.
    pub fn parse(text: &str, path: &Path, base: &Path) -> Result<Kubeconfig, KubeconfigError> {
        Kubeconfig::parse_reading(text, path, base, &read_bounded)
    }

    /// [`Kubeconfig::parse`], with `read` for the files the kubeconfig names (the fuzz target
    /// gives one that reads no file).
    pub fn parse_reading(
        text: &str,
        path: &Path,
        base: &Path,
        read: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
    ) -> Result<Kubeconfig, KubeconfigError> {
        let read_file = read;
        let invalid = |reason: String| KubeconfigError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let file: File = serde_yaml_ng::from_str(text).map_err(|e| KubeconfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let ctx_name = match (&file.current_context, file.contexts.len()) {
            (Some(c), _) if !c.is_empty() => c.clone(),
            (_, 1) => file.contexts[0].name.clone(),
            _ => return Err(invalid("no current-context is set".into())),
        };
        let ctx = find(&file.contexts, &ctx_name)
            .ok_or_else(|| invalid(format!("current-context {ctx_name:?} is not in contexts")))?;
        let cluster = find(&file.clusters, &ctx.cluster).ok_or_else(|| {
            invalid(format!(
                "context {ctx_name:?} names cluster {:?}, which is not in clusters",
                ctx.cluster
            ))
        })?;
        let default_user = User::default();
        let user = find(&file.users, &ctx.user).unwrap_or(&default_user);

        let server = cluster
            .server
            .as_deref()
            .ok_or_else(|| invalid(format!("cluster {:?} has no server", ctx.cluster)))?
            .trim_end_matches('/')
            .to_string();
        if !server.starts_with("https://") {
            return Err(invalid(format!(
                "server {server:?} must be an https:// URL; edgehub never talks to the apiserver in clear text"
            )));
        }
        if server.parse::<hyper::Uri>().is_err() {
            return Err(invalid(format!("server {server:?} is not a valid URL")));
        }
        if cluster.insecure_skip_tls_verify {
            return Err(invalid(
                "insecure-skip-tls-verify is not supported: edgehub always verifies the apiserver; give certificate-authority or certificate-authority-data".into(),
            ));
        }
        if cluster.proxy_url.is_some() {
            return Err(invalid("proxy-url is not supported".into()));
        }
        if user.exec.is_some() || user.auth_provider.is_some() {
            return Err(invalid(format!(
                "user {:?} uses an exec plugin or auth provider, which edgehub does not run; use a client certificate or a token",
                ctx.user
            )));
        }
        if user.username.is_some() {
            return Err(invalid(
                "basic auth (username/password) is not supported".into(),
            ));
        }

        let read = |p: &Path| -> Result<Vec<u8>, KubeconfigError> {
            let full = if p.is_absolute() {
                p.to_path_buf()
            } else {
                base.join(p)
            };
            read_file(&full).map_err(|source| KubeconfigError::Read { path: full, source })
        };
        let b64 = |field: &str, data: &str| -> Result<Vec<u8>, KubeconfigError> {
            base64::engine::general_purpose::STANDARD
                .decode(data.trim())
                .map_err(|e| invalid(format!("{field} is not valid base64: {e}")))
        };

        let ca_pem = match (&cluster.certificate_authority_data, &cluster.certificate_authority) {
            (Some(d), _) => b64("certificate-authority-data", d)?,
            (None, Some(p)) => read(p)?,
            (None, None) => read_file(Path::new(SYSTEM_CA_BUNDLE)).map_err(|_| {
                invalid("the cluster has no certificate-authority(-data) and there is no system CA bundle".into())
            })?,
        };
        let token = match (&user.token, &user.token_file) {
            (Some(t), _) if !t.trim().is_empty() => Some(TokenSource::Inline(t.trim().to_string())),
            (_, Some(p)) => Some(TokenSource::File(if p.is_absolute() {
                p.clone()
            } else {
                base.join(p)
            })),
            _ => None,
        };
        let cert = match (&user.client_certificate_data, &user.client_certificate) {
            (Some(d), _) => Some(b64("client-certificate-data", d)?),
            (None, Some(p)) => Some(read(p)?),
            _ => None,
        };
        let key = match (&user.client_key_data, &user.client_key) {
            (Some(d), _) => Some(b64("client-key-data", d)?),
            (None, Some(p)) => Some(read(p)?),
            _ => None,
        };
        let client_cert = match (cert, key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "a client certificate needs both certificate and key".into(),
                ))
            }
        };
        if token.is_none() && client_cert.is_none() {
            return Err(invalid(format!(
                "user {:?} has no credentials (token, tokenFile, or client certificate and key)",
                ctx.user
            )));
        }
        Ok(Kubeconfig {
            server,
            ca_pem,
            tls_server_name: cluster.tls_server_name.clone(),
            token,
            client_cert,
        })
    }
}

fn find<'a, T>(list: &'a [Named<T>], name: &str) -> Option<&'a T> {
    list.iter()
        .find(|n| n.name == name)
        .and_then(|n| n.value.as_ref())
}

impl TokenSource {
    /// The current token. A token file is read on every call: it is tiny, and rotation must be
    /// picked up without a restart.
    pub fn read(&self) -> std::io::Result<String> {
        match self {
            TokenSource::Inline(t) => Ok(t.clone()),
            TokenSource::File(p) => Ok(std::fs::read_to_string(p)?.trim().to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CA: &str = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg=="; // "-----BEGIN CERTIFICATE-----\n"

    fn parse(text: &str) -> Result<Kubeconfig, KubeconfigError> {
        Kubeconfig::parse(
            text,
            Path::new("/etc/edgehub/kubeconfig"),
            Path::new("/etc/edgehub"),
        )
    }

    fn kc(cluster_extra: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: edge\nclusters:\n- name: c\n  cluster:\n    server: https://10.0.0.1:6443/\n{cluster_extra}contexts:\n- name: edge\n  context:\n    cluster: c\n    user: u\nusers:\n- name: u\n  user:\n{user}"
        )
    }

    #[test]
    fn token_and_ca_data() {
        let k = parse(&kc(
            &format!("    certificate-authority-data: {CA}\n"),
            "    token: abc\n",
        ))
        .unwrap();
        assert_eq!(k.server, "https://10.0.0.1:6443");
        assert_eq!(k.ca_pem, b"-----BEGIN CERTIFICATE-----\n");
        assert!(matches!(k.token, Some(TokenSource::Inline(ref t)) if t == "abc"));
        assert!(k.client_cert.is_none());
        assert!(
            !format!("{k:?}").contains("abc"),
            "Debug must not leak the token"
        );
    }

    #[test]
    fn relative_token_file_is_resolved_against_the_kubeconfig() {
        let k = parse(&kc(
            &format!("    certificate-authority-data: {CA}\n"),
            "    tokenFile: token\n",
        ))
        .unwrap();
        assert!(
            matches!(k.token, Some(TokenSource::File(ref p)) if p == Path::new("/etc/edgehub/token"))
        );
    }

    #[test]
    fn refusals_are_clear() {
        let ca = format!("    certificate-authority-data: {CA}\n");
        let cases = [
            (
                kc("    insecure-skip-tls-verify: true\n", "    token: a\n"),
                "insecure-skip-tls-verify",
            ),
            (kc(&ca, "    exec:\n      command: aws\n"), "exec plugin"),
            (kc(&ca, "    username: a\n"), "basic auth"),
            (
                kc(&ca, "    client-certificate-data: YQ==\n"),
                "both certificate and key",
            ),
            (kc(&ca, "    {}\n"), "no credentials"),
            (
                kc(&ca, "    token: a\n").replace("https://10.0.0.1:6443/", "http://10.0.0.1:8080"),
                "https://",
            ),
            (
                kc(&ca, "    token: a\n").replace("current-context: edge", "current-context: nope"),
                "not in contexts",
            ),
            ("clusters: [".to_string(), "not a valid kubeconfig"),
        ];
        for (text, want) in cases {
            let e = parse(&text).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains(want), "want {want:?} in: {e}\n---\n{text}");
        }
    }

    #[test]
    fn bad_base64_is_named() {
        let e = parse(&kc(
            "    certificate-authority-data: '%%%'\n",
            "    token: a\n",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("certificate-authority-data is not valid base64"),
            "{e}"
        );
    }

    /// A kubeconfig naming a file that never ends (`/dev/zero`) read it until memory ran
    /// out; now the read stops at the limit and says so.
    #[test]
    fn a_named_file_is_read_to_a_limit() {
        let e = parse(&kc(
            "    certificate-authority: /dev/zero\n",
            "    token: a\n",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("larger than 4 MiB"),
            "{e}"
        );
        let e = Kubeconfig::load(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than 4 MiB"), "{e}");
    }

    #[test]
    fn missing_file_is_clear() {
        let e = Kubeconfig::load(Path::new("/nonexistent/edgehub/kubeconfig")).unwrap_err();
        assert!(matches!(e, KubeconfigError::Missing { .. }));
        assert!(e.to_string().contains("EDGEHUB_KUBECONFIG"));
    }
}

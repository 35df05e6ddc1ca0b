//! Configuration: defaults, then the TOML file, then `EDGEHUB_*` environment variables, then
//! command-line flags, each layer overriding the one before.
//!
//! Each section's type is defined by the module that reads it (`sync::SyncConfig`,
//! `api::ApiConfig`, `node::NodeConfig`, `upgrade::UpgradeConfig`, `outbox::ReportConfig`,
//! `logs::LogsConfig`); this module only reads the file and composes them, so it sits above
//! them all and none of them imports it.
//!
//! [`Config::resolve`] is pure (it takes the file's text, the environment and the flags as
//! values) so every rule is unit-tested; [`Config::load`] does the I/O around it.

pub use crate::api::ApiConfig;
pub use crate::identity::IdentityConfig;
pub use crate::logs::LogsConfig;
pub use crate::node::{NodeConfig, Taint};
pub use crate::outbox::ReportConfig;
pub use crate::store::seal::SealConfig;
pub use crate::sync::SyncConfig;
pub use checks::{check_log_filter, check_node_label, log_filter};

mod checks;
mod file;
mod sections;
#[cfg(test)]
mod tests;

use crate::kube::{ApiClient, ClientOptions, ClientSetupError, Kubeconfig};
use file::FileConfig;
use sections::absolute;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/edgehub/config.toml";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/edgehub";
pub const DEFAULT_KUBECONFIG: &str = "/etc/edgehub/kubeconfig";
pub const DEFAULT_API_ADDR: &str = "127.0.0.1:10267";
pub const DEFAULT_CRI_SOCKET: &str = "/run/containerd/containerd.sock";

/// The validated configuration the program runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub node_name: String,
    pub data_dir: PathBuf,
    pub kubeconfig: PathBuf,
    /// The local API's TCP address; `None` (`api_addr = "none"`) when it listens on the unix
    /// socket alone.
    pub api_addr: Option<SocketAddr>,
    pub cri_socket: PathBuf,
    /// A `tracing` filter, e.g. `info` or `edgehub::sync=debug`.
    pub log: String,
    pub sync: SyncConfig,
    pub api: ApiConfig,
    pub node: NodeConfig,
    pub upgrade: crate::upgrade::UpgradeConfig,
    pub report: ReportConfig,
    pub logs: LogsConfig,
    pub seal: SealConfig,
    pub images: crate::images::ImagesConfig,
    pub identity: IdentityConfig,
    /// `[node] node_api_*`: the node's API on port 10250 (off unless `node_api_addr` is set).
    pub node_api: crate::kubelet_api::KubeletApiConfig,
}

impl Config {
    pub fn db_path(&self) -> PathBuf {
        self.data_dir.join("edgehub.db")
    }

    /// The apiserver client's limits, from the sync section.
    pub fn client_options(&self) -> ClientOptions {
        ClientOptions {
            timeout: self.sync.request_timeout,
            watch_idle_timeout: self.sync.watch_idle_timeout,
            max_body: self.sync.max_event_bytes,
            node_name: self.node_name.clone(),
        }
    }

    /// Reads the kubeconfig this names and builds an apiserver client with the sync section's
    /// limits. Here rather than in `kube`, so the client knows nothing of the config file.
    pub fn api_client(&self) -> Result<ApiClient, ClientSetupError> {
        let kc = Kubeconfig::load(&self.kubeconfig)?;
        ApiClient::new(&kc, self.client_options()).map_err(|source| ClientSetupError::Tls {
            path: self.kubeconfig.clone(),
            source,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    #[error("config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
}

fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// Values given on the command line; `None` means not given.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub node_name: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub api_addr: Option<String>,
    pub cri_socket: Option<PathBuf>,
    pub log: Option<String>,
}

/// Where the config file comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// The default path: a missing file just means "all defaults".
    Default,
    /// Named by the user: it must exist.
    Explicit(PathBuf),
}

impl Config {
    /// Reads the file (if any), the process environment and the hostname, then resolves.
    pub fn load(source: &Source, flags: &Overrides) -> Result<Config, ConfigError> {
        let (path, required) = match source {
            Source::Default => (Path::new(DEFAULT_CONFIG_PATH), false),
            Source::Explicit(p) => (p.as_path(), true),
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => None,
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with("EDGEHUB_"))
            .collect();
        Config::resolve_reading(text.as_deref(), path, &env, flags, hostname(), &|p| {
            std::fs::read_to_string(p)
        })
    }

    /// The pure layering and validation. A file the config names for its content
    /// (`[identity] node_name_file`) cannot be read here: use [`Config::resolve_reading`].
    pub fn resolve(
        file_text: Option<&str>,
        file_path: &Path,
        env: &[(String, String)],
        flags: &Overrides,
        hostname: Option<String>,
    ) -> Result<Config, ConfigError> {
        Config::resolve_reading(file_text, file_path, env, flags, hostname, &|p| {
            Err(std::io::Error::other(format!(
                "{} is not read by Config::resolve",
                p.display()
            )))
        })
    }

    /// [`Config::resolve`], with `read` for the files whose content is a setting.
    pub fn resolve_reading(
        file_text: Option<&str>,
        file_path: &Path,
        env: &[(String, String)],
        flags: &Overrides,
        hostname: Option<String>,
        read: &dyn Fn(&Path) -> std::io::Result<String>,
    ) -> Result<Config, ConfigError> {
        let file: FileConfig = match file_text {
            Some(t) => toml::from_str(t).map_err(|e| ConfigError::Parse {
                path: file_path.to_path_buf(),
                message: e.to_string().trim_end().to_string(),
            })?,
            None => FileConfig::default(),
        };
        let env_get = |name: &str| {
            env.iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        // flag > env > file > default
        let pick = |flag: Option<String>, env_name: &str, file: Option<String>| {
            flag.or_else(|| env_get(env_name)).or(file)
        };
        let pick_path = |flag: &Option<PathBuf>, env_name: &str, file: Option<PathBuf>| {
            flag.clone()
                .or_else(|| env_get(env_name).map(PathBuf::from))
                .or(file)
        };

        let node_name = pick(flags.node_name.clone(), "EDGEHUB_NODE_NAME", file.node_name);
        // flag > env > file > the firmware's file (a VIN, a serial) > the hostname
        let node_name = match (node_name, &file.identity.node_name_file) {
            (None, Some(p)) => {
                absolute("identity.node_name_file", p)?;
                let text = read(p).map_err(|e| {
                    invalid("identity.node_name_file", format!("{}: {e}", p.display()))
                })?;
                let n = text.trim().to_ascii_lowercase();
                crate::names::check_subdomain(&n).map_err(|r| {
                    invalid(
                        "identity.node_name_file",
                        format!("{}: {n:?} is not a valid node name ({r})", p.display()),
                    )
                })?;
                Some(n)
            }
            (n, _) => n,
        };
        let node_name = match node_name {
            Some(n) => {
                crate::names::check_subdomain(&n).map_err(|r| invalid("node_name", r))?;
                n
            }
            None => {
                let h = hostname.ok_or_else(|| {
                    invalid("node_name", "not set and the hostname could not be read")
                })?;
                let h = h.trim().to_string();
                crate::names::check_subdomain(&h).map_err(|r| {
                    invalid(
                        "node_name",
                        format!("not set, and the hostname {h:?} is not a valid node name ({r}); set node_name"),
                    )
                })?;
                h
            }
        };

        let data_dir = pick_path(&flags.data_dir, "EDGEHUB_DATA_DIR", file.data_dir)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
        absolute("data_dir", &data_dir)?;
        let kubeconfig = pick_path(&flags.kubeconfig, "EDGEHUB_KUBECONFIG", file.kubeconfig)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_KUBECONFIG));
        if kubeconfig.as_os_str().is_empty() {
            return Err(invalid("kubeconfig", "must not be empty"));
        }
        let api_addr_s = pick(flags.api_addr.clone(), "EDGEHUB_API_ADDR", file.api_addr)
            .unwrap_or_else(|| DEFAULT_API_ADDR.to_string());
        // "none": no TCP listener, the unix socket alone (checked below, once the socket is
        // known). While TCP is bound, any local process and any web page's browser can reach
        // the API there, whatever the socket's mode and group say.
        let api_addr: Option<SocketAddr> = if api_addr_s == "none" {
            None
        } else {
            Some(api_addr_s.parse().map_err(|_| {
                invalid(
                    "api_addr",
                    format!(
                        "{api_addr_s:?} is not an IP:port address (e.g. 127.0.0.1:10267) or \"none\""
                    ),
                )
            })?)
        };
        let cri_socket = pick_path(&flags.cri_socket, "EDGEHUB_CRI_SOCKET", file.cri_socket)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CRI_SOCKET));
        absolute("cri_socket", &cri_socket)?;
        let log = pick(flags.log.clone(), "EDGEHUB_LOG", file.log).unwrap_or_else(|| "info".into());
        check_log_filter(&log).map_err(|r| invalid("log", r))?;

        let sync = sections::sync(file.sync)?;
        let api = sections::api(file.api, api_addr.is_none())?;
        let node_api = sections::node_api(&file.node)?;
        let node = sections::node(file.node)?;
        let upgrade = sections::upgrade(file.upgrade)?;
        let report = sections::report(file.report)?;
        let logs = sections::logs(file.logs)?;
        let seal = sections::seal(file.seal)?;
        let images = sections::images(file.images, &data_dir)?;
        let identity = sections::identity(file.identity)?;
        Ok(Config {
            node_name,
            data_dir,
            kubeconfig,
            api_addr,
            cri_socket,
            log,
            sync,
            api,
            node,
            upgrade,
            report,
            logs,
            seal,
            images,
            identity,
            node_api,
        })
    }
}

/// The kernel's hostname; `None` if it cannot be read.
fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

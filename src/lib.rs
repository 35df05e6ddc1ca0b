//! edgehub: the on-device agent that keeps a node's DaemonSet pods upgradable with or without a
//! link to the cloud.
//!
//! The crate is a library with a thin binary on top (`src/main.rs`). Data flows one way:
//! apiserver → [`sync`] → [`store`] → the rest. Each module has one job:
//!
//! - [`api`]: the local HTTP API (OpenYurt's OTA routes, status, health, metrics);
//! - [`cache`]: read-side views combining cached objects (a pod's DaemonSet and revisions);
//! - [`config`]: file + env + flags → a validated [`config::Config`];
//! - [`store`]: the SQLite cache, the only module that writes SQL;
//! - [`kube`]: a small apiserver client (kubeconfig, rustls, typed requests, watch streams);
//! - [`sync`]: reflectors that list/watch the apiserver into the store, and link health;
//! - [`object`]: the few fields of a Kubernetes object the cache indexes;
//! - [`revision`]: pure decisions: update revision, `PodNeedUpgrade`, in place or recreate;
//! - [`names`]: DNS-1123 name rules.

pub mod api;
pub mod cache;
pub mod client;
pub mod config;
pub mod cri;
pub mod kube;
pub mod names;
pub mod node;
pub mod notify;
pub mod object;
pub mod podspec;
pub mod probe;
pub mod revision;
pub mod runtime;
pub mod sources;
pub mod store;
pub mod sync;
pub mod time;
pub mod volumes;

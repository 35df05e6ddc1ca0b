//! edgehub: the on-device agent that keeps a node's DaemonSet pods upgradable with or without a
//! link to the cloud.
//!
//! The crate is a library with a thin binary on top (`src/main.rs`). Data flows one way:
//! apiserver → [`sync`] → [`store`] → the rest. Each module has one job:
//!
//! - [`api`]: the local HTTP API (OpenYurt's OTA routes, status, health, metrics);
//! - [`need_upgrade`]: gathers a pod's DaemonSet and revisions from the store for `PodNeedUpgrade`;
//! - [`local_client`]: the CLI's client of the local API (not the apiserver client, that is [`kube`]);
//! - [`config`]: file + env + flags → a validated [`config::Config`];
//! - [`store`]: the SQLite cache, the only module that writes SQL;
//! - [`kube`]: a small apiserver client (kubeconfig, rustls, typed requests, watch streams);
//! - [`identity`]: TLS bootstrap and rotation of the node's client certificate;
//! - [`sync`]: reflectors that list/watch the apiserver into the store, and link health;
//! - [`object`]: the few fields of a Kubernetes object the cache indexes;
//! - [`revision`]: pure decisions: update revision, `PodNeedUpgrade`, in place or recreate;
//! - [`names`]: DNS-1123 name rules;
//! - [`attest`]: device attestation for a first node certificate (factory key and fleet CA);
//! - [`controller`]: the cloud-side `edgehub controller` (kube-rs, feature `controller`).

pub mod api;
pub mod attest;
pub mod backoff;
pub mod config;
pub mod containerd;
/// The cloud-side `edgehub controller`: its pure decision is always built (and tested); its
/// kube-rs I/O only with feature `controller`.
pub mod controller;
pub mod cri;
pub mod failpoint;
pub mod identity;
pub mod images;
pub mod kube;
pub mod kubelet_api;
pub mod link;
pub mod local_client;
pub mod logs;
pub mod mountns;
pub mod names;
pub mod need_upgrade;
pub mod node;
pub mod notify;
pub mod object;
pub mod outbox;
pub mod pod;
pub mod podspec;
pub mod revision;
pub mod runtime;
pub mod sources;
pub mod store;
pub mod sync;
pub mod time;
pub mod upgrade;
pub mod volumes;

//! A small kube-apiserver client: just the requests edgehub makes, over rustls.
//!
//! kube-rs would add ≈ 3.7 MB to the device binary (DESIGN.md §10), so this module does the
//! little edgehub needs by hand: typed GET/LIST/WATCH/PATCH/DELETE/POST, Status errors, and
//! watch streams decoded event by event. Objects come back as raw JSON strings because the
//! store keeps them exactly as sent.

mod client;
mod error;
pub mod kubeconfig;
pub mod resource;
mod retry;
mod stream;
pub mod tls;
mod verbs;
pub mod watch;

pub use client::{ApiClient, ClientOptions, ClientSetupError};
pub use error::{KubeError, Request, Status};
pub use kubeconfig::{Kubeconfig, KubeconfigError};
pub use resource::Resource;
pub use retry::delay_after;
pub use stream::WatchStream;
pub use verbs::{ListPage, ListParams, PatchType};
pub use watch::WatchEvent;

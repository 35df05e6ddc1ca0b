//! `edgehub controller`: the cloud-side half of DESIGN §8. It gives stock Kubernetes
//! OpenYurt's AdvancedRollingUpdate (a DaemonSet rollout that does not stall on NotReady edge
//! nodes) and OTA `PodNeedUpgrade` conditions for devices that do not run edgehub.
//!
//! The split:
//! - [`decide`]: the pure decision, (DaemonSet, revisions, pods, node readiness, now) → pods to
//!   delete or conditions to write;
//! - [`pending`]: deletions in flight until the watch shows them (expectations);
//! - [`election`]: the pure leader-election rules for the Lease;
//! - [`metrics`]: the `/metrics` text;
//! - `views`, `run`, `reconcile`, `lease` (feature `controller` only): kube-rs reflectors and
//!   the loop, one DaemonSet's reconcile and its Events, the Lease, the HTTP endpoint and
//!   shutdown;
//! - [`approve`] (feature `controller` only, opt-in): attested approval of a node's first
//!   certificate (its pure decision parses PKCS#10 with x509-parser, hence the feature).
//!
//! The pure parts are plain Rust over serde-free views and compile without the feature. kube-rs
//! and k8s-openapi are behind it, so the device binary does not carry them (DESIGN §10), while
//! the rules of the rollout are still unit-tested by every default `cargo test`. Unused, they
//! add nothing to the device binary.

pub mod decide;
pub mod election;
pub mod metrics;
pub mod pending;

#[cfg(feature = "controller")]
pub mod approve;

#[cfg(feature = "controller")]
mod lease;
#[cfg(feature = "controller")]
mod reconcile;
#[cfg(feature = "controller")]
mod run;
#[cfg(feature = "controller")]
pub mod views;

/// The component name on Events and in the Lease's holder identity.
#[cfg(feature = "controller")]
const COMPONENT: &str = "edgehub-controller";

#[cfg(feature = "controller")]
pub use lease::Timings;
#[cfg(feature = "controller")]
pub use run::{run, ControllerError, Options};

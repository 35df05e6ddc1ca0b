//! What the pod runtime and the upgrade engine both need to act on a pod, in one place with one
//! CRI observer, so the two cannot drift apart:
//!
//! - [`observe`]: the CRI snapshot (edgehub's sandboxes and containers, exit codes, image
//!   digests, sandbox addresses), read once per pass;
//! - [`desired`]: the cached pods translated for the CRI ([`desired::DesiredPod`]), the pod's
//!   directory and the context a translation needs;
//! - [`running`]: how a pod runs after an upgrade committed (the runtime map's row);
//! - [`locks`]: one owner per pod;
//! - [`probes`]: liveness and readiness probes, run against the snapshot;
//! - [`start`]: the CRI steps both take (start a container, stop and remove a pod);
//! - [`slots`]: how many pods' tasks work and pull at once;
//! - [`status`]: the pod status the kubelet would report, and the patch that carries it.
//!
//! It sits below both: it imports neither `runtime` nor `upgrade` (the layering check in
//! tests/layers.rs holds it to that).

pub mod desired;
pub mod locks;
pub mod observe;
pub mod probes;
pub mod running;
pub mod slots;
pub mod start;
pub mod status;

pub use locks::{Holder, PodLocks};

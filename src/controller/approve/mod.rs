//! Attested approval of a node's first certificate (issue 22 item 4): the controller approves
//! a bootstrap CSR for signer `kubernetes.io/kube-apiserver-client-kubelet` only when the
//! device proves, with its factory key, that it is the vehicle the node name belongs to
//! ([`crate::attest`]); otherwise it denies it with a reason. A stolen bootstrap token alone
//! then gets nothing (with the kubeadm-style auto-approve binding removed, see deploy/).
//!
//! The split: [`decide`] is pure ((CSR, fleet CA, now) → approve, deny or not ours); `watch`
//! is the I/O (one watch of the signer's CSRs, the fleet CA from a ConfigMap or Secret, the
//! `/approval` writes). An attestation is good for one bootstrap: before approving, the
//! controller records the CSR's key for the node in the cluster and denies a key recorded
//! for another CSR ([`replay`] decides, `replay_store` reads and writes the record).
//!
//! Not ours, left alone: CSRs already Approved, Denied or Failed; renewals (the requestor is
//! `system:node:<name>`: the built-in selfnodeclient approver's), and anything else not from
//! a bootstrap token (`system:bootstrap:<id>` or group `system:bootstrappers`).

mod csr_loop;
pub mod replay;
mod replay_store;
mod request;
pub mod serving;
mod serving_watch;
mod watch;

#[cfg(test)]
mod tests;

pub use request::NodeRequest;
pub(super) use serving_watch::run as run_serving;
pub(super) use watch::run;
pub use watch::{CaSource, CaSourceError};

use crate::attest::{self, FleetCa};

/// The signer whose CSRs are node client certificates.
pub const SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
/// A bootstrap token's user name prefix and group.
pub const BOOTSTRAP_USER_PREFIX: &str = "system:bootstrap:";
pub const BOOTSTRAPPERS: &str = "system:bootstrappers";
/// The reason on an approval this controller writes.
pub const APPROVED_REASON: &str = "AttestedDeviceApproved";

/// The facts of a CSR the decision reads.
#[derive(Debug, Clone, Copy)]
pub struct CsrView<'a> {
    pub signer: &'a str,
    pub username: &'a str,
    pub groups: &'a [String],
    pub usages: &'a [String],
    /// True when it has an Approved, Denied or Failed condition already.
    pub decided: bool,
    /// The value of [`attest::ANNOTATION`], if any.
    pub attestation: Option<&'a str>,
    /// `spec.request`: the PEM PKCS#10 request.
    pub request: &'a [u8],
}

/// What to do with a CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not this approver's to decide; why, for the log.
    Skip(&'static str),
    /// Approve, once the key is recorded as used ([`replay`]).
    Approve {
        node: String,
        /// The factory certificate's serial, for the condition's message and the log.
        serial: String,
        /// The CSR key's [`replay::key_fingerprint`].
        key: String,
    },
    Deny {
        reason: &'static str,
        message: String,
    },
}

impl Verdict {
    fn deny(reason: &'static str, message: impl Into<String>) -> Verdict {
        Verdict::Deny {
            reason,
            message: message.into(),
        }
    }

    /// The condition's message for an approval.
    pub fn approval_message(node: &str, serial: &str, key: &str) -> String {
        format!(
            "edgehub controller: the factory certificate (serial {serial}) chains to the fleet CA, names node {node} and signed this CSR's key ({key}), used for the first time"
        )
    }
}

/// Whether `csr` comes from a bootstrap token: the first certificate of a node.
pub fn is_bootstrap(username: &str, groups: &[String]) -> bool {
    username.starts_with(BOOTSTRAP_USER_PREFIX) || groups.iter().any(|g| g == BOOTSTRAPPERS)
}

/// The usages a node client certificate has: digital signature and client auth, plus key
/// encipherment for an RSA key (as the csrapproving controller accepts them), in any order,
/// each once.
pub fn usages_ok(usages: &[String], rsa: bool) -> bool {
    let mut u: Vec<&str> = usages.iter().map(String::as_str).collect();
    u.sort_unstable();
    let base = ["client auth", "digital signature"];
    let legacy = ["client auth", "digital signature", "key encipherment"];
    u == base || (rsa && u == legacy)
}

/// Whether a CSR is this approver's to decide (`Err`: why not): a pending CSR for the node
/// client signer from a bootstrap token. Cheap, and needs no fleet CA.
pub fn ours(csr: &CsrView<'_>) -> Result<(), &'static str> {
    if csr.signer != SIGNER {
        return Err("another signer");
    }
    if csr.decided {
        return Err("decided already");
    }
    if !is_bootstrap(csr.username, csr.groups) {
        return Err(if csr.username.starts_with("system:node:") {
            "a renewal by a node: selfnodeclient's"
        } else {
            "not from a bootstrap token"
        });
    }
    Ok(())
}

/// Decides a CSR at `now_unix_secs` against the fleet CA.
pub fn decide(csr: &CsrView<'_>, ca: &FleetCa, now_unix_secs: u64) -> Verdict {
    if let Err(why) = ours(csr) {
        return Verdict::Skip(why);
    }
    let req = match NodeRequest::parse(csr.request) {
        Ok(r) => r,
        Err(e) => return Verdict::deny("CSRMalformed", e.to_string()),
    };
    let node = match req.node_name() {
        Ok(n) => n,
        Err(e) => return Verdict::deny("NotANodeClientCSR", e),
    };
    if !usages_ok(csr.usages, req.rsa) {
        return Verdict::deny(
            "NotANodeClientCSR",
            format!(
                "usages {:?}: a node client certificate has exactly digital signature and client auth{}",
                csr.usages,
                if req.rsa { " (and key encipherment)" } else { "" }
            ),
        );
    }
    let Some(annotation) = csr.attestation else {
        return Verdict::deny(
            "AttestationMissing",
            format!(
                "no {} annotation: a first node certificate needs the device's factory attestation",
                attest::ANNOTATION
            ),
        );
    };
    match attest::verify(annotation, ca, &req.spki_der, node, now_unix_secs) {
        Ok(v) => Verdict::Approve {
            node: v.node_name,
            serial: v.serial,
            key: replay::key_fingerprint(&req.spki_der),
        },
        Err(d) => Verdict::deny(d.reason(), d.to_string()),
    }
}

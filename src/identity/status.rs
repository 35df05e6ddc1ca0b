//! Which credential the node uses, and which lapsed when: what the identity task knows, put
//! into one value ([`IdentityStatus`]) the status surfaces read (`/v1/status`, `edgehub
//! status`, `GET /v1/node`) over a `tokio::sync::watch` channel. [`compute`] is pure: the
//! task passes what it has seen, the status comes back.

use super::cert::CertTimes;
use serde::Serialize;

/// The credential the node client presents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum InUse {
    /// None yet: the first bootstrap round has not got a certificate.
    None,
    NodeCertificate,
}

/// Which credential lapsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Which {
    NodeCertificate,
    Bootstrap,
}

/// One lapsed credential: which, why, and since when (RFC 3339).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Lapse {
    pub credential: Which,
    pub reason: String,
    pub since: String,
}

/// The node certificate's window and subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertView {
    pub subject: Option<String>,
    pub not_before: String,
    pub not_after: String,
}

/// The bootstrap credential: where the next bootstrap round gets it, and whether it works.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapView {
    /// `handedOver` (`PUT /v1/bootstrap-token`), `kubeconfig` (`bootstrap_kubeconfig`), or
    /// `none`.
    pub source: &'static str,
    /// `unused` (not tried since the node certificate was issued), `usable`, `refused`,
    /// `missing`.
    pub state: &'static str,
}

/// The last CSR an approver denied (a decision, not a fault: the next round waits the
/// longest backoff). Cleared when a certificate is issued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LastDenial {
    /// The CSR's name.
    pub csr: String,
    /// The Denied condition's reason and message (bounded).
    pub reason: String,
    pub message: String,
    /// When (RFC 3339): the condition's time, else when the device saw it.
    pub at: String,
}

/// What `/v1/status` shows as `identity`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IdentityStatus {
    pub in_use: InUse,
    pub node_certificate: Option<CertView>,
    pub bootstrap: BootstrapView,
    /// The device clock is behind the certificate's notBefore: it is kept, and the node
    /// waits for time.
    pub waiting_for_clock: bool,
    pub lapsed: Vec<Lapse>,
    /// The last denied CSR since the last certificate was issued; `null` when none.
    pub last_denial: Option<LastDenial>,
}

impl IdentityStatus {
    /// Before the identity task has run once.
    pub fn starting() -> IdentityStatus {
        IdentityStatus {
            in_use: InUse::None,
            node_certificate: None,
            bootstrap: BootstrapView {
                source: "none",
                state: "unused",
            },
            waiting_for_clock: false,
            lapsed: Vec::new(),
            last_denial: None,
        }
    }

    /// Whether a credential lapsed and nothing has replaced it: the node needs a bootstrap
    /// credential (and `PUT /v1/bootstrap-token` is the way to give it one).
    pub fn needs_bootstrap(&self) -> bool {
        self.in_use == InUse::None
            || self
                .lapsed
                .iter()
                .any(|l| l.credential == Which::NodeCertificate)
    }
}

/// What the bootstrap rounds have met with the bootstrap credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootstrapSeen {
    /// Not tried since the node certificate was last issued (or ever).
    Unused,
    /// A round got past authentication (the CSR was created).
    Usable,
    /// The apiserver answered 401 (an expired or unknown bootstrap token), since this unix
    /// second.
    Refused { since: i64 },
    /// No bootstrap credential to send (a tokenFile missing, none handed over), since this
    /// unix second; `what` says what is missing.
    Missing { since: i64, what: String },
}

/// What the identity task passes to [`compute`].
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    pub now: i64,
    pub cert: Option<&'a CertTimes>,
    /// The apiserver answered 401 to the node certificate since this unix second.
    pub cert_refused_since: Option<i64>,
    pub bootstrap: &'a BootstrapSeen,
    /// `handedOver`, `kubeconfig` or `none`: where the next round's first candidate is.
    pub bootstrap_source: &'static str,
    /// The last CSR an approver denied since a certificate was last issued.
    pub last_denial: Option<&'a LastDenial>,
}

fn rfc3339(unix: i64) -> String {
    let t = if unix >= 0 {
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix as u64)
    } else {
        std::time::UNIX_EPOCH
    };
    crate::time::rfc3339(t)
}

/// The status from what the identity task has seen.
pub fn compute(i: &Inputs<'_>) -> IdentityStatus {
    let mut lapsed = Vec::new();
    if let Some(c) = i.cert {
        if i.now >= c.not_after {
            lapsed.push(Lapse {
                credential: Which::NodeCertificate,
                reason: "expired".into(),
                since: rfc3339(c.not_after),
            });
        } else if let Some(since) = i.cert_refused_since {
            lapsed.push(Lapse {
                credential: Which::NodeCertificate,
                reason: "refused by the apiserver (401)".into(),
                since: rfc3339(since),
            });
        }
    }
    let state = match i.bootstrap {
        BootstrapSeen::Unused => "unused",
        BootstrapSeen::Usable => "usable",
        BootstrapSeen::Refused { since } => {
            lapsed.push(Lapse {
                credential: Which::Bootstrap,
                reason: "bootstrap token refused by the apiserver (401): expired or unknown".into(),
                since: rfc3339(*since),
            });
            "refused"
        }
        BootstrapSeen::Missing { since, what } => {
            lapsed.push(Lapse {
                credential: Which::Bootstrap,
                reason: format!("missing: {what}"),
                since: rfc3339(*since),
            });
            "missing"
        }
    };
    IdentityStatus {
        in_use: if i.cert.is_some() {
            InUse::NodeCertificate
        } else {
            InUse::None
        },
        node_certificate: i.cert.map(|c| CertView {
            subject: c.common_name.clone(),
            not_before: rfc3339(c.not_before),
            not_after: rfc3339(c.not_after),
        }),
        bootstrap: BootstrapView {
            source: i.bootstrap_source,
            state,
        },
        waiting_for_clock: i.cert.is_some_and(|c| i.now < c.not_before),
        lapsed,
        last_denial: i.last_denial.cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(nb: i64, na: i64) -> CertTimes {
        CertTimes {
            not_before: nb,
            not_after: na,
            common_name: Some("system:node:edge-1".into()),
        }
    }

    #[test]
    fn both_lapsed_say_which_and_since_when() {
        let c = cert(1_000, 2_000);
        let s = compute(&Inputs {
            now: 5_000,
            cert: Some(&c),
            cert_refused_since: Some(4_000),
            bootstrap: &BootstrapSeen::Refused { since: 4_500 },
            bootstrap_source: "kubeconfig",
            last_denial: None,
        });
        assert_eq!(s.in_use, InUse::NodeCertificate);
        assert!(s.needs_bootstrap());
        assert_eq!(s.lapsed.len(), 2);
        // Expiry wins over the 401: it is the earlier, and the reason.
        assert_eq!(s.lapsed[0].credential, Which::NodeCertificate);
        assert_eq!(s.lapsed[0].reason, "expired");
        assert_eq!(s.lapsed[0].since, "1970-01-01T00:33:20Z");
        assert_eq!(s.lapsed[1].credential, Which::Bootstrap);
        assert!(s.lapsed[1].reason.contains("401"));
        assert_eq!(s.lapsed[1].since, "1970-01-01T01:15:00Z");
        assert_eq!(s.bootstrap.state, "refused");
    }

    #[test]
    fn a_valid_certificate_lapses_nothing() {
        let c = cert(1_000, 9_000);
        let s = compute(&Inputs {
            now: 5_000,
            cert: Some(&c),
            cert_refused_since: None,
            bootstrap: &BootstrapSeen::Unused,
            bootstrap_source: "kubeconfig",
            last_denial: None,
        });
        assert!(s.lapsed.is_empty());
        assert!(!s.needs_bootstrap());
        assert!(!s.waiting_for_clock);
        assert_eq!(
            s.node_certificate.unwrap().not_after,
            "1970-01-01T02:30:00Z"
        );
    }

    #[test]
    fn a_clock_behind_not_before_waits_and_lapses_nothing() {
        let c = cert(1_000_000, 2_000_000);
        let s = compute(&Inputs {
            now: 10,
            cert: Some(&c),
            cert_refused_since: None,
            bootstrap: &BootstrapSeen::Unused,
            bootstrap_source: "kubeconfig",
            last_denial: None,
        });
        assert!(s.waiting_for_clock);
        assert!(s.lapsed.is_empty());
    }

    #[test]
    fn refused_certificate_and_missing_token_file() {
        let c = cert(1_000, 9_000);
        let s = compute(&Inputs {
            now: 5_000,
            cert: Some(&c),
            cert_refused_since: Some(4_000),
            bootstrap: &BootstrapSeen::Missing {
                since: 4_001,
                what: "tokenFile /x".into(),
            },
            bootstrap_source: "none",
            last_denial: None,
        });
        assert_eq!(s.lapsed[0].reason, "refused by the apiserver (401)");
        assert_eq!(s.lapsed[1].reason, "missing: tokenFile /x");
        assert_eq!(s.bootstrap.state, "missing");
        let none = compute(&Inputs {
            now: 5,
            cert: None,
            cert_refused_since: None,
            bootstrap: &BootstrapSeen::Unused,
            bootstrap_source: "kubeconfig",
            last_denial: None,
        });
        assert_eq!(none.in_use, InUse::None);
        assert!(none.needs_bootstrap());
        assert_eq!(none.last_denial, None);
    }

    #[test]
    fn a_denial_is_shown_as_it_was_seen() {
        let d = LastDenial {
            csr: "node-csr-bk44f".into(),
            reason: "NodeNameMismatch".into(),
            message: "the CSR asks for node \"edge-2\", the factory certificate names \"edge-1\""
                .into(),
            at: "2026-12-02T01:18:28Z".into(),
        };
        let s = compute(&Inputs {
            now: 5,
            cert: None,
            cert_refused_since: None,
            bootstrap: &BootstrapSeen::Usable,
            bootstrap_source: "kubeconfig",
            last_denial: Some(&d),
        });
        assert_eq!(s.last_denial.as_ref(), Some(&d));
        // A denial is not a lapse: the bootstrap credential works, the approver said no.
        assert!(s.lapsed.is_empty());
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["lastDenial"]["csr"], "node-csr-bk44f");
        assert_eq!(v["lastDenial"]["at"], "2026-12-02T01:18:28Z");
        let none = compute(&Inputs {
            now: 5,
            cert: None,
            cert_refused_since: None,
            bootstrap: &BootstrapSeen::Usable,
            bootstrap_source: "kubeconfig",
            last_denial: None,
        });
        assert!(serde_json::to_value(&none).unwrap()["lastDenial"].is_null());
    }
}

//! Approval of a node's serving certificate (signer `kubernetes.io/kubelet-serving`), which
//! kube-controller-manager never auto-approves: the requester must be the node itself
//! (`system:node:<name>` in `system:nodes`, as NodeRestriction already holds the CN to), the
//! subject `O=system:nodes, CN=system:node:<name>`, the usages a serving certificate has, and
//! every SAN one of the addresses that Node reports (IP SANs among its IP addresses, DNS
//! SANs among its Hostname and DNS addresses). Anything else is denied with a reason. A
//! Node not registered yet: wait (the CSR stays pending and is decided when it appears).

use super::request::{NodeRequest, NODES_GROUP, NODE_USER_PREFIX};
use super::CsrView;
use std::net::IpAddr;

/// The signer of kubelet serving certificates.
pub const SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";
/// The reason on an approval this controller writes.
pub const SERVING_APPROVED_REASON: &str = "NodeAddressesMatch";

/// What a Node reports in `status.addresses`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeAddresses {
    /// InternalIP and ExternalIP.
    pub ips: Vec<IpAddr>,
    /// Hostname, InternalDNS and ExternalDNS.
    pub dns: Vec<String>,
}

impl NodeAddresses {
    /// From `status.addresses` as (type, address) pairs.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> NodeAddresses {
        let mut out = NodeAddresses::default();
        for (t, a) in pairs {
            match t {
                "InternalIP" | "ExternalIP" => {
                    if let Ok(ip) = a.parse() {
                        out.ips.push(ip);
                    }
                }
                "Hostname" | "InternalDNS" | "ExternalDNS" => out.dns.push(a.to_string()),
                _ => {}
            }
        }
        out
    }
}

/// What to do with a serving CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServingVerdict {
    /// Not this approver's (another signer, decided already); why, for the log.
    Skip(&'static str),
    /// The Node is not registered (yet): leave it pending, look again later.
    Wait(String),
    Approve {
        node: String,
    },
    Deny {
        reason: &'static str,
        message: String,
    },
}

fn deny(reason: &'static str, message: impl Into<String>) -> ServingVerdict {
    ServingVerdict::Deny {
        reason,
        message: message.into(),
    }
}

/// The node a serving CSR's requester is (`Err`: the deny message), before any lookup.
pub fn requesting_node<'a>(csr: &CsrView<'a>) -> Result<&'a str, String> {
    let node = csr
        .username
        .strip_prefix(NODE_USER_PREFIX)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            format!(
                "requested by {:?}: a serving certificate is asked for by the node itself",
                csr.username
            )
        })?;
    if !csr.groups.iter().any(|g| g == NODES_GROUP) {
        return Err(format!(
            "requester {:?} is not in group {NODES_GROUP}",
            csr.username
        ));
    }
    Ok(node)
}

/// Decides a serving CSR given what its requester's Node reports (`None`: no such Node).
pub fn decide_serving(csr: &CsrView<'_>, node: Option<&NodeAddresses>) -> ServingVerdict {
    if csr.signer != SERVING_SIGNER {
        return ServingVerdict::Skip("another signer");
    }
    if csr.decided {
        return ServingVerdict::Skip("decided already");
    }
    let name = match requesting_node(csr) {
        Ok(n) => n,
        Err(m) => return deny("NotTheNode", m),
    };
    let req = match NodeRequest::parse(csr.request) {
        Ok(r) => r,
        Err(e) => return deny("CSRMalformed", e.to_string()),
    };
    let want_cn = format!("{NODE_USER_PREFIX}{name}");
    if req.organizations != [NODES_GROUP] || req.common_names != [want_cn.clone()] {
        return deny(
            "NotAServingCSR",
            format!(
                "subject O={:?} CN={:?}: a serving CSR of node {name} has O={NODES_GROUP}, CN={want_cn}",
                req.organizations, req.common_names
            ),
        );
    }
    let mut u: Vec<&str> = csr.usages.iter().map(String::as_str).collect();
    u.sort_unstable();
    let base = ["digital signature", "server auth"];
    let rsa = ["digital signature", "key encipherment", "server auth"];
    if !(u == base || (req.rsa && u == rsa)) {
        return deny(
            "NotAServingCSR",
            format!(
                "usages {:?}: a serving certificate has exactly digital signature and server auth{}",
                csr.usages,
                if req.rsa { " (and key encipherment)" } else { "" }
            ),
        );
    }
    let named = req.dns_names.len() + req.ip_addresses.len();
    if named == 0 || named != req.alt_names {
        return deny(
            "NotAServingCSR",
            "a serving CSR names the node's addresses as DNS and IP subjectAltNames, and nothing else",
        );
    }
    let Some(addrs) = node else {
        return ServingVerdict::Wait(format!("node {name} is not registered"));
    };
    let stray_ips: Vec<String> = req
        .ip_addresses
        .iter()
        .filter(|ip| !addrs.ips.contains(ip))
        .map(IpAddr::to_string)
        .collect();
    let stray_dns: Vec<&String> = req
        .dns_names
        .iter()
        .filter(|d| !addrs.dns.contains(d))
        .collect();
    if !stray_ips.is_empty() || !stray_dns.is_empty() {
        return deny(
            "AddressesNotTheNodes",
            format!(
                "node {name} does not report {}{}{}",
                stray_ips.join(", "),
                if stray_ips.is_empty() || stray_dns.is_empty() {
                    ""
                } else {
                    ", "
                },
                stray_dns
                    .iter()
                    .map(|d| d.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    }
    ServingVerdict::Approve {
        node: name.to_string(),
    }
}

/// The condition's message for an approval.
pub fn serving_approval_message(node: &str) -> String {
    format!("edgehub controller: requested by node {node} for addresses that Node reports")
}

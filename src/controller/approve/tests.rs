//! The approver's decision on CSRs made here as a device makes them (rcgen), with the
//! attestation signed by the factory key.

use super::*;
use crate::attest::tests::{ca, device, fleet_ca, Device, NOW};
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PublicKeyData, SanType};

/// A node client CSR for `cn` (PEM) and its key's SubjectPublicKeyInfo.
fn csr_with(dn: &[(DnType, &str)], sans: Vec<SanType>) -> (String, Vec<u8>) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    let mut d = DistinguishedName::new();
    for (t, v) in dn {
        d.push(t.clone(), *v);
    }
    p.distinguished_name = d;
    p.subject_alt_names = sans;
    let csr = p.serialize_request(&key).unwrap();
    (csr.pem().unwrap(), key.subject_public_key_info())
}

fn node_csr(name: &str) -> (String, Vec<u8>) {
    csr_with(
        &[
            (DnType::OrganizationName, "system:nodes"),
            (DnType::CommonName, &format!("system:node:{name}")),
        ],
        Vec::new(),
    )
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

struct Case {
    signer: String,
    username: String,
    groups: Vec<String>,
    usages: Vec<String>,
    decided: bool,
    attestation: Option<String>,
    request: String,
}

impl Case {
    /// A bootstrap CSR as the fixtures have it, from device `d` asking for `name`, attested.
    fn bootstrap(d: &Device, name: &str) -> Case {
        let (request, spki) = node_csr(name);
        Case {
            signer: SIGNER.into(),
            username: "system:bootstrap:edge01".into(),
            groups: strings(&[
                "system:bootstrappers",
                "system:bootstrappers:edgehub",
                "system:authenticated",
            ]),
            usages: strings(&["digital signature", "client auth"]),
            decided: false,
            attestation: Some(d.key().sign(&spki, name).unwrap()),
            request,
        }
    }

    fn view(&self) -> CsrView<'_> {
        CsrView {
            signer: &self.signer,
            username: &self.username,
            groups: &self.groups,
            usages: &self.usages,
            decided: self.decided,
            attestation: self.attestation.as_deref(),
            request: self.request.as_bytes(),
        }
    }
}

fn denied(v: Verdict) -> (&'static str, String) {
    match v {
        Verdict::Deny { reason, message } => (reason, message),
        v => panic!("not denied: {v:?}"),
    }
}

#[test]
fn an_attested_bootstrap_csr_is_approved_for_its_node() {
    let fleet = ca("fleet-ca");
    let d = device(&fleet, "edge-1");
    let c = Case::bootstrap(&d, "edge-1");
    match decide(&c.view(), &fleet_ca(&fleet), NOW) {
        Verdict::Approve { node, serial, key } => {
            assert_eq!(node, "edge-1");
            // The key the record keeps is this CSR's.
            let spki = NodeRequest::parse(c.request.as_bytes()).unwrap().spki_der;
            assert_eq!(key, replay::key_fingerprint(&spki));
            let m = Verdict::approval_message(&node, &serial, &key);
            assert!(m.contains(&serial) && m.contains(&key), "{m}");
        }
        v => panic!("{v:?}"),
    }
    // Usages in another order are the same set.
    let mut c = c;
    c.usages.reverse();
    assert!(matches!(
        decide(&c.view(), &fleet_ca(&fleet), NOW),
        Verdict::Approve { .. }
    ));
}

#[test]
fn renewals_other_requestors_other_signers_and_decided_csrs_are_left_alone() {
    let fleet = ca("fleet-ca");
    let d = device(&fleet, "edge-1");
    let ca = fleet_ca(&fleet);
    let mut c = Case::bootstrap(&d, "edge-1");
    c.attestation = None;
    c.username = "system:node:edge-1".into();
    c.groups = strings(&["system:nodes", "system:authenticated"]);
    assert_eq!(
        decide(&c.view(), &ca, NOW),
        Verdict::Skip("a renewal by a node: selfnodeclient's")
    );
    c.username = "admin".into();
    c.groups = strings(&["system:masters"]);
    assert_eq!(
        decide(&c.view(), &ca, NOW),
        Verdict::Skip("not from a bootstrap token")
    );
    let mut c = Case::bootstrap(&d, "edge-1");
    c.signer = "kubernetes.io/kube-apiserver-client".into();
    assert_eq!(decide(&c.view(), &ca, NOW), Verdict::Skip("another signer"));
    let mut c = Case::bootstrap(&d, "edge-1");
    c.decided = true;
    assert_eq!(
        decide(&c.view(), &ca, NOW),
        Verdict::Skip("decided already")
    );
    // In the group but another user name is still a bootstrap token's.
    let mut c = Case::bootstrap(&d, "edge-1");
    c.username = "someone".into();
    assert!(matches!(
        decide(&c.view(), &ca, NOW),
        Verdict::Approve { .. }
    ));
}

#[test]
fn a_bootstrap_csr_without_an_attestation_is_denied() {
    let fleet = ca("fleet-ca");
    let mut c = Case::bootstrap(&device(&fleet, "edge-1"), "edge-1");
    c.attestation = None;
    let (reason, message) = denied(decide(&c.view(), &fleet_ca(&fleet), NOW));
    assert_eq!(reason, "AttestationMissing");
    assert!(message.contains(crate::attest::ANNOTATION), "{message}");
}

#[test]
fn another_vehicles_name_another_ca_and_another_key_are_denied() {
    let fleet = ca("fleet-ca");
    let ca_ = fleet_ca(&fleet);
    // edge-1's device asks for edge-2 (signing honestly for edge-2).
    let c = Case::bootstrap(&device(&fleet, "edge-1"), "edge-2");
    let (reason, message) = denied(decide(&c.view(), &ca_, NOW));
    assert_eq!(reason, "NodeNameMismatch");
    assert!(
        message.contains("edge-2") && message.contains("edge-1"),
        "{message}"
    );
    // A factory certificate of another CA.
    let c = Case::bootstrap(&device(&ca("fleet-ca"), "edge-1"), "edge-1");
    assert_eq!(
        denied(decide(&c.view(), &ca_, NOW)).0,
        "FactoryCertificateUntrusted"
    );
    // An attestation lifted from another CSR (signed over another key) on a new request.
    let d = device(&fleet, "edge-1");
    let mut c = Case::bootstrap(&d, "edge-1");
    c.request = node_csr("edge-1").0;
    assert_eq!(
        denied(decide(&c.view(), &ca_, NOW)).0,
        "AttestationSignatureInvalid"
    );
}

#[test]
fn a_csr_that_is_no_node_client_csr_is_denied_with_what_is_wrong() {
    let fleet = ca("fleet-ca");
    let d = device(&fleet, "edge-1");
    let ca_ = fleet_ca(&fleet);
    let cn = (DnType::CommonName, "system:node:edge-1");
    let o = (DnType::OrganizationName, "system:nodes");
    let requests = [
        (
            csr_with(std::slice::from_ref(&cn), vec![]).0,
            "organisations",
        ),
        (
            csr_with(
                &[(DnType::OrganizationName, "system:masters"), cn.clone()],
                vec![],
            )
            .0,
            "organisations",
        ),
        (
            csr_with(&[o.clone(), (DnType::CommonName, "edge-1")], vec![]).0,
            "subject CN",
        ),
        (csr_with(std::slice::from_ref(&o), vec![]).0, "common names"),
        (
            csr_with(
                &[o.clone(), (DnType::CommonName, "system:node:Edge_1")],
                vec![],
            )
            .0,
            "invalid",
        ),
        (
            csr_with(
                &[o.clone(), cn.clone()],
                vec![SanType::DnsName("edge-1".try_into().unwrap())],
            )
            .0,
            "subjectAltNames",
        ),
    ];
    for (request, want) in requests {
        let mut c = Case::bootstrap(&d, "edge-1");
        c.request = request;
        let (reason, message) = denied(decide(&c.view(), &ca_, NOW));
        assert_eq!(reason, "NotANodeClientCSR", "{want}: {message}");
        assert!(message.contains(want), "{want}: {message}");
    }
    for usages in [
        &["digital signature", "client auth", "server auth"][..],
        &["digital signature", "key encipherment", "client auth"][..],
        &["client auth"][..],
        &["digital signature", "client auth", "client auth"][..],
    ] {
        let mut c = Case::bootstrap(&d, "edge-1");
        c.usages = strings(usages);
        let (reason, message) = denied(decide(&c.view(), &ca_, NOW));
        assert_eq!(reason, "NotANodeClientCSR", "{usages:?}");
        assert!(message.contains("usages"), "{message}");
    }
    let mut c = Case::bootstrap(&d, "edge-1");
    c.request =
        "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n".into();
    assert_eq!(denied(decide(&c.view(), &ca_, NOW)).0, "CSRMalformed");
    c.request = "not pem".into();
    assert_eq!(denied(decide(&c.view(), &ca_, NOW)).0, "CSRMalformed");
    c.request = fleet.pem.clone();
    let (reason, message) = denied(decide(&c.view(), &ca_, NOW));
    assert_eq!(reason, "CSRMalformed");
    assert!(message.contains("\"CERTIFICATE\""), "{message}");
}

#[test]
fn key_encipherment_is_a_usage_only_for_rsa_keys() {
    let legacy = strings(&["key encipherment", "digital signature", "client auth"]);
    assert!(usages_ok(&legacy, true));
    assert!(!usages_ok(&legacy, false));
    assert!(usages_ok(
        &strings(&["client auth", "digital signature"]),
        false
    ));
}

#[test]
fn the_fleet_ca_source_is_kind_namespace_name() {
    assert_eq!(
        "configmap/kube-system/edgehub-fleet-ca".parse::<CaSource>(),
        Ok(CaSource::ConfigMap {
            namespace: "kube-system".into(),
            name: "edgehub-fleet-ca".into()
        })
    );
    let s: CaSource = "secret/fleet/ca".parse().unwrap();
    assert_eq!(s.to_string(), "secret/fleet/ca");
    for bad in [
        "",
        "configmap/kube-system",
        "pod/kube-system/x",
        "configmap/Kube_System/x",
        "secret/a/b/c",
    ] {
        assert!(bad.parse::<CaSource>().is_err(), "{bad}");
    }
}

/// The CSRs recorded against a real apiserver (made by Go's crypto/x509) read as the
/// approver expects: their node names and, for the recorded bootstrap request, a verdict.
#[test]
fn the_recorded_csrs_parse_to_their_node_names() {
    use base64::Engine;
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/apiserver");
    let mut seen = 0;
    for (file, node) in [
        ("csr_create_as_bootstrap.json", "edge-1"),
        ("csr_bootstrap_for_other_node_name.json", "edge-2"),
        ("csr_renew_as_node.json", "edge-1"),
        ("csr_denied.json", "edge-1"),
    ] {
        let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let b64 = v["request"]["body"]["spec"]["request"].as_str().unwrap();
        let pem = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        let req = NodeRequest::parse(&pem).unwrap();
        assert_eq!(req.node_name(), Ok(node), "{file}");
        assert!(!req.rsa, "{file}");
        assert!(req.spki_der.len() > 60, "{file}");
        seen += 1;
        if file == "csr_create_as_bootstrap.json" {
            // The recorded bootstrap CSR has no attestation: denied by an attested setup.
            let spec = &v["response"]["body"]["spec"];
            let groups: Vec<String> = serde_json::from_value(spec["groups"].clone()).unwrap();
            let usages: Vec<String> = serde_json::from_value(spec["usages"].clone()).unwrap();
            let view = CsrView {
                signer: spec["signerName"].as_str().unwrap(),
                username: spec["username"].as_str().unwrap(),
                groups: &groups,
                usages: &usages,
                decided: false,
                attestation: None,
                request: &pem,
            };
            let fleet = ca("fleet-ca");
            assert_eq!(
                denied(decide(&view, &fleet_ca(&fleet), NOW)).0,
                "AttestationMissing"
            );
        }
    }
    assert_eq!(seen, 4);
}

mod serving_csrs {
    use super::super::serving::*;
    use super::*;

    fn serving(cn: &str, sans: Vec<SanType>) -> String {
        csr_with(
            &[
                (DnType::OrganizationName, "system:nodes"),
                (DnType::CommonName, cn),
            ],
            sans,
        )
        .0
    }

    fn ip(s: &str) -> SanType {
        SanType::IpAddress(s.parse().unwrap())
    }

    fn dns(s: &str) -> SanType {
        SanType::DnsName(s.try_into().unwrap())
    }

    fn node() -> NodeAddresses {
        NodeAddresses::from_pairs([
            ("InternalIP", "10.0.2.15"),
            ("Hostname", "edge-1"),
            ("ExternalIP", "not an ip"),
        ])
    }

    fn decide_as(user: &str, groups: &[&str], usages: &[&str], request: &str) -> ServingVerdict {
        let groups = strings(groups);
        let usages = strings(usages);
        let v = CsrView {
            signer: SERVING_SIGNER,
            username: user,
            groups: &groups,
            usages: &usages,
            decided: false,
            attestation: None,
            request: request.as_bytes(),
        };
        decide_serving(&v, Some(&node()))
    }

    const NODES: &[&str] = &["system:nodes", "system:authenticated"];
    const USAGES: &[&str] = &["server auth", "digital signature"];

    #[test]
    fn the_nodes_own_addresses_are_approved() {
        assert_eq!(
            node().ips,
            vec!["10.0.2.15".parse::<std::net::IpAddr>().unwrap()]
        );
        let r = serving("system:node:edge-1", vec![dns("edge-1"), ip("10.0.2.15")]);
        assert_eq!(
            decide_as("system:node:edge-1", NODES, USAGES, &r),
            ServingVerdict::Approve {
                node: "edge-1".into()
            }
        );
        // A subset of them too.
        let r = serving("system:node:edge-1", vec![ip("10.0.2.15")]);
        assert!(matches!(
            decide_as("system:node:edge-1", NODES, USAGES, &r),
            ServingVerdict::Approve { .. }
        ));
    }

    #[test]
    fn anything_else_is_denied_with_a_reason() {
        let ok = serving("system:node:edge-1", vec![dns("edge-1"), ip("10.0.2.15")]);
        let reason = |v: ServingVerdict| match v {
            ServingVerdict::Deny { reason, message } => (reason, message),
            other => panic!("not denied: {other:?}"),
        };
        // An address the Node does not report.
        let r = serving("system:node:edge-1", vec![ip("10.0.2.15"), ip("8.8.8.8")]);
        let (why, msg) = reason(decide_as("system:node:edge-1", NODES, USAGES, &r));
        assert_eq!(why, "AddressesNotTheNodes");
        assert!(msg.contains("8.8.8.8"), "{msg}");
        let r = serving("system:node:edge-1", vec![dns("bank.example.com")]);
        assert_eq!(
            reason(decide_as("system:node:edge-1", NODES, USAGES, &r)).0,
            "AddressesNotTheNodes"
        );
        // Not the node: a user, or another node's name.
        assert_eq!(
            reason(decide_as("jane", &["system:authenticated"], USAGES, &ok)).0,
            "NotTheNode"
        );
        assert_eq!(
            reason(decide_as(
                "system:node:edge-1",
                &["system:authenticated"],
                USAGES,
                &ok
            ))
            .0,
            "NotTheNode"
        );
        assert_eq!(
            reason(decide_as("system:node:edge-2", NODES, USAGES, &ok)).0,
            "NotAServingCSR"
        );
        // Client usages, no SANs, an email SAN.
        assert_eq!(
            reason(decide_as(
                "system:node:edge-1",
                NODES,
                &["digital signature", "client auth"],
                &ok
            ))
            .0,
            "NotAServingCSR"
        );
        let r = serving("system:node:edge-1", vec![]);
        assert_eq!(
            reason(decide_as("system:node:edge-1", NODES, USAGES, &r)).0,
            "NotAServingCSR"
        );
        let r = serving(
            "system:node:edge-1",
            vec![
                ip("10.0.2.15"),
                SanType::Rfc822Name("a@b.c".try_into().unwrap()),
            ],
        );
        assert_eq!(
            reason(decide_as("system:node:edge-1", NODES, USAGES, &r)).0,
            "NotAServingCSR"
        );
        assert_eq!(
            reason(decide_as("system:node:edge-1", NODES, USAGES, "garbage")).0,
            "CSRMalformed"
        );
    }

    #[test]
    fn other_signers_decided_ones_and_unknown_nodes() {
        let r = serving("system:node:edge-1", vec![ip("10.0.2.15")]);
        let groups = strings(NODES);
        let usages = strings(USAGES);
        let mut v = CsrView {
            signer: SIGNER,
            username: "system:node:edge-1",
            groups: &groups,
            usages: &usages,
            decided: false,
            attestation: None,
            request: r.as_bytes(),
        };
        assert!(matches!(
            decide_serving(&v, Some(&node())),
            ServingVerdict::Skip(_)
        ));
        v.signer = SERVING_SIGNER;
        v.decided = true;
        assert!(matches!(
            decide_serving(&v, Some(&node())),
            ServingVerdict::Skip(_)
        ));
        v.decided = false;
        assert!(matches!(decide_serving(&v, None), ServingVerdict::Wait(_)));
    }
}

/// The fuzz target attest_csr's seeds (fleet CA, annotation, request, record entry, CSR
/// object, NUL-separated) are what they say: the fuzzer starts from an approvable CSR and
/// from denials past the parsers, not from inputs every parser refuses.
#[test]
fn the_fuzz_seeds_reach_the_decision() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/attest_csr");
    let now = 1_796_169_600; // the target's NOW
    for (seed, want) in [
        ("approve_p256", None),
        ("intermediate_p384", None),
        ("ed25519", None),
        ("name_mismatch", Some("NodeNameMismatch")),
        ("two_names", Some("FactoryCertificateNamesNoNode")),
    ] {
        let data = std::fs::read(format!("{dir}/{seed}")).unwrap();
        let parts: Vec<&[u8]> = data.splitn(5, |b| *b == 0).collect();
        assert_eq!(parts.len(), 5, "{seed}");
        let ca = attest::FleetCa::from_pem(parts[0]).unwrap();
        let annotation = std::str::from_utf8(parts[1]).unwrap();
        let c = Case {
            signer: SIGNER.into(),
            username: "system:bootstrap:edge01".into(),
            groups: strings(&["system:bootstrappers"]),
            usages: strings(&["digital signature", "client auth"]),
            decided: false,
            attestation: Some(annotation.into()),
            request: std::str::from_utf8(parts[2]).unwrap().into(),
        };
        match (decide(&c.view(), &ca, now), want) {
            (Verdict::Approve { .. }, None) => {}
            (Verdict::Deny { reason, .. }, Some(w)) if reason == w => {}
            (v, _) => panic!("{seed}: {v:?}"),
        }
    }
}

//! What a bootstrap token's CSR makes the controller parse, and what the device reads back:
//! the attestation annotation (its JSON, base64 signature, PEM chain, checked against a fleet
//! CA that is input too), the PKCS#10 request (PEM, DER), the attested approval's decision on
//! both, an entry of the record of attested keys (a ConfigMap anyone with write access to
//! its namespace could edit), and the CSR object's status as the device's round reads it.
//!
//! Input: five parts separated by NUL bytes: the fleet CA PEM, the annotation, the request
//! PEM, a record entry, the CSR object JSON. The seeds in fuzz/corpus/attest_csr hold real
//! ones (an approvable CSR among them), so the fuzzer starts past the parsers.
#![no_main]

use edgehub::attest::{self, FleetCa};
use edgehub::controller::approve::{decide, replay, CsrView, NodeRequest, Verdict, SIGNER};
use edgehub::identity::request::progress;
use libfuzzer_sys::fuzz_target;

/// 2026-12-02: the seeds' certificates are valid then.
const NOW: u64 = 1_796_169_600;

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(5, |b| *b == 0);
    let mut next = || parts.next().unwrap_or_default();
    let (ca_pem, annotation, request, entry, object) = (next(), next(), next(), next(), next());
    let annotation = String::from_utf8_lossy(annotation);

    if let Ok(req) = NodeRequest::parse(request) {
        let _ = req.node_name();
    }
    if let Ok(ca) = FleetCa::from_pem(ca_pem) {
        let groups = vec!["system:bootstrappers".to_string()];
        let usages = vec!["digital signature".to_string(), "client auth".to_string()];
        let view = CsrView {
            signer: SIGNER,
            username: "system:bootstrap:edge01",
            groups: &groups,
            usages: &usages,
            decided: false,
            attestation: Some(&annotation),
            request,
        };
        match decide(&view, &ca, NOW) {
            Verdict::Approve { node, key, .. } => {
                // Approved only what verifies: this request's name and key.
                let req = NodeRequest::parse(request).expect("approved an unreadable request");
                assert_eq!(req.node_name(), Ok(node.as_str()));
                assert_eq!(key, replay::key_fingerprint(&req.spki_der));
                assert!(attest::verify(&annotation, &ca, &req.spki_der, &node, NOW).is_ok());
            }
            Verdict::Deny { reason, message } => {
                assert!(!reason.is_empty() && !message.is_empty());
            }
            Verdict::Skip(why) => panic!("a pending bootstrap CSR was skipped: {why}"),
        }
    }

    let fp = replay::key_fingerprint(request);
    let mut record = std::collections::BTreeMap::new();
    record.insert(fp.clone(), String::from_utf8_lossy(entry).into_owned());
    let _ = replay::seen(Some(&record), &fp, "c24bb0f9-9b62-4541-8003-000000000003");

    if let Ok(obj) = serde_json::from_slice::<serde_json::Value>(object) {
        let _ = progress(&obj);
    }
});

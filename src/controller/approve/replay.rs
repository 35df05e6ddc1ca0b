//! One bootstrap per attestation (issue 31 item 9). The attestation signs the CSR's key and
//! the node name, nothing that changes, and the key sits in the clear on the vehicle's
//! flash: whoever copies it and captures the annotation (bootstrappers can watch CSRs) could
//! ask again at will. So the controller records every key it approves for a node, in the
//! cluster, and approves a key once; edgehub makes a new key for every CSR, so a vehicle's
//! own next bootstrap is a new key.
//!
//! **The record** is a ConfigMap per node name, [`record_name`], in the namespace
//! `--attest-record-namespace`: one data entry per key, keyed [`key_fingerprint`] (the
//! SHA-256 of the key's SubjectPublicKeyInfo), whose value says which CSR (name and uid)
//! used it and when ([`Use`]). It outlives the Node (an operator deleting a Node does not
//! reopen the door) and the CSRs (which the apiserver collects after an hour), and any
//! replica reads it: the controller keeps no state. It is written before the approval, with
//! the read's resourceVersion, so two replicas racing for one key cannot both win; the CSR
//! whose uid is recorded may be approved again (a retry after a failed `/approval` write).
//!
//! This file is pure: what the record says about a key, and the entry to write.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The record's name prefix; [`record_name`] adds the node name.
pub const RECORD_PREFIX: &str = "edgehub-attest-";
/// The record's annotation naming its node (the name alone cannot, for very long node names).
pub const NODE_ANNOTATION: &str = "edgehub.io/node-name";
/// The label every record carries (`kubectl get cm -l` finds them).
pub const RECORD_LABEL: &str = "edgehub.io/attested-keys";
/// The default namespace of the records.
pub const DEFAULT_NAMESPACE: &str = "edgehub-attest";
/// At most this many keys per node: a vehicle bootstraps once per lapsed certificate, so
/// this many is a key that leaked, not a vehicle; the record stays far below a ConfigMap's
/// 1 MiB (an entry is under 500 bytes).
pub const MAX_KEYS: usize = 1000;

/// The longest object name (a DNS-1123 subdomain).
const MAX_NAME: usize = 253;

/// The record's ConfigMap name for `node`: [`RECORD_PREFIX`] and the node name, or, for a
/// node name too long for that (over 238 characters), the node name's first 150 characters
/// and its SHA-256 (the full name is in [`NODE_ANNOTATION`]).
pub fn record_name(node: &str) -> String {
    let plain = format!("{RECORD_PREFIX}{node}");
    if plain.len() <= MAX_NAME {
        return plain;
    }
    let head: String = node.chars().take(150).collect();
    let head = head.trim_end_matches(['.', '-']);
    format!(
        "{RECORD_PREFIX}{head}-{}",
        &sha256_hex(node.as_bytes())[..64]
    )
}

fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A key's entry name in the record: `sha256-<hex>` of its SubjectPublicKeyInfo (DER).
pub fn key_fingerprint(spki_der: &[u8]) -> String {
    format!("sha256-{}", sha256_hex(spki_der))
}

/// Who used a key: an entry's value (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Use {
    /// The CSR's name and uid.
    pub csr: String,
    pub uid: String,
    /// The factory certificate's serial (hex) that attested it.
    pub factory_serial: String,
    /// When it was recorded (RFC 3339), just before the approval.
    pub at: String,
}

impl Use {
    /// The entry's value.
    pub fn to_value(&self) -> String {
        // A struct of strings always serialises.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// What the record says of a key for a CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Never used: record it, then approve.
    New,
    /// Recorded for this very CSR (its uid): a decision that was not written; approve.
    ThisCsr,
    /// Used by another CSR: a replay. The entry, as recorded (an unreadable entry counts as
    /// used: whoever edited it by hand did not mean to reopen the key).
    Replayed(Result<Use, String>),
    /// The node has [`MAX_KEYS`] keys recorded already.
    Full,
}

/// What `record` (the ConfigMap's data; `None`: no record yet) says of the key
/// `fingerprint` for the CSR whose uid is `csr_uid`.
pub fn seen(record: Option<&BTreeMap<String, String>>, fingerprint: &str, csr_uid: &str) -> Seen {
    let Some(data) = record else {
        return Seen::New;
    };
    match data.get(fingerprint) {
        Some(v) => match serde_json::from_str::<Use>(v) {
            Ok(u) if !csr_uid.is_empty() && u.uid == csr_uid => Seen::ThisCsr,
            Ok(u) => Seen::Replayed(Ok(u)),
            Err(_) => Seen::Replayed(Err(v.chars().take(200).collect())),
        },
        None if data.len() >= MAX_KEYS => Seen::Full,
        None => Seen::New,
    }
}

/// The denial's message for a replayed key.
pub fn replayed_message(node: &str, fingerprint: &str, first: &Result<Use, String>) -> String {
    let by = match first {
        Ok(u) => format!("by CSR {} (uid {}) at {}", u.csr, u.uid, u.at),
        Err(raw) => format!("(the record's entry is unreadable: {raw:?})"),
    };
    format!(
        "this CSR's key ({fingerprint}) was attested for node {node} before, {by}: an \
         attestation is good for one bootstrap, and edgehub makes a new key for every CSR; a \
         CSR that reuses a key is a replay of a captured attestation with a copied node key"
    )
}

/// The denial's message for a node with [`MAX_KEYS`] keys recorded.
pub fn full_message(node: &str, record: &str) -> String {
    format!(
        "node {node} has been given {MAX_KEYS} keys already (record {record}): a vehicle \
         bootstraps once per lapsed certificate, so its factory key has likely leaked; see \
         docs/controller.md"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used(uid: &str) -> String {
        Use {
            csr: "node-csr-abcde".into(),
            uid: uid.into(),
            factory_serial: "01".into(),
            at: "2026-01-01T00:00:00Z".into(),
        }
        .to_value()
    }

    #[test]
    fn a_key_is_approved_once_and_for_its_own_csr_again() {
        let fp = key_fingerprint(b"spki");
        assert!(fp.starts_with("sha256-") && fp.len() == 7 + 64, "{fp}");
        assert_eq!(seen(None, &fp, "u1"), Seen::New);
        let mut data = BTreeMap::new();
        data.insert(key_fingerprint(b"other"), used("u0"));
        assert_eq!(seen(Some(&data), &fp, "u1"), Seen::New);
        data.insert(fp.clone(), used("u1"));
        assert_eq!(seen(Some(&data), &fp, "u1"), Seen::ThisCsr);
        let Seen::Replayed(Ok(first)) = seen(Some(&data), &fp, "u2") else {
            panic!("a second CSR for the key is a replay");
        };
        assert_eq!(first.csr, "node-csr-abcde");
        let m = replayed_message("edge-1", &fp, &Ok(first));
        assert!(m.contains("node-csr-abcde") && m.contains("edge-1") && m.contains(&fp));
        // A CSR without a uid never matches a recorded one.
        assert!(matches!(seen(Some(&data), &fp, ""), Seen::Replayed(_)));
    }

    #[test]
    fn an_unreadable_entry_counts_as_used() {
        let fp = key_fingerprint(b"spki");
        let mut data = BTreeMap::new();
        data.insert(fp.clone(), "edited by hand".into());
        assert_eq!(
            seen(Some(&data), &fp, "u1"),
            Seen::Replayed(Err("edited by hand".into()))
        );
    }

    #[test]
    fn a_full_record_takes_no_new_key_but_knows_its_own() {
        let mut data = BTreeMap::new();
        for i in 0..MAX_KEYS {
            data.insert(key_fingerprint(&i.to_be_bytes()), used(&format!("u{i}")));
        }
        assert_eq!(seen(Some(&data), &key_fingerprint(b"new"), "x"), Seen::Full);
        let own = key_fingerprint(&7usize.to_be_bytes());
        assert_eq!(seen(Some(&data), &own, "u7"), Seen::ThisCsr);
        // An entry's size, for the 1 MiB a ConfigMap may hold.
        let longest = Use {
            csr: "c".repeat(253),
            uid: "0".repeat(36),
            factory_serial: "f".repeat(40),
            at: "2026-01-01T00:00:00Z".into(),
        }
        .to_value();
        assert!(longest.len() + own.len() < 500, "{}", longest.len());
        const { assert!(MAX_KEYS * 500 < 1 << 20) };
    }

    #[test]
    fn record_names_are_object_names() {
        assert_eq!(record_name("edge-1"), "edgehub-attest-edge-1");
        let long = format!("{}.{}", "a".repeat(200), "b".repeat(52));
        let n = record_name(&long);
        assert!(n.len() <= MAX_NAME, "{}", n.len());
        assert!(crate::names::check_subdomain(&n).is_ok(), "{n}");
        assert_ne!(
            n,
            record_name(&format!("{}.{}", "a".repeat(200), "c".repeat(52)))
        );
        let edge = format!("{}-{}", "a".repeat(149), "b".repeat(100));
        assert!(crate::names::check_subdomain(&record_name(&edge)).is_ok());
    }
}

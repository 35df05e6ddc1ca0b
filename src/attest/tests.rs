//! Every denial and the happy path, with a fleet CA, intermediates and factory certificates
//! made here by rcgen, and the signing done by [`FactoryKey`] as on the device. The PKI
//! helpers are shared with the controller's approver tests.

use super::*;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, PublicKeyData, SignatureAlgorithm, PKCS_ECDSA_P256_SHA256,
    PKCS_ECDSA_P384_SHA384, PKCS_ED25519,
};

/// 2026-12-02, inside every test certificate's default window.
pub(crate) const NOW: u64 = 1_796_169_600;

pub(crate) struct Ca {
    pub(crate) pem: String,
    issuer: Issuer<'static, KeyPair>,
}

pub(crate) fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    p.distinguished_name = dn;
    let cert = p.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(p, key),
    }
}

fn intermediate(parent: &Ca, name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    p.distinguished_name = dn;
    let cert = p.signed_by(&key, &parent.issuer).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(p, key),
    }
}

/// A factory certificate's parameters: SANs as given, CN the vehicle's serial.
fn factory_params(sans: &[&str]) -> CertificateParams {
    let mut p =
        CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "VIN-WDB1234567890");
    p.distinguished_name = dn;
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    p
}

/// A device: its factory key (PEM) and chain (PEM, factory certificate first).
pub(crate) struct Device {
    pub(crate) key_pem: String,
    pub(crate) chain_pem: String,
}

fn device_with(
    issuer: &Ca,
    above: &[&Ca],
    params: CertificateParams,
    alg: &'static SignatureAlgorithm,
) -> Device {
    let key = KeyPair::generate_for(alg).unwrap();
    let cert = params.signed_by(&key, &issuer.issuer).unwrap();
    let mut chain_pem = cert.pem();
    for c in above {
        chain_pem.push_str(&c.pem);
    }
    Device {
        key_pem: key.serialize_pem(),
        chain_pem,
    }
}

pub(crate) fn device(fleet: &Ca, name: &str) -> Device {
    device_with(fleet, &[], factory_params(&[name]), &PKCS_ECDSA_P256_SHA256)
}

impl Device {
    pub(crate) fn key(&self) -> FactoryKey {
        FactoryKey::from_pem(self.key_pem.as_bytes(), self.chain_pem.as_bytes()).unwrap()
    }
}

/// A CSR key's SubjectPublicKeyInfo (the device's new node key).
fn csr_spki() -> Vec<u8> {
    KeyPair::generate().unwrap().subject_public_key_info()
}

pub(crate) fn fleet_ca(ca: &Ca) -> FleetCa {
    FleetCa::from_pem(ca.pem.as_bytes()).unwrap()
}

#[test]
fn a_device_with_a_factory_certificate_for_its_name_is_verified() {
    let fleet = ca("fleet-ca");
    let d = device(&fleet, "edge-1");
    let spki = csr_spki();
    let annotation = d.key().sign(&spki, "edge-1").unwrap();
    let v = verify(&annotation, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap();
    assert_eq!(v.node_name, "edge-1");
    // What a CSR carries for one P-256 factory certificate (printed for docs/controller.md).
    println!("annotation: {} bytes", annotation.len());
    assert!(annotation.len() < MAX_ANNOTATION / 16);
    assert!(!v.serial.is_empty() && v.serial.chars().all(|c| c.is_ascii_hexdigit()));
    // The annotation is the documented JSON.
    let j: serde_json::Value = serde_json::from_str(&annotation).unwrap();
    assert_eq!(j["version"], 1);
    assert_eq!(j["algorithm"], "ecdsa-p256-sha256");
    assert!(j["chain"]
        .as_str()
        .unwrap()
        .starts_with("-----BEGIN CERTIFICATE-----"));
}

#[test]
fn p384_and_ed25519_factory_keys_and_an_intermediate_verify_too() {
    let fleet = ca("fleet-ca");
    let plant = intermediate(&fleet, "plant-7");
    for (alg, name) in [
        (&PKCS_ECDSA_P384_SHA384, "ecdsa-p384-sha384"),
        (&PKCS_ED25519, "ed25519"),
        (&PKCS_ECDSA_P256_SHA256, "ecdsa-p256-sha256"),
    ] {
        let d = device_with(&plant, &[&plant], factory_params(&["edge-7"]), alg);
        let key = d.key();
        assert_eq!(key.algorithm().name(), name);
        let spki = csr_spki();
        let a = key.sign(&spki, "edge-7").unwrap();
        let v = verify(&a, &fleet_ca(&fleet), &spki, "edge-7", NOW).unwrap();
        assert_eq!(v.node_name, "edge-7", "{name}");
        // Without the intermediate in the annotation the chain does not reach the fleet CA.
        let d = Device {
            chain_pem: d
                .chain_pem
                .split_inclusive("-----END CERTIFICATE-----\n")
                .next()
                .unwrap()
                .into(),
            ..d
        };
        let a = d.key().sign(&spki, "edge-7").unwrap();
        let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-7", NOW).unwrap_err();
        assert_eq!(e.reason(), "FactoryCertificateUntrusted", "{e}");
    }
}

#[test]
fn a_factory_certificate_from_another_ca_is_denied() {
    let fleet = ca("fleet-ca");
    let other = ca("fleet-ca"); // the same name, another key
    let d = device(&other, "edge-1");
    let spki = csr_spki();
    let a = d.key().sign(&spki, "edge-1").unwrap();
    let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap_err();
    assert!(matches!(e, Denial::Untrusted(_)), "{e:?}");
    assert_eq!(e.reason(), "FactoryCertificateUntrusted");
    // The fleet CA may be a bundle (a CA rotation): the other CA in it is trusted.
    let both = FleetCa::from_pem(format!("{}{}", fleet.pem, other.pem).as_bytes()).unwrap();
    assert_eq!(both.len(), 2);
    verify(&a, &both, &spki, "edge-1", NOW).unwrap();
}

#[test]
fn a_signature_over_another_key_or_another_name_is_denied() {
    let fleet = ca("fleet-ca");
    let d = device(&fleet, "edge-1");
    let (spki, other_spki) = (csr_spki(), csr_spki());
    let a = d.key().sign(&other_spki, "edge-1").unwrap();
    let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap_err();
    assert!(matches!(e, Denial::BadSignature(_)), "{e:?}");
    assert_eq!(e.reason(), "AttestationSignatureInvalid");

    // Another device's factory certificate with this device's signature: the key differs.
    let d2 = device(&fleet, "edge-1");
    let mut wire: serde_json::Value =
        serde_json::from_str(&d.key().sign(&spki, "edge-1").unwrap()).unwrap();
    wire["chain"] = d2.chain_pem.clone().into();
    let e = verify(&wire.to_string(), &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap_err();
    assert!(matches!(e, Denial::BadSignature(_)), "{e:?}");

    // A signature made for ("edge-1", key) with the name field moved into the key: the
    // length prefixes keep them apart.
    assert_ne!(message(b"ab", "c"), message(b"a", "bc"));
    assert!(message(b"k", "n").starts_with(DOMAIN));
}

#[test]
fn a_csr_for_another_vehicles_name_is_denied() {
    let fleet = ca("fleet-ca");
    let d = device(&fleet, "edge-1");
    let spki = csr_spki();
    // The device signs honestly for edge-2: the factory certificate still names edge-1.
    let a = d.key().sign(&spki, "edge-2").unwrap();
    let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-2", NOW).unwrap_err();
    assert_eq!(
        e,
        Denial::NameMismatch {
            asked: "edge-2".into(),
            named: "edge-1".into()
        }
    );
    assert_eq!(e.reason(), "NodeNameMismatch");
    // DNS compares without case.
    let d = device(&fleet, "Edge-1");
    let a = d.key().sign(&spki, "edge-1").unwrap();
    verify(&a, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap();
}

#[test]
fn a_factory_certificate_naming_no_node_or_several_or_a_wildcard_is_denied() {
    let fleet = ca("fleet-ca");
    let spki = csr_spki();
    for sans in [&[][..], &["edge-1", "edge-2"][..], &["*.fleet"][..]] {
        let d = device_with(&fleet, &[], factory_params(sans), &PKCS_ECDSA_P256_SHA256);
        let a = d.key().sign(&spki, "edge-1").unwrap();
        let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap_err();
        assert!(matches!(e, Denial::NoNodeName(_)), "{sans:?}: {e:?}");
        assert_eq!(e.reason(), "FactoryCertificateNamesNoNode");
    }
    // The CN alone names nothing.
    let mut p = factory_params(&[]);
    p.distinguished_name.push(DnType::CommonName, "edge-1");
    let d = device_with(&fleet, &[], p, &PKCS_ECDSA_P256_SHA256);
    let a = d.key().sign(&spki, "edge-1").unwrap();
    let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap_err();
    assert!(matches!(e, Denial::NoNodeName(_)), "{e:?}");
}

#[test]
fn an_expired_or_not_yet_valid_factory_certificate_is_denied() {
    let fleet = ca("fleet-ca");
    let spki = csr_spki();
    let mut p = factory_params(&["edge-1"]);
    p.not_before = rcgen::date_time_ymd(2020, 1, 1);
    p.not_after = rcgen::date_time_ymd(2025, 1, 1);
    let d = device_with(&fleet, &[], p, &PKCS_ECDSA_P256_SHA256);
    let a = d.key().sign(&spki, "edge-1").unwrap();
    let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap_err();
    assert_eq!(
        e,
        Denial::Expired {
            not_after: 1_735_689_600
        }
    );
    assert_eq!(e.reason(), "FactoryCertificateExpired");
    // Before the window: a controller whose clock is early (or a certificate from the future).
    let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-1", 1_500_000_000).unwrap_err();
    assert_eq!(e.reason(), "FactoryCertificateNotYetValid", "{e}");
}

#[test]
fn a_ca_certificate_or_a_server_only_certificate_is_no_factory_certificate() {
    let fleet = ca("fleet-ca");
    let spki = csr_spki();
    let mut p = factory_params(&["edge-1"]);
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let d = device_with(&fleet, &[], p, &PKCS_ECDSA_P256_SHA256);
    let a = d.key().sign(&spki, "edge-1").unwrap();
    let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap_err();
    assert_eq!(e.reason(), "FactoryCertificateUntrusted", "{e}");

    let mut p = factory_params(&["edge-1"]);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let d = device_with(&fleet, &[], p, &PKCS_ECDSA_P256_SHA256);
    let a = d.key().sign(&spki, "edge-1").unwrap();
    let e = verify(&a, &fleet_ca(&fleet), &spki, "edge-1", NOW).unwrap_err();
    assert_eq!(e.reason(), "FactoryCertificateUntrusted", "{e}");
}

#[test]
fn malformed_annotations_are_denied_with_what_is_wrong() {
    let fleet = ca("fleet-ca");
    let ca = fleet_ca(&fleet);
    let d = device(&fleet, "edge-1");
    let spki = csr_spki();
    let good: serde_json::Value =
        serde_json::from_str(&d.key().sign(&spki, "edge-1").unwrap()).unwrap();
    let with = |k: &str, v: serde_json::Value| {
        let mut w = good.clone();
        w[k] = v;
        w.to_string()
    };
    let cases = [
        ("".to_string(), "not the JSON"),
        ("{}".to_string(), "not the JSON"),
        (with("extra", 1.into()), "unknown field"),
        (with("version", 2.into()), "version 2"),
        (with("algorithm", "rsa".into()), "unknown algorithm"),
        (with("signature", "%%%".into()), "not base64"),
        (with("chain", "".into()), "no certificate"),
        (
            with(
                "chain",
                "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into(),
            ),
            "the factory certificate",
        ),
        (
            with("chain", good["chain"].as_str().unwrap().repeat(9).into()),
            "at most 8",
        ),
        ("x".repeat(MAX_ANNOTATION + 1), "bytes, at most"),
    ];
    for (a, want) in cases {
        let e = verify(&a, &ca, &spki, "edge-1", NOW).unwrap_err();
        assert!(matches!(e, Denial::Malformed(_)), "{want}: {e:?}");
        assert!(e.to_string().contains(want), "{want}: {e}");
        assert_eq!(e.reason(), "AttestationMalformed");
    }
    // The algorithm must be the key's: an ECDSA signature called Ed25519 does not verify.
    let e = verify(
        &with("algorithm", "ed25519".into()),
        &ca,
        &spki,
        "edge-1",
        NOW,
    )
    .unwrap_err();
    assert!(matches!(e, Denial::BadSignature(_)), "{e:?}");
}

#[test]
fn a_factory_key_that_is_not_the_certificates_or_not_pkcs8_is_refused_at_load() {
    let fleet = ca("fleet-ca");
    let d = device(&fleet, "edge-1");
    let other = KeyPair::generate().unwrap().serialize_pem();
    let e = FactoryKey::from_pem(other.as_bytes(), d.chain_pem.as_bytes()).unwrap_err();
    assert!(matches!(e, KeyError::Mismatch), "{e:?}");
    let e = FactoryKey::from_pem(b"nope", d.chain_pem.as_bytes()).unwrap_err();
    assert!(matches!(e, KeyError::Key(_)), "{e:?}");
    let e = FactoryKey::from_pem(d.key_pem.as_bytes(), b"").unwrap_err();
    assert!(matches!(e, KeyError::Chain(_)), "{e:?}");
    let rsa_like = "-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n";
    let e = FactoryKey::from_pem(rsa_like.as_bytes(), d.chain_pem.as_bytes()).unwrap_err();
    assert!(e.to_string().contains("PKCS#8"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let e =
        FactoryKey::load(&dir.path().join("key.pem"), &dir.path().join("chain.pem")).unwrap_err();
    assert!(e.to_string().contains("key.pem"), "{e}");
    std::fs::write(dir.path().join("key.pem"), &d.key_pem).unwrap();
    std::fs::write(dir.path().join("chain.pem"), &d.chain_pem).unwrap();
    let k = FactoryKey::load(&dir.path().join("key.pem"), &dir.path().join("chain.pem")).unwrap();
    assert_eq!(k.public_key().len(), 65);
}

#[test]
fn a_fleet_ca_that_is_not_pem_is_an_error() {
    assert!(FleetCa::from_pem(b"").is_err());
    assert!(
        FleetCa::from_pem(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
            .is_err()
    );
}

//! Test support for edgehub: an in-process fake kube-apiserver over TLS, its test PKI, and the
//! recorded apiserver fixtures.

pub mod apiserver;
pub mod certs;
pub mod chaos;
pub mod daemonset_sim;
pub mod hostile;
pub mod hostile_archive;
pub mod patch;
mod rawclient;
pub use rawclient::{ClientPem, RawAnswer};
pub mod yocto;

pub use apiserver::{
    Approval, Approver, BootstrapToken, CsrRequest, FakeApiServer, TestOnlyCertWindow, ADMIN_TOKEN,
    APISERVER_KUBELET_CLIENT, KUBELET_SERVING_SIGNER, NODE_TOKEN, NODE_USER,
};

use std::path::PathBuf;

/// The recorded kube-apiserver responses (a copy of the project's shared fixtures).
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/apiserver")
}

/// One fixture file, parsed.
pub fn fixture(name: &str) -> serde_json::Value {
    let path = fixtures_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()))
}

/// The response body of a fixture.
pub fn fixture_body(name: &str) -> serde_json::Value {
    fixture(name)["response"]["body"].clone()
}

//! kube-rs and k8s-openapi belong to `edgehub controller` only (DESIGN §8, §10): the device
//! build, with default features, must not depend on them. Checked with `cargo tree` on the
//! locked dependency graph, in every default `cargo test`.

use std::process::Command;

/// The crates `cargo tree` lists for edgehub's normal and build dependencies.
fn tree(features: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "tree",
            "--locked",
            "-p",
            "edgehub",
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .args(features)
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

const CONTROLLER_ONLY: &[&str] = &["kube", "kube-client", "kube-runtime", "k8s-openapi"];

#[test]
fn the_default_build_has_no_kube_rs_and_the_controller_build_has() {
    let default = tree(&[]);
    assert!(default.iter().any(|c| c == "tokio"), "{default:?}");
    for c in CONTROLLER_ONLY {
        assert!(
            !default.iter().any(|d| d == c),
            "{c} is in the default (device) build"
        );
    }
    // The check would pass vacuously if the feature pulled in nothing.
    let controller = tree(&["--features", "controller"]);
    for c in ["kube", "k8s-openapi"] {
        assert!(
            controller.iter().any(|d| d == c),
            "{c} missing with the feature"
        );
    }
    // No openssl either way: rustls with ring, as the rest of the crate.
    assert!(!controller
        .iter()
        .any(|d| d == "openssl" || d == "openssl-sys"));
}

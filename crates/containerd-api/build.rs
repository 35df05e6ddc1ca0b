//! Generates clients of containerd's content, images and leases services (the ones an image
//! import needs) from the protos the `containerd-client` registry package vendors, with protox
//! (a protobuf compiler written in Rust) instead of a system `protoc`.
//!
//! The package is found through `cargo metadata`, which honours the same source replacement
//! (vendored crates, mirrors) as the build itself. This is crates/cri-api/build.rs's way.

use std::path::PathBuf;
use std::process::Command;

/// The package that ships the protos, and the version pinned in Cargo.toml.
const PROTO_PACKAGE: &str = "containerd-client";
const INCLUDE: &str = "vendor";
const PROTO_FILES: &[&str] = &[
    "github.com/containerd/containerd/api/services/content/v1/content.proto",
    "github.com/containerd/containerd/api/services/images/v1/images.proto",
    "github.com/containerd/containerd/api/services/leases/v1/leases.proto",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=Cargo.toml");
    let dir = match proto_package_dir() {
        Ok(d) => d,
        Err(e) => fail(&format!(
            "cannot find the {PROTO_PACKAGE} package's sources: {e}"
        )),
    };
    let include = dir.join(INCLUDE);
    let protos: Vec<PathBuf> = PROTO_FILES.iter().map(|p| include.join(p)).collect();
    let fds = match protox::compile(&protos, [&include]) {
        Ok(f) => f,
        Err(e) => fail(&format!("compiling containerd's protos: {e}")),
    };
    let generated = tonic_prost_build::configure()
        // A client only, over a channel the caller builds (a unix socket connector).
        .build_server(false)
        .build_transport(false)
        .compile_fds(fds);
    if let Err(e) = generated {
        fail(&format!("generating the containerd clients: {e}"));
    }
}

/// The directory of the package as cargo resolved it (registry cache, vendor directory or
/// mirror). Offline first, so `cargo build --offline` and vendored builds never touch the
/// network; online only when the package has not been downloaded yet (cargo does not
/// download it for the build, since it is never compiled).
fn proto_package_dir() -> Result<PathBuf, String> {
    match metadata(true) {
        Ok(d) => Ok(d),
        Err(offline) => metadata(false).map_err(|online| {
            format!("cargo metadata --offline: {offline}; cargo metadata: {online}")
        }),
    }
}

fn metadata(offline: bool) -> Result<PathBuf, String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").ok_or("no CARGO_MANIFEST_DIR")?)
            .join("Cargo.toml");
    let mut cmd = Command::new(cargo);
    cmd.args([
        "metadata",
        "--format-version",
        "1",
        "--locked",
        "--manifest-path",
    ])
    .arg(&manifest);
    if offline {
        cmd.arg("--offline");
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    let json = String::from_utf8(out.stdout).map_err(|e| e.to_string())?;
    manifest_dir_of(&json, PROTO_PACKAGE)
        .ok_or_else(|| format!("{PROTO_PACKAGE} is not in cargo metadata's packages"))
}

/// The directory of package `name` in `cargo metadata`'s JSON (its `manifest_path` without
/// the file name).
fn manifest_dir_of(json: &str, name: &str) -> Option<PathBuf> {
    let meta: serde_json::Value = serde_json::from_str(json).ok()?;
    meta["packages"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["manifest_path"].as_str())
        .and_then(|m| PathBuf::from(m).parent().map(PathBuf::from))
}

fn fail(msg: &str) -> ! {
    eprintln!("error: edgehub-containerd-api: {msg}");
    std::process::exit(1);
}

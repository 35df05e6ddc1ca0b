//! Generates the CRI v1 client from the `k8s-cri` registry package's `proto/v1.proto`, with
//! protox (a protobuf compiler written in Rust) instead of a system `protoc`, so a Rust
//! toolchain alone builds edgehub: no protoc on developer machines, in `cross` images or in
//! Yocto's sysroot.
//!
//! The proto file is found through `cargo metadata`, which honours the same source
//! replacement (vendored crates, mirrors) as the build itself.

use std::path::PathBuf;
use std::process::Command;

/// The package that ships the proto, and the version pinned in Cargo.toml.
const PROTO_PACKAGE: &str = "k8s-cri";
const PROTO_FILE: &str = "proto/v1.proto";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=Cargo.toml");
    let dir = match proto_package_dir() {
        Ok(d) => d,
        Err(e) => fail(&format!(
            "cannot find the {PROTO_PACKAGE} package's sources: {e}"
        )),
    };
    let proto = dir.join(PROTO_FILE);
    let include = dir.join("proto");
    let fds = match protox::compile([&proto], [&include]) {
        Ok(f) => f,
        Err(e) => fail(&format!("compiling {}: {e}", proto.display())),
    };
    let generated = tonic_prost_build::configure()
        // edgehub is a CRI client: no server stubs, and the channel is built by the caller
        // (a unix socket connector), so no `connect(url)` helpers either.
        .build_server(false)
        .build_transport(false)
        .compile_fds(fds);
    if let Err(e) = generated {
        fail(&format!("generating the CRI client: {e}"));
    }
}

/// The directory of the `k8s-cri` package as cargo resolved it (registry cache, vendor
/// directory or mirror). Offline first, so `cargo build --offline` and vendored builds never
/// touch the network; online only when the package has not been downloaded yet (cargo does
/// not download it for the build, since it is never compiled).
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
    eprintln!("error: edgehub-cri-api: {msg}");
    std::process::exit(1);
}

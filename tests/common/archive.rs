//! Image archives for the side-load tests and benchmark, built the way scripts/cri-stack.sh
//! builds its test images (busybox-static in one layer, an OCI config printing a line), but
//! never pushed anywhere: no registry has them. Written as an OCI layout packed by `tar`
//! (what `skopeo copy ... oci-archive:` makes) or as a docker-archive (what `docker save`
//! makes).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn sha(bytes: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("the command runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn goarch() -> &'static str {
    match std::env::consts::ARCH {
        "aarch64" => "arm64",
        "x86_64" => "amd64",
        a => panic!("no test images for {a}"),
    }
}

/// An image built for a test.
pub struct Built {
    /// The OCI layout directory (unpacked).
    pub layout: PathBuf,
    /// `sha256:...` of the manifest.
    pub manifest: String,
    /// `sha256:...` of every blob (layer, config, manifest).
    pub blobs: Vec<String>,
    /// The uncompressed layer (for docker-archives).
    pub layer_tar: PathBuf,
    pub config_json: Vec<u8>,
    pub manifest_json: Vec<u8>,
}

/// Builds an image in `dir` whose container prints `line` every second, with `pad_bytes`
/// of random data in a second file of the layer (0 for none), named `name` in the index.
pub fn build(dir: &Path, name: &str, line: &str, pad_bytes: usize) -> Built {
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).expect("busybox-static is installed");
    for a in [
        "sh", "echo", "sleep", "true", "false", "cat", "ls", "ps", "date", "env", "hostname", "id",
    ] {
        let _ = std::os::unix::fs::symlink("busybox", root.join("bin").join(a));
    }
    for d in ["tmp", "etc", "proc", "sys", "dev"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    // Unique bytes per image: its blobs are new to containerd's store.
    std::fs::write(
        root.join("etc/image-id"),
        format!("{line}\n{}\n", fastrand::u64(..)),
    )
    .unwrap();
    if pad_bytes > 0 {
        let mut pad = vec![0u8; pad_bytes];
        fastrand::fill(&mut pad);
        std::fs::write(root.join("pad.bin"), pad).unwrap();
    }
    let layer_tar = dir.join("layer.tar");
    run(Command::new("tar")
        .arg("-C")
        .arg(&root)
        .args([
            "--sort=name",
            "--mtime=@0",
            "--numeric-owner",
            "--owner=0",
            "--group=0",
            "-cf",
        ])
        .arg(&layer_tar)
        .arg("."));
    let tar_bytes = std::fs::read(&layer_tar).unwrap();
    let diff_id = sha(&tar_bytes);
    let layer_gz = dir.join("layer.tar.gz");
    run(Command::new("sh").arg("-c").arg(format!(
        "gzip -1 -n -c '{}' > '{}'",
        layer_tar.display(),
        layer_gz.display()
    )));
    let gz = std::fs::read(&layer_gz).unwrap();
    let (layer, lsize) = (sha(&gz), gz.len());
    let layout = dir.join("oci");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(blobs.join(&layer), &gz).unwrap();
    let cmd = serde_json::json!([
        "sh",
        "-c",
        format!("while true; do echo '{line}'; sleep 1; done")
    ]);
    let config_json = serde_json::to_vec(&serde_json::json!({
        "architecture": goarch(), "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": cmd},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]}
    }))
    .unwrap();
    let config = sha(&config_json);
    std::fs::write(blobs.join(&config), &config_json).unwrap();
    let manifest_json = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{config}"), "size": config_json.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": format!("sha256:{layer}"), "size": lsize}]
    }))
    .unwrap();
    let built = Built {
        layout,
        manifest: String::new(),
        blobs: vec![format!("sha256:{layer}"), format!("sha256:{config}")],
        layer_tar,
        config_json,
        manifest_json: manifest_json.clone(),
    };
    with_manifest(built, manifest_json, name)
}

/// The same image with another manifest document (e.g. one byte changed): written as a blob
/// and named in index.json instead of the old one.
pub fn with_manifest(mut b: Built, manifest_json: Vec<u8>, name: &str) -> Built {
    let m = sha(&manifest_json);
    std::fs::write(b.layout.join("blobs/sha256").join(&m), &manifest_json).unwrap();
    std::fs::write(
        b.layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": format!("sha256:{m}"), "size": manifest_json.len(),
        "annotations": {"org.opencontainers.image.ref.name": name}}]});
    std::fs::write(
        b.layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    b.manifest = format!("sha256:{m}");
    b.blobs.truncate(2);
    b.blobs.push(b.manifest.clone());
    b.manifest_json = manifest_json;
    b
}

/// The OCI layout packed as an oci-archive at `out` (gzip when it ends in `.gz`), with the
/// layout's blobs first and index.json last, as skopeo writes it.
pub fn oci_archive(b: &Built, out: &Path) -> PathBuf {
    let z = if out.extension().is_some_and(|e| e == "gz") {
        "z"
    } else {
        ""
    };
    // Only the blobs index.json names (an old manifest may sit beside the new one).
    let mut names = vec!["oci-layout".to_string()];
    for d in &b.blobs {
        names.push(format!("blobs/sha256/{}", d.trim_start_matches("sha256:")));
    }
    names.push("index.json".into());
    run(Command::new("tar")
        .arg("-C")
        .arg(&b.layout)
        .arg(format!("-c{z}f"))
        .arg(out)
        .args(&names));
    out.to_path_buf()
}

/// The image as a docker-archive (`docker save`'s layout) at `out`, tagged `repo_tag`, its
/// layer named through a symlink as docker save names a shared one.
pub fn docker_archive(b: &Built, repo_tag: &str, out: &Path) -> PathBuf {
    let d = out.with_extension("d");
    let _ = std::fs::remove_dir_all(&d);
    let id = sha(&b.config_json);
    std::fs::create_dir_all(d.join("layer1")).unwrap();
    std::fs::copy(&b.layer_tar, d.join("layer1/layer.tar")).unwrap();
    std::fs::write(d.join("layer1/VERSION"), "1.0").unwrap();
    std::fs::write(d.join(format!("{id}.json")), &b.config_json).unwrap();
    // docker save links a layer two images share from the second one's directory.
    std::fs::create_dir_all(d.join("layer2")).unwrap();
    std::os::unix::fs::symlink("../layer1/layer.tar", d.join("layer2/layer.tar")).unwrap();
    let manifest = serde_json::json!([{"Config": format!("{id}.json"),
        "RepoTags": [repo_tag], "Layers": ["layer2/layer.tar"]}]);
    std::fs::write(
        d.join("manifest.json"),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
    run(Command::new("tar")
        .arg("-C")
        .arg(&d)
        .arg("-cf")
        .arg(out)
        .arg("."));
    out.to_path_buf()
}

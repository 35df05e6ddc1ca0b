//! The JSON of image archives, pure: an OCI layout's `index.json`, image indexes and
//! manifests, a docker-archive's `manifest.json`, the manifest built for a docker-archive, and
//! which manifest of an index is the device's.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
/// containerd's annotation with an image's full name (`ctr images export` writes it).
pub const CONTAINERD_NAME: &str = "io.containerd.image.name";
/// The OCI annotation with an image's name or tag (`skopeo copy ... oci-archive:F:NAME`).
pub const OCI_REF_NAME: &str = "org.opencontainers.image.ref.name";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {reason}")]
pub struct JsonError {
    pub what: String,
    pub reason: String,
}

fn parse<'a, T: Deserialize<'a>>(what: &str, bytes: &'a [u8]) -> Result<T, JsonError> {
    serde_json::from_slice(bytes).map_err(|e| JsonError {
        what: what.to_string(),
        reason: e.to_string(),
    })
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// The platform this binary runs on, in Go's names (as images carry them).
pub fn device_platform() -> Platform {
    let (architecture, variant) = match std::env::consts::ARCH {
        "x86_64" => ("amd64", None),
        "aarch64" => ("arm64", Some("v8")),
        "arm" => ("arm", Some("v7")),
        "x86" => ("386", None),
        "riscv64" => ("riscv64", None),
        "powerpc64" => ("ppc64le", None),
        "s390x" => ("s390x", None),
        other => (other, None),
    };
    Platform {
        architecture: architecture.to_string(),
        os: std::env::consts::OS.to_string(),
        variant: variant.map(str::to_string),
    }
}

/// Whether an image's platform runs on `device`: same OS and architecture, and the variant
/// unset on either side or equal (arm64's `v8` is the default).
pub fn runs_on(image: &Platform, device: &Platform) -> bool {
    image.os == device.os
        && image.architecture == device.architecture
        && match (&image.variant, &device.variant) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        }
}

/// A content descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: i64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
}

impl Descriptor {
    pub fn is_index(&self) -> bool {
        self.media_type == OCI_INDEX || self.media_type == DOCKER_LIST
    }

    /// The image name the archive gives this entry: containerd's full-name annotation, or
    /// the OCI ref name when it is a full reference (has a repository, not just a tag).
    pub fn archive_name(&self) -> Option<&str> {
        if let Some(n) = self.annotations.get(CONTAINERD_NAME) {
            return Some(n);
        }
        self.annotations
            .get(OCI_REF_NAME)
            .map(String::as_str)
            .filter(|n| n.contains('/') || n.contains(':'))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Index {
    #[serde(rename = "mediaType", default)]
    pub media_type: Option<String>,
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
}

pub fn parse_index(what: &str, bytes: &[u8]) -> Result<Index, JsonError> {
    parse(what, bytes)
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Manifest {
    #[serde(rename = "mediaType", default)]
    pub media_type: Option<String>,
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

pub fn parse_manifest(what: &str, bytes: &[u8]) -> Result<Manifest, JsonError> {
    parse(what, bytes)
}

/// The parts of an image config edgehub checks: its platform and its layers' diff ids.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Config {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
    #[serde(default)]
    pub rootfs: Option<RootFs>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RootFs {
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

impl Config {
    pub fn platform(&self) -> Platform {
        Platform {
            architecture: self.architecture.clone(),
            os: self.os.clone(),
            variant: self.variant.clone(),
        }
    }
}

pub fn parse_config(what: &str, bytes: &[u8]) -> Result<Config, JsonError> {
    parse(what, bytes)
}

/// The manifest of an index that runs on `device`: the first that matches, as containerd's
/// platform matcher takes it (an entry without a platform matches none).
pub fn pick_platform<'a>(index: &'a Index, device: &Platform) -> Option<&'a Descriptor> {
    index
        .manifests
        .iter()
        .find(|d| !d.is_index() && d.platform.as_ref().is_some_and(|p| runs_on(p, device)))
}

/// One image of a docker-archive's `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DockerImage {
    #[serde(rename = "Config")]
    pub config: String,
    #[serde(rename = "RepoTags", default)]
    pub repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers", default)]
    pub layers: Vec<String>,
}

pub fn parse_docker_manifest(bytes: &[u8]) -> Result<Vec<DockerImage>, JsonError> {
    parse("manifest.json", bytes)
}

/// The docker schema 2 manifest for a docker-archive image (the archive has none: `docker
/// save` writes only the config and the layers).
pub fn docker_manifest(config: &Descriptor, layers: &[Descriptor]) -> Vec<u8> {
    #[derive(Serialize)]
    struct Out<'a> {
        #[serde(rename = "schemaVersion")]
        schema_version: u32,
        #[serde(rename = "mediaType")]
        media_type: &'a str,
        config: &'a Descriptor,
        layers: &'a [Descriptor],
    }
    // Serializing plain structs of strings and integers cannot fail.
    serde_json::to_vec(&Out {
        schema_version: 2,
        media_type: DOCKER_MANIFEST,
        config,
        layers,
    })
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(digest: &str, arch: Option<&str>) -> Descriptor {
        Descriptor {
            media_type: OCI_MANIFEST.into(),
            digest: digest.into(),
            size: 1,
            annotations: BTreeMap::new(),
            platform: arch.map(|a| Platform {
                architecture: a.into(),
                os: "linux".into(),
                variant: None,
            }),
        }
    }

    #[test]
    fn the_device_manifest_of_an_index() {
        let index = Index {
            media_type: Some(OCI_INDEX.into()),
            manifests: vec![
                d("a", Some("s390x")),
                d("b", None),
                d("c", Some("amd64")),
                d("e", Some("arm64")),
            ],
        };
        let amd64 = Platform {
            architecture: "amd64".into(),
            os: "linux".into(),
            variant: None,
        };
        assert_eq!(pick_platform(&index, &amd64).unwrap().digest, "c");
        let arm64 = Platform {
            architecture: "arm64".into(),
            os: "linux".into(),
            variant: Some("v8".into()),
        };
        assert_eq!(pick_platform(&index, &arm64).unwrap().digest, "e");
        let riscv = Platform {
            architecture: "riscv64".into(),
            os: "linux".into(),
            variant: None,
        };
        assert!(pick_platform(&index, &riscv).is_none());
        assert!(!device_platform().architecture.is_empty());
    }

    #[test]
    fn archive_names_come_from_annotations() {
        let mut x = d("a", None);
        assert_eq!(x.archive_name(), None);
        x.annotations.insert(OCI_REF_NAME.into(), "2.0".into());
        assert_eq!(x.archive_name(), None, "a bare tag names no repository");
        x.annotations
            .insert(OCI_REF_NAME.into(), "127.0.0.1:5000/app:2.0".into());
        assert_eq!(x.archive_name(), Some("127.0.0.1:5000/app:2.0"));
        x.annotations
            .insert(CONTAINERD_NAME.into(), "docker.io/library/app:3".into());
        assert_eq!(x.archive_name(), Some("docker.io/library/app:3"));
    }

    #[test]
    fn docker_archive_json() {
        let m = parse_docker_manifest(
            br#"[{"Config":"abc.json","RepoTags":["app:1"],"Layers":["l1/layer.tar"]}]"#,
        )
        .unwrap();
        assert_eq!(m[0].layers, ["l1/layer.tar"]);
        assert_eq!(m[0].repo_tags.as_deref(), Some(&["app:1".to_string()][..]));
        assert!(parse_docker_manifest(b"{").is_err());
        let cfg = Descriptor {
            media_type: DOCKER_CONFIG.into(),
            ..d("sha256:c", None)
        };
        let out = docker_manifest(&cfg, &[]);
        let back = parse_manifest("m", &out).unwrap();
        assert_eq!(back.config.digest, "sha256:c");
        assert_eq!(back.media_type.as_deref(), Some(DOCKER_MANIFEST));
    }
}

//! What an import decides about an archive, without containerd: each entry judged as the
//! import judges it ([`super::entry::Judge`]), the JSON documents read (bounded) and parsed
//! as it parses them, the links followed, and the names the archive gives its images. The
//! same pure parts the import runs, on any bytes: for the fuzz target and the tests.

use super::entry::{resolve, Judge, Step};
use super::oci;
use super::reference::Reference;
use super::tarstream::read_full;
use super::tarstream::{Streamed, TarReader};
use super::ImageError;
use std::collections::HashMap;
use std::io::Read;

/// What an archive holds, as the import sees it before containerd.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inspected {
    pub entries: usize,
    /// Blobs by path: their digest when the path names it, and size.
    pub blobs: HashMap<String, (Option<String>, u64)>,
    pub links: HashMap<String, String>,
    /// The names the archive gives its images (index.json's annotations, manifest.json's
    /// RepoTags).
    pub names: Vec<String>,
    /// For a docker-archive, each image's config and layers as the links resolve them.
    pub docker_layers: Vec<Vec<String>>,
}

/// Reads the archive `reader` (gzip or not) as an import would, without writing anything.
pub fn inspect(reader: impl Read) -> Result<Inspected, ImageError> {
    let mut tr = TarReader::new(Streamed(super::import::tar_stream(reader)?));
    let mut judge = Judge::default();
    let mut out = Inspected::default();
    let mut meta: HashMap<String, Vec<u8>> = HashMap::new();
    while let Some(h) = tr.next_entry()? {
        out.entries += 1;
        match judge.judge(&h)? {
            Step::Skip => {}
            Step::Link { path, target } => {
                out.links.insert(path, target);
            }
            Step::Meta { path } => {
                // Bounded above by the judge.
                let mut buf = vec![0u8; h.size as usize];
                let n = read_full(&mut tr.data(), &mut buf).map_err(ImageError::from_io)?;
                if n as u64 != h.size {
                    return Err(ImageError::Truncated {
                        path,
                        got: n as u64,
                        want: h.size,
                    });
                }
                meta.insert(path, buf);
            }
            Step::Blob { path, digest } => {
                out.blobs.insert(path, (digest, h.size));
            }
        }
    }
    if out.entries == 0 {
        return Err(ImageError::Archive("the archive has no entries".into()));
    }
    if let Some(index) = meta.get("index.json") {
        for d in oci::parse_index("index.json", index)?.manifests {
            if let Some(n) = d.archive_name() {
                let r = Reference::parse(n)
                    .map_err(|e| ImageError::Archive(format!("index.json: {e}")))?;
                out.names.push(r.canonical());
            }
        }
    } else if let Some(m) = meta.get("manifest.json") {
        for img in oci::parse_docker_manifest(m)? {
            let mut resolved = vec![resolve(&out.blobs, &out.links, &img.config)?
                .0
                .clone()
                .unwrap_or_default()];
            for l in &img.layers {
                let (digest, size) = resolve(&out.blobs, &out.links, l)?;
                resolved.push(digest.clone().unwrap_or_else(|| format!("{size} bytes")));
            }
            out.docker_layers.push(resolved);
            for t in img.repo_tags.unwrap_or_default() {
                let r = Reference::parse(&t)
                    .map_err(|e| ImageError::Archive(format!("manifest.json: {e}")))?;
                out.names.push(r.canonical());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, path, data).unwrap();
    }

    #[test]
    fn a_docker_archive_with_a_shared_layer() {
        let d = "1111111111111111111111111111111111111111111111111111111111111111";
        let mut b = tar::Builder::new(Vec::new());
        file(&mut b, "l1/layer.tar", &[0u8; 1024]);
        file(&mut b, &format!("{d}.json"), b"{}");
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "l2/layer.tar", "../l1/layer.tar")
            .unwrap();
        let m = format!(
            r#"[{{"Config":"{d}.json","RepoTags":["app:1"],"Layers":["l1/layer.tar","l2/layer.tar"]}}]"#
        );
        file(&mut b, "manifest.json", m.as_bytes());
        let got = inspect(&b.into_inner().unwrap()[..]).unwrap();
        assert_eq!(got.entries, 4);
        assert_eq!(got.names, ["docker.io/library/app:1"]);
        assert_eq!(
            got.docker_layers,
            [vec![
                format!("sha256:{d}"),
                "1024 bytes".to_string(),
                "1024 bytes".to_string()
            ]]
        );
        assert!(inspect(&b""[..]).is_err());
        assert!(inspect(&[0u8; 1024][..]).is_err());
    }
}

//! An archive's entries, pure: what a path in the archive is, paths kept inside it, digests
//! as containerd names them.

use super::declare::Ledger;
use super::reference::is_sha256_digest;
use super::tarstream::{Header, Kind};
use super::ImageError;
use std::collections::HashMap;

/// The most bytes of an archive entry edgehub does not use (docker save's `VERSION` and
/// `json`, `repositories`): anything larger is not an image archive's, and would only cost
/// the time to pass over it.
pub const MAX_UNUSED: u64 = 1 << 20;
/// The most the paths of an archive's blobs and links, and the links' targets, may add up to,
/// each counting [`NAME_COST`] bytes more for its bookkeeping: what a reader remembers of an
/// archive's entries.
pub const MAX_NAMES: u64 = 1 << 20;
/// What remembering one entry costs besides its names.
const NAME_COST: u64 = 128;

/// What the remembered entries of one archive cost so far, against [`MAX_NAMES`].
#[derive(Debug, Default)]
pub(super) struct Names(u64);

impl Names {
    /// Counts one remembered entry; `Err` names the limit once they are too many.
    pub(super) fn take(&mut self, path: &str, target: Option<&str>) -> Result<(), String> {
        self.0 += path.len() as u64 + target.map_or(0, |t| t.len() as u64) + NAME_COST;
        if self.0 > MAX_NAMES {
            return Err(format!(
                "the paths of the archive's blobs and links add up to more than {MAX_NAMES} \
                 bytes (each counted {NAME_COST} bytes more)"
            ));
        }
        Ok(())
    }
}

/// Refuses an entry edgehub does not use that is larger than [`MAX_UNUSED`].
pub(super) fn check_unused(path: &str, size: u64) -> Result<(), String> {
    if size > MAX_UNUSED {
        return Err(format!(
            "entry {path:?} is {size} bytes and not part of an image; the most accepted for \
             such an entry is {MAX_UNUSED} bytes"
        ));
    }
    Ok(())
}

/// The largest JSON document read whole (index.json, manifest.json, manifests, configs).
/// Parsed, JSON can take ten times its size (a descriptor or annotation every few bytes), so
/// this bounds what an import holds; real ones are a few KiB (a config with a long history,
/// tens).
pub const MAX_JSON: usize = 1 << 20;

/// What an import does with one entry of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A link (docker save's shared layers): `path` stands for `target`.
    Link { path: String, target: String },
    /// index.json, manifest.json and the like: read whole (at most [`MAX_JSON`]).
    Meta { path: String },
    /// A blob, named `sha256:<hex>` by its path when it is.
    Blob {
        path: String,
        digest: Option<String>,
    },
    /// Nothing an image needs.
    Skip,
}

/// Decides each entry of one archive, pure: paths kept inside the archive, a link's target
/// taken from its directory, what is remembered of the entries bounded ([`Names`]), unused
/// entries and JSON documents bounded, and a declared stream held to its declaration.
#[derive(Debug, Default)]
pub struct Judge {
    names: Names,
    ledger: Option<Ledger>,
}

impl Judge {
    /// A judge that holds the stream to `ledger`, when it has one.
    pub fn new(ledger: Option<Ledger>) -> Judge {
        Judge {
            names: Names::default(),
            ledger,
        }
    }

    /// What to do with the entry `h`.
    pub fn judge(&mut self, h: &Header) -> Result<Step, ImageError> {
        let path = clean(&String::from_utf8_lossy(&h.path))?;
        let size = h.size;
        match h.kind {
            Kind::Symlink | Kind::HardLink => {
                let Some(target) = &h.link else {
                    return Ok(Step::Skip);
                };
                let target = String::from_utf8_lossy(target);
                // A symlink's target is from its directory, a hard link's from the top.
                let base = if h.kind == Kind::Symlink {
                    path.rsplit_once('/').map_or("", |(d, _)| d)
                } else {
                    ""
                };
                let target = clean(&format!("{base}/{target}"))?;
                self.names
                    .take(&path, Some(&target))
                    .map_err(ImageError::Limit)?;
                Ok(Step::Link { path, target })
            }
            Kind::Dir | Kind::Other => {
                check_unused(&path, size).map_err(ImageError::Limit)?;
                Ok(Step::Skip)
            }
            Kind::File => match classify(&path)? {
                Entry::Skip => {
                    check_unused(&path, size).map_err(ImageError::Limit)?;
                    Ok(Step::Skip)
                }
                Entry::Meta => {
                    if size > MAX_JSON as u64 {
                        return Err(ImageError::Limit(format!(
                            "{path} is {size} bytes; the most accepted is {MAX_JSON} bytes"
                        )));
                    }
                    Ok(Step::Meta { path })
                }
                Entry::Blob(digest) => {
                    if let Some(l) = &mut self.ledger {
                        l.admit(&path, digest.as_deref(), size)
                            .map_err(ImageError::Undeclared)?;
                    }
                    self.names.take(&path, None).map_err(ImageError::Limit)?;
                    Ok(Step::Blob { path, digest })
                }
            },
        }
    }
}

/// What `path` names, following the archive's links (eight at most: a loop ends).
pub fn resolve<'a, B>(
    blobs: &'a HashMap<String, B>,
    links: &HashMap<String, String>,
    path: &str,
) -> Result<&'a B, ImageError> {
    let mut p = clean(path)?;
    for _ in 0..8 {
        if let Some(b) = blobs.get(&p) {
            return Ok(b);
        }
        match links.get(&p) {
            Some(t) => p = t.clone(),
            None => break,
        }
    }
    Err(ImageError::Missing {
        what: format!("archive entry {path}"),
        digest: String::new(),
    })
}

pub(super) enum Entry {
    Meta,
    Blob(Option<String>),
    Skip,
}

/// What an archive entry is, by its path.
pub(super) fn classify(path: &str) -> Result<Entry, ImageError> {
    if matches!(
        path,
        "oci-layout" | "index.json" | "manifest.json" | "repositories"
    ) {
        return Ok(Entry::Meta);
    }
    if let Some(rest) = path.strip_prefix("blobs/") {
        let digest = rest.replacen('/', ":", 1);
        if !is_sha256_digest(&digest) {
            return Err(ImageError::Archive(format!(
                "blob {path}: only sha256 digests are supported"
            )));
        }
        return Ok(Entry::Blob(Some(digest)));
    }
    if let Some(hex) = path.strip_suffix(".json").filter(|h| !h.contains('/')) {
        let digest = format!("sha256:{hex}");
        if is_sha256_digest(&digest) {
            // A docker-archive's config, named for its digest.
            return Ok(Entry::Blob(Some(digest)));
        }
    }
    if path.ends_with("/layer.tar") || path.ends_with(".tar") {
        return Ok(Entry::Blob(None));
    }
    Ok(Entry::Skip)
}

/// A path inside the archive, without `./`, refused when it climbs out.
pub(super) fn clean(path: &str) -> Result<String, ImageError> {
    let mut parts = Vec::new();
    for p in path.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(ImageError::Archive(format!(
                        "entry {path:?} climbs out of the archive"
                    )));
                }
            }
            p => parts.push(p),
        }
    }
    Ok(parts.join("/"))
}

pub(super) fn sha256_hex(d: ring::digest::Digest) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(71);
    s.push_str("sha256:");
    for b in d.as_ref() {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_by_path() {
        let d = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert!(matches!(classify("index.json"), Ok(Entry::Meta)));
        assert!(matches!(classify("manifest.json"), Ok(Entry::Meta)));
        assert!(
            matches!(classify(&format!("blobs/sha256/{d}")), Ok(Entry::Blob(Some(x))) if x == format!("sha256:{d}"))
        );
        assert!(classify("blobs/sha512/abc").is_err());
        assert!(classify("blobs/sha256/ABC").is_err());
        assert!(matches!(
            classify(&format!("{d}.json")),
            Ok(Entry::Blob(Some(_)))
        ));
        assert!(matches!(
            classify(&format!("{d}/layer.tar")),
            Ok(Entry::Blob(None))
        ));
        assert!(matches!(classify(&format!("{d}/json")), Ok(Entry::Skip)));
        assert!(matches!(classify("VERSION"), Ok(Entry::Skip)));
    }

    #[test]
    fn archive_paths_stay_inside() {
        assert_eq!(clean("./blobs/sha256/x").unwrap(), "blobs/sha256/x");
        assert_eq!(clean("a//b/./c").unwrap(), "a/b/c");
        assert!(clean("../etc/passwd").is_err());
        assert!(clean("a/../../b").is_err());
        // docker save links a shared layer as ../<id>/layer.tar from its own directory.
        assert_eq!(clean("l2/../l1/layer.tar").unwrap(), "l1/layer.tar");
    }

    fn header(path: &str, kind: Kind, size: u64, link: Option<&str>) -> Header {
        Header {
            path: path.as_bytes().to_vec(),
            link: link.map(|l| l.as_bytes().to_vec()),
            kind,
            size,
            offset: 0,
        }
    }

    #[test]
    fn the_judge_decides_each_entry() {
        let d = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let mut j = Judge::default();
        let blob = format!("./blobs/sha256/{d}");
        assert_eq!(
            j.judge(&header(&blob, Kind::File, 10, None)).unwrap(),
            Step::Blob {
                path: format!("blobs/sha256/{d}"),
                digest: Some(format!("sha256:{d}"))
            }
        );
        assert_eq!(
            j.judge(&header(
                "l2/layer.tar",
                Kind::Symlink,
                0,
                Some("../l1/layer.tar")
            ))
            .unwrap(),
            Step::Link {
                path: "l2/layer.tar".into(),
                target: "l1/layer.tar".into()
            }
        );
        assert_eq!(
            j.judge(&header(
                "l3/layer.tar",
                Kind::HardLink,
                0,
                Some("l1/layer.tar")
            ))
            .unwrap(),
            Step::Link {
                path: "l3/layer.tar".into(),
                target: "l1/layer.tar".into()
            }
        );
        assert!(j
            .judge(&header("x", Kind::Symlink, 0, Some("../../etc/passwd")))
            .is_err());
        assert_eq!(
            j.judge(&header("index.json", Kind::File, 100, None))
                .unwrap(),
            Step::Meta {
                path: "index.json".into()
            }
        );
        let e = j
            .judge(&header("index.json", Kind::File, MAX_JSON as u64 + 1, None))
            .unwrap_err();
        assert!(matches!(e, ImageError::Limit(_)), "{e}");
        assert!(matches!(
            j.judge(&header("dev", Kind::Other, MAX_UNUSED + 1, None)),
            Err(ImageError::Limit(_))
        ));
        assert_eq!(
            j.judge(&header("VERSION", Kind::File, 3, None)).unwrap(),
            Step::Skip
        );
        // Held to a declaration.
        let mut j = Judge::new(Some(Ledger::new(&[])));
        assert!(matches!(
            j.judge(&header(&blob, Kind::File, 10, None)),
            Err(ImageError::Undeclared(_))
        ));
    }

    #[test]
    fn links_resolve_and_a_loop_ends() {
        let blobs = HashMap::from([("l1/layer.tar".to_string(), 1)]);
        let links = HashMap::from([
            ("l2/layer.tar".to_string(), "l1/layer.tar".to_string()),
            ("a".to_string(), "b".to_string()),
            ("b".to_string(), "a".to_string()),
        ]);
        assert_eq!(resolve(&blobs, &links, "l2/layer.tar").unwrap(), &1);
        assert_eq!(resolve(&blobs, &links, "./l1/layer.tar").unwrap(), &1);
        assert!(resolve(&blobs, &links, "a").is_err());
        assert!(resolve(&blobs, &links, "../x").is_err());
    }

    #[test]
    fn what_an_archive_costs_to_remember_is_bounded() {
        let mut n = Names::default();
        let path = "p".repeat(1000);
        let mut taken = 0;
        while n.take(&path, Some(&path)).is_ok() {
            taken += 1;
        }
        // 2128 bytes an entry: 492 fit in a mebibyte.
        assert_eq!(taken, 492);
        let e = n.take("x", None).unwrap_err();
        assert!(e.contains("1048576 bytes"), "{e}");
        assert!(check_unused("VERSION", MAX_UNUSED).is_ok());
        let e = check_unused("x", MAX_UNUSED + 1).unwrap_err();
        assert!(e.contains("1048577 bytes") && e.contains("1048576"), "{e}");
    }

    #[test]
    fn digests_print_as_containerd_names_them() {
        let d = ring::digest::digest(&ring::digest::SHA256, b"");
        assert_eq!(
            sha256_hex(d),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}

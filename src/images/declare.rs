//! The blobs a streamed archive declares ahead of its body, pure: the `Edgehub-Blobs` request
//! header, what it costs on the image filesystem, and the ledger that holds the stream to it.
//!
//! The header is a comma-separated list, one item per blob: `sha256:<hex>=<size>` for a blob
//! the archive names by its digest (an OCI layout's `blobs/sha256/<hex>`, docker save's
//! `<hex>.json`), a bare `<size>` for one it does not (docker save's `layer.tar`). The server
//! checks free space against the declared blobs containerd lacks before it writes anything,
//! then refuses (400) a blob the declaration does not list or lists with another size.

use super::reference::is_sha256_digest;
use std::collections::HashMap;

/// The request header.
pub const HEADER: &str = "edgehub-blobs";
/// The longest header the CLI sends; above it, it sends the archive's length only (the API
/// refuses a request head over 16 KiB).
pub const MAX_HEADER: usize = 12 << 10;
/// The most blobs a declaration may list.
const MAX_BLOBS: usize = 4096;

/// One declared blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    pub digest: Option<String>,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeclareError {
    #[error("{HEADER}: item {0:?} is neither sha256:<hex>=<size> nor <size>")]
    Item(String),
    #[error("{HEADER}: {0} declared twice with different sizes")]
    Conflict(String),
    #[error("{HEADER}: more than {MAX_BLOBS} blobs")]
    TooMany,
}

/// Parses the header's value.
pub fn parse(value: &str) -> Result<Vec<Declared>, DeclareError> {
    let mut out: Vec<Declared> = Vec::new();
    let mut sizes: HashMap<String, u64> = HashMap::new();
    for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        if out.len() == MAX_BLOBS {
            return Err(DeclareError::TooMany);
        }
        let bad = || DeclareError::Item(item.chars().take(100).collect());
        let (digest, size) = match item.rsplit_once('=') {
            Some((d, s)) => {
                if !is_sha256_digest(d) {
                    return Err(bad());
                }
                (Some(d.to_string()), s)
            }
            None => (None, item),
        };
        if size.is_empty() || !size.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let size: u64 = size.parse().map_err(|_| bad())?;
        if let Some(d) = &digest {
            match sizes.insert(d.clone(), size) {
                Some(s) if s != size => return Err(DeclareError::Conflict(d.clone())),
                Some(_) => continue,
                None => {}
            }
        }
        out.push(Declared { digest, size });
    }
    Ok(out)
}

/// The header's value for `blobs`.
pub fn format(blobs: &[Declared]) -> String {
    let items: Vec<String> = blobs
        .iter()
        .map(|b| match &b.digest {
            Some(d) => format!("{d}={}", b.size),
            None => b.size.to_string(),
        })
        .collect();
    items.join(",")
}

/// The header a client sends for `blobs`: `None` when it would be longer than
/// [`MAX_HEADER`] (the client then sends the archive's length alone).
pub fn header(blobs: &[Declared]) -> Option<String> {
    let h = format(blobs);
    (h.len() <= MAX_HEADER).then_some(h)
}

/// The blobs a scan found, as a declaration.
pub fn from_scan(s: &Scanned) -> Vec<Declared> {
    s.blobs
        .iter()
        .map(|b| Declared {
            digest: b.digest.clone(),
            size: b.size,
        })
        .collect()
}

/// The bytes `blobs` add to a content store that holds `present` (digest → size): every blob
/// it lacks (or holds with another size) once, and every blob without a digest.
pub fn bytes_to_add(blobs: &[Declared], present: &HashMap<String, u64>) -> u64 {
    let mut counted = std::collections::HashSet::new();
    let mut need = 0u64;
    for b in blobs {
        match &b.digest {
            Some(d) if present.get(d) == Some(&b.size) => {}
            Some(d) if !counted.insert(d.as_str()) => {}
            _ => need = need.saturating_add(b.size),
        }
    }
    need
}

/// Holds a stream to its declaration: each blob must be declared with its size; a blob
/// without a digest takes one undeclared-digest item of its size.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    named: HashMap<String, u64>,
    unnamed: Vec<u64>,
}

impl Ledger {
    pub fn new(blobs: &[Declared]) -> Ledger {
        let mut l = Ledger::default();
        for b in blobs {
            match &b.digest {
                Some(d) => {
                    l.named.insert(d.clone(), b.size);
                }
                None => l.unnamed.push(b.size),
            }
        }
        l
    }

    /// Whether the blob at `path` (`digest` when its path names it) of `size` bytes was
    /// declared; `Err` says why not.
    pub fn admit(&mut self, path: &str, digest: Option<&str>, size: u64) -> Result<(), String> {
        match digest {
            Some(d) => match self.named.get(d) {
                Some(&s) if s == size => Ok(()),
                Some(&s) => Err(format!(
                    "{path} is {size} bytes, the {HEADER} header declared {s}"
                )),
                None => Err(format!(
                    "{path} ({d}) is not in the {HEADER} header's declaration"
                )),
            },
            None => match self.unnamed.iter().position(|&s| s == size) {
                Some(i) => {
                    self.unnamed.swap_remove(i);
                    Ok(())
                }
                None => Err(format!(
                    "{path} ({size} bytes) is not in the {HEADER} header's declaration"
                )),
            },
        }
    }
}

// A scan's result (super::scan), what from_scan declares from: here, not in the scanner, so
// the imports among scan, entry (which keeps the ledger) and declare point one way.

/// A blob of the archive, as its tar header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedBlob {
    /// Its path in the archive.
    pub path: String,
    /// `sha256:<hex>` where the path names it.
    pub digest: Option<String>,
    pub size: u64,
}

/// What a scan found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Scanned {
    /// Each blob once (a digest the archive holds twice is listed once).
    pub blobs: Vec<ScannedBlob>,
    /// Whether the archive is gzip-compressed.
    pub gzip: bool,
}

impl Scanned {
    /// The bytes of every blob, counted once.
    pub fn total(&self) -> u64 {
        self.blobs.iter().map(|b| b.size).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn named(d: &str, size: u64) -> Declared {
        Declared {
            digest: Some(d.into()),
            size,
        }
    }

    #[test]
    fn the_header_parses_and_prints_back() {
        let v = format!("{A}=10, {B}=0,2048,");
        let d = parse(&v).unwrap();
        assert_eq!(
            d,
            vec![
                named(A, 10),
                named(B, 0),
                Declared {
                    digest: None,
                    size: 2048
                }
            ]
        );
        assert_eq!(format(&d), format!("{A}=10,{B}=0,2048"));
        assert_eq!(parse(&format(&d)).unwrap(), d);
        assert_eq!(parse("").unwrap(), vec![]);
        // The same blob twice, same size: once.
        assert_eq!(parse(&format!("{A}=1,{A}=1")).unwrap(), vec![named(A, 1)]);
    }

    #[test]
    fn a_declaration_too_long_for_a_header_is_not_sent() {
        let few = vec![named(A, 1 << 30); 3];
        assert_eq!(header(&few), Some(format(&few)));
        // 72 bytes and more a blob: 200 of them pass 12 KiB.
        let many: Vec<Declared> = (0..200u64).map(|i| named(A, i)).collect();
        assert_eq!(header(&many), None);
    }

    #[test]
    fn bad_headers_are_refused() {
        for bad in [
            "sha256:abc=1".to_string(),
            format!("{A}="),
            format!("{A}=-1"),
            format!("{A}=+1"),
            format!("{A}=1x"),
            format!("{A}=99999999999999999999999"),
            "sha512:00=1".to_string(),
            "ten".to_string(),
            A.to_string(),
            format!("{}=1", A.to_uppercase()),
        ] {
            assert!(
                matches!(parse(&bad), Err(DeclareError::Item(_))),
                "{bad}: {:?}",
                parse(&bad)
            );
        }
        assert_eq!(
            parse(&format!("{A}=1,{A}=2")),
            Err(DeclareError::Conflict(A.into()))
        );
        let many = vec!["1"; MAX_BLOBS + 1].join(",");
        assert_eq!(parse(&many), Err(DeclareError::TooMany));
    }

    #[test]
    fn only_what_the_store_lacks_costs_space() {
        let blobs = vec![
            named(A, 100),
            named(B, 7),
            named(B, 7),
            Declared {
                digest: None,
                size: 50,
            },
        ];
        let mut present = HashMap::new();
        assert_eq!(bytes_to_add(&blobs, &present), 157);
        present.insert(A.to_string(), 100);
        assert_eq!(bytes_to_add(&blobs, &present), 57);
        // Held with another size: not the blob declared.
        present.insert(B.to_string(), 8);
        assert_eq!(bytes_to_add(&blobs, &present), 57);
        present.insert(B.to_string(), 7);
        assert_eq!(bytes_to_add(&blobs, &present), 50);
    }

    #[test]
    fn the_ledger_admits_only_what_was_declared() {
        let mut l = Ledger::new(&[
            named(A, 10),
            Declared {
                digest: None,
                size: 5,
            },
        ]);
        assert!(l.admit("blobs/sha256/a", Some(A), 10).is_ok());
        // A digest the archive holds twice is still declared.
        assert!(l.admit("blobs/sha256/a", Some(A), 10).is_ok());
        let e = l.admit("blobs/sha256/a", Some(A), 11).unwrap_err();
        assert!(e.contains("11 bytes") && e.contains("declared 10"), "{e}");
        let e = l.admit("blobs/sha256/b", Some(B), 1).unwrap_err();
        assert!(e.contains("not in"), "{e}");
        assert!(l.admit("l1/layer.tar", None, 6).is_err());
        assert!(l.admit("l1/layer.tar", None, 5).is_ok());
        // Each undigested item once.
        assert!(l.admit("l2/layer.tar", None, 5).is_err());
    }
}

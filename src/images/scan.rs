//! A pre-scan of an archive file: the blobs it holds and their sizes, from the tar headers
//! alone, so the free space an import needs is known before it writes anything.
//!
//! A plain tar is read header by header, seeking over each payload (header plus size rounded
//! to 512 bytes); a gzip one is decompressed as a stream whose payload bytes are thrown away,
//! a buffer at a time. Either way no payload is held. A blob is named by its path where the
//! path says its digest (an OCI layout's `blobs/sha256/<hex>`, docker save's `<hex>.json`
//! config); docker save's `layer.tar` files have no digest until they are hashed, so they are
//! listed by size alone.

use super::entry::{check_unused, classify, clean, Entry, Names};
use super::tarstream::read_full;
use super::tarstream::{Kind, Seeked, Source, Streamed, TarError, TarReader};
use std::collections::HashSet;
use std::io::{BufReader, Read, Seek, SeekFrom};

pub use super::declare::{Scanned, ScannedBlob};

#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("reading the archive: {0}")]
    Io(#[source] std::io::Error),
    #[error("not a usable image archive: {0}")]
    Archive(String),
    #[error("the archive is truncated: {path} ends at byte {end}, the file has {len}")]
    Truncated { path: String, end: u64, len: u64 },
    #[error("over a limit: {0}")]
    Limit(String),
}

const GZIP: [u8; 2] = [0x1f, 0x8b];
/// The most a gzip archive may hold after the tar's end (its end blocks and padding to a
/// record are 10 KiB at most as tar writes them).
pub const MAX_TRAILER: u64 = 1 << 20;

/// Lists the blobs of the archive `r` (a plain or gzip tar), reading headers only.
pub fn scan<R: Read + Seek>(mut r: R) -> Result<Scanned, ScanError> {
    let len = r.seek(SeekFrom::End(0)).map_err(ScanError::Io)?;
    r.seek(SeekFrom::Start(0)).map_err(ScanError::Io)?;
    let mut magic = [0u8; 2];
    let n = read_full(&mut r, &mut magic).map_err(ScanError::Io)?;
    r.seek(SeekFrom::Start(0)).map_err(ScanError::Io)?;
    if n == 0 {
        return Err(ScanError::Archive("the archive is empty".into()));
    }
    if n == 2 && magic == GZIP {
        let gz = flate2::read::GzDecoder::new(BufReader::with_capacity(64 << 10, r));
        let mut tr = TarReader::new(Streamed(gz));
        let mut out = collect(&mut tr, None)?;
        out.gzip = true;
        // The rest (the tar's end blocks, gzip's trailer): a cut-off stream is an error here
        // too, as it will be for the import; bounded, so a gzip of zeros ends at once.
        let rest = tr.into_inner().0;
        let n = std::io::copy(&mut rest.take(MAX_TRAILER + 1), &mut std::io::sink())
            .map_err(|e| ScanError::Archive(format!("reading the archive: {e}")))?;
        if n > MAX_TRAILER {
            return Err(ScanError::Limit(format!(
                "more than {MAX_TRAILER} bytes follow the end of the archive"
            )));
        }
        Ok(out)
    } else {
        collect(&mut TarReader::new(Seeked(r)), Some(len))
    }
}

impl From<TarError> for ScanError {
    fn from(e: TarError) -> ScanError {
        match e {
            TarError::Limit(m) => ScanError::Limit(m),
            other => ScanError::Archive(other.to_string()),
        }
    }
}

/// The blobs of the archive `tr` reads; `len`, when the payloads were seeked over, is the
/// file's length, which every payload must end within.
fn collect<S: Source>(tr: &mut TarReader<S>, len: Option<u64>) -> Result<Scanned, ScanError> {
    let mut out = Scanned::default();
    let mut seen = HashSet::new();
    let mut names = Names::default();
    let mut any = false;
    while let Some(h) = tr.next_entry()? {
        any = true;
        let path = clean(&String::from_utf8_lossy(&h.path))
            .map_err(|e| ScanError::Archive(e.to_string()))?;
        let size = h.size;
        if let Some(len) = len {
            let end = h.offset.saturating_add(size);
            if end > len {
                return Err(ScanError::Truncated { path, end, len });
            }
        }
        // Links (docker save's shared layers) and directories add nothing.
        if h.kind != Kind::File {
            check_unused(&path, size).map_err(ScanError::Limit)?;
            continue;
        }
        match classify(&path).map_err(|e| ScanError::Archive(e.to_string()))? {
            Entry::Meta => {
                if size > super::entry::MAX_JSON as u64 {
                    return Err(ScanError::Limit(format!(
                        "{path} is {size} bytes; the most accepted is {} bytes",
                        super::entry::MAX_JSON
                    )));
                }
            }
            Entry::Skip => check_unused(&path, size).map_err(ScanError::Limit)?,
            Entry::Blob(digest) => {
                if let Some(d) = &digest {
                    if !seen.insert(d.clone()) {
                        continue;
                    }
                }
                names.take(&path, None).map_err(ScanError::Limit)?;
                out.blobs.push(ScannedBlob { path, digest, size });
            }
        }
    }
    if !any {
        return Err(ScanError::Archive("the archive has no entries".into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Cursor, Write};

    const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, path, data).unwrap();
    }

    fn oci_tar() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        file(&mut b, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
        file(&mut b, &format!("blobs/sha256/{D1}"), &[7u8; 3000]);
        file(&mut b, &format!("./blobs/sha256/{D2}"), &[1u8; 10]);
        // The same blob twice counts once.
        file(&mut b, &format!("blobs/sha256/{D1}"), &[7u8; 3000]);
        file(&mut b, "index.json", b"{}");
        b.into_inner().unwrap()
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(bytes).unwrap();
        z.finish().unwrap()
    }

    fn expected() -> Vec<ScannedBlob> {
        vec![
            ScannedBlob {
                path: format!("blobs/sha256/{D1}"),
                digest: Some(format!("sha256:{D1}")),
                size: 3000,
            },
            ScannedBlob {
                path: format!("blobs/sha256/{D2}"),
                digest: Some(format!("sha256:{D2}")),
                size: 10,
            },
        ]
    }

    #[test]
    fn a_plain_oci_archive_lists_its_blobs_by_digest() {
        let s = scan(Cursor::new(oci_tar())).unwrap();
        assert!(!s.gzip);
        assert_eq!(s.blobs, expected());
        assert_eq!(s.total(), 3010);
    }

    #[test]
    fn a_gzip_archive_is_scanned_as_a_stream() {
        let s = scan(Cursor::new(gzip(&oci_tar()))).unwrap();
        assert!(s.gzip);
        assert_eq!(s.blobs, expected());
    }

    #[test]
    fn a_plain_archive_is_seeked_over_not_read() {
        /// Counts the payload bytes read (the headers are 512 bytes a read at most).
        struct Counting(Cursor<Vec<u8>>, u64);
        impl Read for Counting {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.read(buf)?;
                self.1 += n as u64;
                Ok(n)
            }
        }
        impl Seek for Counting {
            fn seek(&mut self, p: SeekFrom) -> std::io::Result<u64> {
                self.0.seek(p)
            }
        }
        let mut b = tar::Builder::new(Vec::new());
        file(&mut b, &format!("blobs/sha256/{D1}"), &vec![0u8; 4 << 20]);
        file(&mut b, "index.json", b"{}");
        let mut c = Counting(Cursor::new(b.into_inner().unwrap()), 0);
        let s = scan(&mut c).unwrap();
        assert_eq!(s.total(), 4 << 20);
        assert!(c.1 < 64 << 10, "read {} bytes", c.1);
    }

    #[test]
    fn a_docker_archive_lists_its_config_by_digest_and_layers_by_size() {
        let mut b = tar::Builder::new(Vec::new());
        file(&mut b, "layer1/VERSION", b"1.0");
        file(&mut b, "layer1/layer.tar", &[0u8; 2048]);
        file(&mut b, &format!("{D1}.json"), b"{\"config\":{}}");
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "layer2/layer.tar", "../layer1/layer.tar")
            .unwrap();
        file(&mut b, "manifest.json", b"[]");
        let s = scan(Cursor::new(b.into_inner().unwrap())).unwrap();
        assert_eq!(
            s.blobs,
            vec![
                ScannedBlob {
                    path: "layer1/layer.tar".into(),
                    digest: None,
                    size: 2048
                },
                ScannedBlob {
                    path: format!("{D1}.json"),
                    digest: Some(format!("sha256:{D1}")),
                    size: 13
                },
            ]
        );
    }

    #[test]
    fn a_truncated_archive_is_an_error_plain_or_gzip() {
        let full = oci_tar();
        // Cut inside the first blob's payload.
        let cut = full[..1024 + 1000].to_vec();
        assert!(matches!(
            scan(Cursor::new(cut)),
            Err(ScanError::Truncated { end: 4536, .. })
        ));
        let z = gzip(&full);
        for n in [10, z.len() / 2, z.len() - 9] {
            assert!(scan(Cursor::new(z[..n].to_vec())).is_err(), "cut at {n}");
        }
    }

    /// Issue 31: the hostile shapes are refused, naming the limit, without taking in what
    /// their headers declare (the integration test measures the memory).
    #[test]
    fn hostile_extension_headers_are_refused_naming_the_limit() {
        use edgehub_testsupport::hostile_archive as hostile;
        for (what, bytes) in [
            ("long name", hostile::long_name_gzip(64 << 20)),
            ("pax", hostile::pax_gzip(64 << 20)),
        ] {
            let r = scan(Cursor::new(bytes));
            let e = r.expect_err(what).to_string();
            assert!(e.contains("65536"), "{what}: {e}");
        }
        // A gigabyte of zeros: the end of the archive at its first block.
        let r = scan(Cursor::new(hostile::zeros_gzip(64 << 20)));
        assert!(matches!(r, Err(ScanError::Archive(_))), "{r:?}");
    }

    #[test]
    fn garbage_and_empty_input_are_errors_never_panics() {
        assert!(matches!(
            scan(Cursor::new(Vec::new())),
            Err(ScanError::Archive(_))
        ));
        let mut seed = 7u64;
        for len in [1usize, 2, 511, 512, 513, 1024, 5000] {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (seed >> 33) as u8
                })
                .collect();
            assert!(scan(Cursor::new(junk.clone())).is_err(), "{len} bytes");
            let mut gz = GZIP.to_vec();
            gz.extend_from_slice(&junk);
            assert!(scan(Cursor::new(gz)).is_err(), "gzip magic + {len} bytes");
        }
        // A header whose size field is huge: truncated, not an allocation.
        let mut t = oci_tar();
        t[124..136].copy_from_slice(b"77777777777\0");
        let r = scan(Cursor::new(t));
        assert!(r.is_err(), "{r:?}");
        // A blob path with another algorithm is refused, as the import refuses it.
        let mut b = tar::Builder::new(Vec::new());
        file(&mut b, "blobs/sha512/abc", b"x");
        assert!(matches!(
            scan(Cursor::new(b.into_inner().unwrap())),
            Err(ScanError::Archive(_))
        ));
    }
}

use super::*;
use std::io::Cursor;

fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, path, data).unwrap();
}

fn link(b: &mut tar::Builder<Vec<u8>>, kind: tar::EntryType, path: &str, target: &str) {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(0);
    b.append_link(&mut h, path, target).unwrap();
}

/// An entry as read: (path, link, kind, payload).
type Read4 = (String, Option<String>, Kind, Vec<u8>);

/// Every entry.
fn all<S: Source>(r: &mut TarReader<S>) -> Result<Vec<Read4>, TarError> {
    let mut out = Vec::new();
    while let Some(h) = r.next_entry()? {
        let mut data = Vec::new();
        r.data().read_to_end(&mut data).unwrap();
        assert_eq!(data.len() as u64, h.size);
        out.push((
            String::from_utf8(h.path).unwrap(),
            h.link.map(|l| String::from_utf8(l).unwrap()),
            h.kind,
            data,
        ));
    }
    Ok(out)
}

fn header(name: &str, kind: u8, size: u64) -> [u8; 512] {
    edgehub_testsupport::hostile_archive::tar_header(name, kind, size)
}

#[test]
fn entries_paths_links_and_payloads_as_the_tar_crate_reads_them() {
    let long = format!("{}/layer.tar", "d".repeat(150));
    let mut b = tar::Builder::new(Vec::new());
    file(&mut b, "oci-layout", b"{}");
    file(&mut b, &long, &[5u8; 1000]);
    link(
        &mut b,
        tar::EntryType::Symlink,
        "l2/layer.tar",
        &format!("../{long}"),
    );
    link(&mut b, tar::EntryType::Link, "hard", "oci-layout");
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_size(0);
    b.append_data(&mut h, "blobs/", &[][..]).unwrap();
    file(&mut b, "index.json", b"{\"manifests\":[]}");
    let bytes = b.into_inner().unwrap();

    let got = all(&mut TarReader::new(Streamed(Cursor::new(bytes.clone())))).unwrap();
    let mut want = Vec::new();
    let mut ar = tar::Archive::new(Cursor::new(bytes.clone()));
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let mut data = Vec::new();
        e.read_to_end(&mut data).unwrap();
        let path = String::from_utf8(e.path_bytes().into_owned()).unwrap();
        let link = e
            .link_name_bytes()
            .map(|l| String::from_utf8(l.into_owned()).unwrap());
        want.push((path, link, data));
    }
    let got_plain: Vec<_> = got
        .iter()
        .map(|(p, l, _, d)| (p.clone(), l.clone(), d.clone()))
        .collect();
    assert_eq!(got_plain, want);
    let kinds: Vec<Kind> = got.iter().map(|g| g.2).collect();
    assert_eq!(
        kinds,
        [
            Kind::File,
            Kind::File,
            Kind::Symlink,
            Kind::HardLink,
            Kind::Dir,
            Kind::File
        ]
    );
    assert_eq!(got[1].0, long);
    // Seeked: the same entries.
    let seeked = all(&mut TarReader::new(Seeked(Cursor::new(bytes)))).unwrap();
    assert_eq!(seeked, got);
}

#[test]
fn a_pax_header_gives_path_link_and_a_size_over_the_header_field() {
    let mut tar = Vec::new();
    let records = "30 path=blobs/sha256/from-pax\n12 size=700\n";
    tar.extend_from_slice(&header("PaxHeaders/x", b'x', records.len() as u64));
    tar.extend_from_slice(records.as_bytes());
    tar.resize(1024, 0);
    // The header says 0 bytes; the PAX size wins.
    tar.extend_from_slice(&header("short-name", b'0', 0));
    tar.extend_from_slice(&[9u8; 700]);
    tar.resize(tar.len().div_ceil(512) * 512, 0);
    let l = "22 linkpath=../target\n";
    tar.extend_from_slice(&header("PaxHeaders/y", b'x', l.len() as u64));
    tar.extend_from_slice(l.as_bytes());
    tar.resize(tar.len().div_ceil(512) * 512, 0);
    tar.extend_from_slice(&header("a-link", b'2', 0));
    tar.extend_from_slice(&[0u8; 1024]);
    let got = all(&mut TarReader::new(Streamed(Cursor::new(tar)))).unwrap();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].0, "blobs/sha256/from-pax");
    assert_eq!(got[0].3, vec![9u8; 700]);
    assert_eq!(got[1].1.as_deref(), Some("../target"));
    assert_eq!(got[1].2, Kind::Symlink);
}

/// Counts the bytes read from the stream under the reader.
struct Counted<R>(R, u64);

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.0.read(buf)?;
        self.1 += n as u64;
        Ok(n)
    }
}

#[test]
fn an_oversized_extension_header_is_refused_before_it_is_read() {
    for kind in [b'L', b'K', b'x', b'g'] {
        let mut tar = header("././@LongLink", kind, MAX_EXTENSION + 1).to_vec();
        tar.resize(512 + (MAX_EXTENSION as usize + 1024), b'a');
        let mut r = TarReader::new(Streamed(Counted(Cursor::new(tar), 0)));
        let e = r.next_entry().unwrap_err();
        assert!(matches!(e, TarError::Limit(_)), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("65537 bytes") && msg.contains("65536 bytes"),
            "{msg}"
        );
        assert_eq!(r.into_inner().0 .1, 512, "only the header was read");
    }
    // At the limit: read, and used.
    let name = "n".repeat(MAX_EXTENSION as usize);
    let mut tar = header("././@LongLink", b'L', MAX_EXTENSION).to_vec();
    tar.extend_from_slice(name.as_bytes());
    tar.extend_from_slice(&header("short", b'0', 0));
    let got = all(&mut TarReader::new(Streamed(Cursor::new(tar)))).unwrap();
    assert_eq!(got[0].0, name);
}

/// Header blocks without end.
struct Endless(Cursor<[u8; 512]>);

impl Read for Endless {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.0.position() == 512 {
            self.0.set_position(0);
        }
        self.0.read(buf)
    }
}

#[test]
fn an_archive_of_too_many_entries_is_refused() {
    let src = Endless(Cursor::new(header("VERSION", b'0', 0)));
    let mut r = TarReader::new(Streamed(src));
    let mut n = 0u64;
    let e = loop {
        match r.next_entry() {
            Ok(Some(_)) => n += 1,
            Ok(None) => panic!("an endless archive ended"),
            Err(e) => break e,
        }
    };
    assert_eq!(n, MAX_ENTRIES);
    assert!(
        matches!(&e, TarError::Limit(m) if m.contains("65536 entries")),
        "{e}"
    );
}

#[test]
fn malformed_archives_are_errors() {
    let mut bad_sum = header("a", b'0', 0);
    bad_sum[0] = b'b';
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("checksum", bad_sum.to_vec()),
        ("cut header", header("a", b'0', 0)[..300].to_vec()),
        ("two long names", {
            let mut t = header("././@LongLink", b'L', 1).to_vec();
            t.resize(1024, b'a');
            t.extend_from_slice(&header("././@LongLink", b'L', 1));
            t.resize(2048, b'a');
            t
        }),
        ("extension without its entry", {
            let mut t = header("././@LongLink", b'L', 1).to_vec();
            t.resize(1024, b'a');
            t.extend_from_slice(&[0u8; 1024]);
            t
        }),
        ("sparse", header("s", b'S', 0).to_vec()),
        ("cut long name", {
            let mut t = header("././@LongLink", b'L', 600).to_vec();
            t.resize(700, b'a');
            t
        }),
        ("bad pax size", {
            let r = "11 size=x1\n";
            let mut t = header("p", b'x', r.len() as u64).to_vec();
            t.extend_from_slice(r.as_bytes());
            t.resize(1024, 0);
            t.extend_from_slice(&header("f", b'0', 0));
            t
        }),
        ("bad pax record", {
            let r = "99 path=x\n";
            let mut t = header("p", b'x', r.len() as u64).to_vec();
            t.extend_from_slice(r.as_bytes());
            t.resize(1024, 0);
            t.extend_from_slice(&header("f", b'0', 0));
            t
        }),
    ];
    for (what, bytes) in cases {
        let r = all(&mut TarReader::new(Streamed(Cursor::new(bytes))));
        assert!(r.is_err(), "{what}: {r:?}");
    }
    // A payload cut short: the entry's data ends early, and the next header is an error.
    let mut t = header("f", b'0', 5000).to_vec();
    t.resize(512 + 100, 1);
    let mut r = TarReader::new(Streamed(Cursor::new(t)));
    r.next_entry().unwrap().unwrap();
    let mut data = Vec::new();
    r.data().read_to_end(&mut data).unwrap();
    assert_eq!(data.len(), 100);
    assert!(r.next_entry().is_err());
}

#[test]
fn unread_payloads_are_seeked_over_in_a_file() {
    let mut b = tar::Builder::new(Vec::new());
    file(&mut b, "big", &vec![0u8; 4 << 20]);
    file(&mut b, "index.json", b"{}");
    let mut r = TarReader::new(Seeked(Counted(Cursor::new(b.into_inner().unwrap()), 0)));
    let first = r.next_entry().unwrap().unwrap();
    assert_eq!((first.size, first.offset), (4 << 20, 512));
    let second = r.next_entry().unwrap().unwrap();
    assert_eq!(second.path, b"index.json");
    assert!(r.next_entry().unwrap().is_none());
    assert!(r.next_entry().unwrap().is_none(), "the end stays the end");
    assert!(r.into_inner().0 .1 < 8 << 10);
}

impl<R: Read + Seek> Seek for Counted<R> {
    fn seek(&mut self, p: SeekFrom) -> io::Result<u64> {
        self.0.seek(p)
    }
}

//! Hostile image archives, small on the wire and huge once read, for the tests and benches
//! that check edgehub refuses them in bounded memory (issue 31):
//!
//! - [`long_name_gzip`]: a GNU long name (`././@LongLink`, type `L`) declaring `len` bytes;
//! - [`pax_gzip`]: a PAX extended header (type `x`) declaring `len` bytes;
//! - [`zeros_gzip`]: `len` zero bytes (a gzip bomb: the tar reader sees its end at once).
//!
//! The gzip is made without compressing `len` bytes: one mebibyte of zeros is compressed once,
//! ending on a full flush (byte-aligned, and decoded the same after any window of zeros), and
//! that block is repeated; the CRC is combined rather than computed over the zeros. A gibibyte
//! costs about a mebibyte and a few milliseconds to make, even in a debug build.

use flate2::{Compress, Compression, Crc, FlushCompress};

const MIB: u64 = 1 << 20;

/// A 512-byte ustar header for `name` (at most 100 bytes) of type `kind` and `size` bytes.
pub fn tar_header(name: &str, kind: u8, size: u64) -> [u8; 512] {
    let mut h = [0u8; 512];
    let n = name.as_bytes();
    h[..n.len().min(100)].copy_from_slice(&n[..n.len().min(100)]);
    let octal = |h: &mut [u8; 512], at: usize, width: usize, v: u64| {
        let s = format!("{v:0w$o}", w = width - 1);
        h[at..at + width - 1].copy_from_slice(s.as_bytes());
    };
    octal(&mut h, 100, 8, 0o644);
    octal(&mut h, 108, 8, 0);
    octal(&mut h, 116, 8, 0);
    octal(&mut h, 124, 12, size);
    octal(&mut h, 136, 12, 0);
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    h
}

/// A small regular file entry (header and padded data).
fn file_entry(name: &str, data: &[u8]) -> Vec<u8> {
    let mut out = tar_header(name, b'0', data.len() as u64).to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out
}

/// The gzip of `prefix`, then `zeros` zero bytes, then `suffix`.
pub fn gzip_with_zeros(prefix: &[u8], zeros: u64, suffix: &[u8]) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];
    let mut z = Compress::new(Compression::best(), false);
    let mut crc = Crc::new();
    let put = |z: &mut Compress, data: &[u8], flush: FlushCompress| -> Vec<u8> {
        let mut buf = Vec::with_capacity(data.len() / 2 + 4096);
        let start = z.total_in();
        loop {
            let done = (z.total_in() - start) as usize;
            if buf.capacity() - buf.len() < 4096 {
                buf.reserve(64 << 10);
            }
            let status = z
                .compress_vec(&data[done..], &mut buf, flush)
                .expect("deflate of bytes in memory");
            let all_in = (z.total_in() - start) as usize == data.len();
            let room_left = buf.capacity() > buf.len();
            if all_in && room_left {
                if matches!(flush, FlushCompress::Finish) {
                    if status == flate2::Status::StreamEnd {
                        return buf;
                    }
                } else {
                    return buf;
                }
            }
        }
    };
    // The prefix and enough zeros that any match a later block makes lands in zeros.
    let lead = zeros.min(64 << 10);
    let mut first = prefix.to_vec();
    first.resize(prefix.len() + lead as usize, 0);
    crc.update(&first);
    out.extend(put(&mut z, &first, FlushCompress::Full));
    let mut left = zeros - lead;
    if left >= MIB {
        let mib = vec![0u8; MIB as usize];
        let block = put(&mut z, &mib, FlushCompress::Full);
        let mut one = Crc::new();
        one.update(&mib);
        while left >= MIB {
            out.extend_from_slice(&block);
            crc.combine(&one);
            left -= MIB;
        }
    }
    let mut last = vec![0u8; left as usize];
    last.extend_from_slice(suffix);
    crc.update(&last);
    out.extend(put(&mut z, &last, FlushCompress::Finish));
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&(crc.amount()).to_le_bytes());
    out
}

/// What follows the hostile header: a small regular file and the end of the archive, so a
/// reader that took the header in whole finds a well-formed archive after it.
fn tail() -> Vec<u8> {
    let mut t = file_entry("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
    t.extend_from_slice(&[0u8; 1024]);
    t
}

/// A gzip tar whose first entry is a GNU long name (`././@LongLink`, type `L`) of `len` bytes
/// (zeros; `len` rounded up to 512).
pub fn long_name_gzip(len: u64) -> Vec<u8> {
    let len = len.div_ceil(512) * 512;
    gzip_with_zeros(&tar_header("././@LongLink", b'L', len), len, &tail())
}

/// A gzip tar whose first entry is a PAX extended header (type `x`) of `len` bytes: one record
/// whose length field claims them all, its value zeros (`len` rounded up to 512).
pub fn pax_gzip(len: u64) -> Vec<u8> {
    let len = len.div_ceil(512) * 512;
    let mut prefix = tar_header("./PaxHeaders/x", b'x', len).to_vec();
    let record = format!("{len} comment=");
    prefix.extend_from_slice(record.as_bytes());
    gzip_with_zeros(&prefix, len - record.len() as u64, &tail())
}

/// `len` zero bytes, gzip-compressed.
pub fn zeros_gzip(len: u64) -> Vec<u8> {
    gzip_with_zeros(&[], len, &[])
}

/// The three hostile shapes at `len` bytes each, by name.
pub fn all(len: u64) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("long-name", long_name_gzip(len)),
        ("pax-header", pax_gzip(len)),
        ("gzip-of-zeros", zeros_gzip(len)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn gunzip(b: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(b)
            .read_to_end(&mut out)
            .expect("a valid gzip stream, CRC and length included");
        out
    }

    #[test]
    fn the_gzip_is_valid_and_holds_what_it_says() {
        for zeros in [0u64, 10, 70 << 10, 3 * MIB + 5] {
            let b = gzip_with_zeros(b"head", zeros, b"tail");
            let out = gunzip(&b);
            assert_eq!(out.len() as u64, 8 + zeros);
            assert_eq!(&out[..4], b"head");
            assert!(out[4..out.len() - 4].iter().all(|&x| x == 0));
            assert_eq!(&out[out.len() - 4..], b"tail");
        }
    }

    #[test]
    fn the_shapes_are_small_on_the_wire() {
        let l = long_name_gzip(4 * MIB);
        let out = gunzip(&l);
        assert_eq!(out[156], b'L');
        assert_eq!(out.len() as u64, 512 + 4 * MIB + 1024 + 1024);
        let p = gunzip(&pax_gzip(4 * MIB));
        assert_eq!(p[156], b'x');
        assert!(p[512..].starts_with(format!("{} comment=", 4 * MIB).as_bytes()));
        // A gibibyte costs about a mebibyte.
        assert!(zeros_gzip(1 << 30).len() < 2 << 20);
    }
}

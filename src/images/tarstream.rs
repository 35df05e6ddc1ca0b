//! An image archive's tar stream, header by header, with every buffer it takes from the
//! archive bounded.
//!
//! The `tar` crate reads a GNU long name or link (types `L`, `K`) and a PAX header (`x`)
//! whole, however large its header says it is: a 4.7 MB gzip archive whose long name
//! declared a gibibyte took a gibibyte (issue 31). Its raw mode does not read them, but then
//! drops the size a PAX header gives an entry over 8 GiB. So this reader walks the blocks
//! itself, and the crate parses each 512-byte header (checksum, base-256 sizes, the ustar
//! prefix) and each PAX record: an extension header is refused, naming the limit, before a
//! byte of it is read when it is larger than [`MAX_EXTENSION`], and so is an archive of more
//! than [`MAX_ENTRIES`] headers. Payloads are never held: a caller reads an entry through
//! [`TarReader::data`], and what it leaves is skipped (read and dropped, or seeked over).

use std::io::{self, Read, Seek, SeekFrom};

/// The largest GNU long name or link, or PAX header, read (PATH_MAX is 4096).
pub const MAX_EXTENSION: u64 = 64 << 10;
/// The most headers (entries, extension headers included) an archive may have.
pub const MAX_ENTRIES: u64 = 1 << 16;
const BLOCK: u64 = 512;

/// What an entry is, as far as an image archive cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Symlink,
    HardLink,
    Dir,
    /// Devices, FIFOs, volume labels: nothing an image archive uses.
    Other,
}

/// One entry's header, its extension headers applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The entry's path as the archive spells it (at most [`MAX_EXTENSION`] bytes).
    pub path: Vec<u8>,
    /// A link's target.
    pub link: Option<Vec<u8>>,
    pub kind: Kind,
    /// The payload's length.
    pub size: u64,
    /// Where the payload starts in the (decompressed) stream.
    pub offset: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum TarError {
    #[error("reading the archive: {0}")]
    Io(#[source] io::Error),
    #[error("not a tar archive: {0}")]
    Malformed(String),
    #[error("over a limit: {0}")]
    Limit(String),
}

/// The stream under the reader: how it passes over bytes it does not read.
pub trait Source: Read {
    /// Passes over the next `n` bytes.
    fn skip(&mut self, n: u64) -> io::Result<()>;
}

/// A stream read from end to end (a pipe, a gzip decoder): skipped bytes are read and dropped.
pub struct Streamed<R>(pub R);

impl<R: Read> Read for Streamed<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<R: Read> Source for Streamed<R> {
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let got = io::copy(&mut (&mut self.0).take(n), &mut io::sink())?;
        if got < n {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the archive ends {} bytes early", n - got),
            ));
        }
        Ok(())
    }
}

/// A file: skipped bytes are seeked over (a skip past its end shows at the next read).
pub struct Seeked<R>(pub R);

impl<R: Read> Read for Seeked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<R: Read + Seek> Source for Seeked<R> {
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let n = i64::try_from(n).map_err(|_| io::Error::other("a skip past 2^63 bytes"))?;
        self.0.seek(SeekFrom::Current(n)).map(|_| ())
    }
}

/// Reads a tar stream header by header.
pub struct TarReader<S> {
    src: S,
    /// Bytes of the stream consumed (read or skipped).
    pos: u64,
    /// Payload bytes of the current entry not read yet.
    left: u64,
    /// Padding after the current entry's payload.
    pad: u64,
    headers: u64,
    ended: bool,
}

/// The extension headers seen before an entry.
#[derive(Default)]
struct Pending {
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
    pax: Option<Vec<u8>>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.long_name.is_none() && self.long_link.is_none() && self.pax.is_none()
    }
}

fn padding(size: u64) -> u64 {
    (BLOCK - size % BLOCK) % BLOCK
}

fn strip_nuls(mut v: Vec<u8>) -> Vec<u8> {
    while v.last() == Some(&0) {
        v.pop();
    }
    v
}

impl<S: Source> TarReader<S> {
    pub fn new(src: S) -> TarReader<S> {
        TarReader {
            src,
            pos: 0,
            left: 0,
            pad: 0,
            headers: 0,
            ended: false,
        }
    }

    /// The stream under the reader (for what follows the archive's end).
    pub fn into_inner(self) -> S {
        self.src
    }

    /// The next entry, the rest of the current one passed over; `None` at the archive's end
    /// (a zero block, or the stream's end at a header's place).
    pub fn next_entry(&mut self) -> Result<Option<Header>, TarError> {
        if self.ended {
            return Ok(None);
        }
        self.pass_rest()?;
        let mut pending = Pending::default();
        loop {
            let mut h = tar::Header::new_old();
            let at = self.pos;
            if !self.read_block(h.as_mut_bytes())? {
                return self.end(&pending);
            }
            if h.as_bytes().iter().all(|&b| b == 0) {
                return self.end(&pending);
            }
            self.headers += 1;
            if self.headers > MAX_ENTRIES {
                return Err(TarError::Limit(format!(
                    "the archive has more than {MAX_ENTRIES} entries"
                )));
            }
            check_sum(&h, at)?;
            let size = h
                .entry_size()
                .map_err(|e| TarError::Malformed(format!("header at byte {at}: {e}")))?;
            let ty = h.entry_type();
            let ext = match ty.as_byte() {
                b'L' => Some(("GNU long name (type L)", &mut pending.long_name)),
                b'K' => Some(("GNU long link name (type K)", &mut pending.long_link)),
                b'x' => Some(("PAX header (type x)", &mut pending.pax)),
                _ => None,
            };
            if let Some((what, slot)) = ext {
                if slot.is_some() {
                    return Err(TarError::Malformed(format!(
                        "two {what}s for one entry, the second at byte {at}"
                    )));
                }
                *slot = Some(self.read_extension(what, at, size)?);
                continue;
            }
            match ty.as_byte() {
                b'g' => {
                    // A PAX global header: nothing an image archive needs; bounded all the same.
                    self.bounded(format!("PAX global header (type g) at byte {at}"), size)?;
                    self.pass(size + padding(size))?;
                    continue;
                }
                b'S' => {
                    return Err(TarError::Malformed(format!(
                        "GNU sparse entry at byte {at}: not in image archives"
                    )))
                }
                _ => {}
            }
            return self.entry(&h, pending, size).map(Some);
        }
    }

    /// The current entry's payload (what [`Self::next_entry`] has not passed over yet).
    pub fn data(&mut self) -> Data<'_, S> {
        Data(self)
    }

    fn entry(
        &mut self,
        h: &tar::Header,
        pending: Pending,
        mut size: u64,
    ) -> Result<Header, TarError> {
        let mut path = pending.long_name;
        let mut link = pending.long_link;
        if let Some(pax) = &pending.pax {
            for ext in tar::PaxExtensions::new(pax) {
                let ext = ext.map_err(|e| {
                    TarError::Malformed(format!("a PAX header before byte {}: {e}", self.pos))
                })?;
                match ext.key_bytes() {
                    b"path" => path = Some(ext.value_bytes().to_vec()),
                    b"linkpath" => link = Some(ext.value_bytes().to_vec()),
                    b"size" => {
                        size = std::str::from_utf8(ext.value_bytes())
                            .ok()
                            .and_then(|s| s.parse().ok())
                            .ok_or_else(|| {
                                TarError::Malformed(format!(
                                    "a PAX size that is not a number before byte {}",
                                    self.pos
                                ))
                            })?;
                    }
                    _ => {}
                }
            }
        }
        let path = path.unwrap_or_else(|| h.path_bytes().into_owned());
        let ty = h.entry_type();
        let kind = if ty.is_file() {
            Kind::File
        } else if ty.is_symlink() {
            Kind::Symlink
        } else if ty.is_hard_link() {
            Kind::HardLink
        } else if ty.is_dir() {
            Kind::Dir
        } else {
            Kind::Other
        };
        let link = match kind {
            Kind::Symlink | Kind::HardLink => {
                link.or_else(|| h.link_name_bytes().map(|l| l.into_owned()))
            }
            _ => None,
        };
        self.left = size;
        self.pad = padding(size);
        Ok(Header {
            path,
            link,
            kind,
            size,
            offset: self.pos,
        })
    }

    fn end(&mut self, pending: &Pending) -> Result<Option<Header>, TarError> {
        self.ended = true;
        if !pending.is_empty() {
            return Err(TarError::Malformed(format!(
                "the archive ends at byte {} after an extension header, without its entry",
                self.pos
            )));
        }
        Ok(None)
    }

    fn bounded(&self, what: String, size: u64) -> Result<(), TarError> {
        if size > MAX_EXTENSION {
            return Err(TarError::Limit(format!(
                "the {what} is {size} bytes; the most accepted is {MAX_EXTENSION} bytes"
            )));
        }
        Ok(())
    }

    /// An extension header's payload, refused before it is read when it is too large.
    fn read_extension(&mut self, what: &str, at: u64, size: u64) -> Result<Vec<u8>, TarError> {
        self.bounded(format!("{what} at byte {at}"), size)?;
        // Bounded above: at most 64 KiB.
        let mut buf = vec![0u8; size as usize];
        let n = read_full(&mut self.src, &mut buf).map_err(TarError::Io)?;
        self.pos += n as u64;
        if n < buf.len() {
            return Err(TarError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the archive ends inside the {what} at byte {at}"),
            )));
        }
        self.pass(padding(size))?;
        Ok(strip_nuls(buf))
    }

    /// Reads a header block: `false` at the stream's end before its first byte.
    fn read_block(&mut self, buf: &mut [u8]) -> Result<bool, TarError> {
        let n = read_full(&mut self.src, buf).map_err(TarError::Io)?;
        self.pos += n as u64;
        match n {
            0 => Ok(false),
            n if n == buf.len() => Ok(true),
            n => Err(TarError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the archive ends inside a header ({n} of its 512 bytes)"),
            ))),
        }
    }

    fn pass(&mut self, n: u64) -> Result<(), TarError> {
        if n > 0 {
            self.src.skip(n).map_err(TarError::Io)?;
            self.pos = self.pos.saturating_add(n);
        }
        Ok(())
    }

    fn pass_rest(&mut self) -> Result<(), TarError> {
        let n = self.left.saturating_add(self.pad);
        self.left = 0;
        self.pad = 0;
        self.pass(n)
    }
}

fn check_sum(h: &tar::Header, at: u64) -> Result<(), TarError> {
    let b = h.as_bytes();
    let sum = b[..148]
        .iter()
        .chain(&b[156..])
        .fold(8 * 32u32, |a, &x| a + u32::from(x));
    match h.cksum() {
        Ok(c) if c == sum => Ok(()),
        Ok(_) => Err(TarError::Malformed(format!(
            "the header at byte {at} has a wrong checksum"
        ))),
        Err(e) => Err(TarError::Malformed(format!("the header at byte {at}: {e}"))),
    }
}

/// The current entry's payload; ends early (a short read) when the stream does.
pub struct Data<'a, S>(&'a mut TarReader<S>);

impl<S: Source> Read for Data<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let r = &mut *self.0;
        if r.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min(usize::try_from(r.left).unwrap_or(usize::MAX));
        let n = r.src.read(&mut buf[..want])?;
        r.left -= n as u64;
        r.pos += n as u64;
        Ok(n)
    }
}

/// Reads until `buf` is full or the reader ends.
pub(super) fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
#[path = "tarstream_tests.rs"]
mod tests;

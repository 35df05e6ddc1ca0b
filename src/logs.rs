//! Container logs read back from the files the CRI runtime writes, for `edgehub logs`: the
//! field engineer's first look at a pod on a device with no link, so everything here works
//! from local files alone.
//!
//! The pod runtime points each sandbox's log directory at `<data_dir>/pods/<uid>/logs` and
//! each container's log at `<container>_<attempt>.log` in it, where the attempt is the
//! container's restart count. The runtime (containerd, CRI-O) writes one record per line:
//!
//! ```text
//! 2026-11-30T23:12:43.713137255Z stdout F hello
//! ```
//!
//! that is an RFC 3339 timestamp, the stream, a tag (`F` ends a line, `P` is a part of a longer
//! one the runtime split) and the content. The output is what `kubectl logs` prints: the
//! contents only, parts joined into their line.
//!
//! The parsing, the choice of container and file and the `--tail` search are pure or work on
//! any `Read + Seek`, so they are unit-tested without a runtime; the API streams the output
//! (`src/api/logs.rs`, `src/kubelet_api/logs.rs`) through [`follow::pump`].

pub mod follow;
pub mod rotate;

use serde_json::Value;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Bytes read from a log file per step; also the size of one chunk of the API's response.
pub const READ_CHUNK: usize = 64 << 10;
/// A record longer than this is not the runtime's (containerd splits lines at 16 KiB); it is
/// skipped rather than held in memory.
const MAX_RECORD: usize = 1 << 20;
/// The annotation `kubectl logs` reads for the container to show when none is named.
pub const DEFAULT_CONTAINER_ANNOTATION: &str = "kubectl.kubernetes.io/default-container";

#[derive(Debug, thiserror::Error)]
pub enum LogsError {
    /// A query parameter the route does not know, or a value it cannot use.
    #[error("{0}")]
    BadQuery(String),
    #[error("container name {name:?}: {reason}")]
    InvalidContainer { name: String, reason: String },
    /// The kubelet's wording, so scripts written against `kubectl logs` recognise it.
    #[error("container {container} is not valid for pod {pod}")]
    NotInPod { container: String, pod: String },
    #[error("pod {pod} has no containers")]
    NoContainers { pod: String },
    #[error("container {container:?} in pod {pod} has not started yet: no logs")]
    NotStarted { container: String, pod: String },
    #[error("previous terminated container {container:?} in pod {pod} not found")]
    NoPrevious { container: String, pod: String },
    #[error("reading logs in {dir}: {source}")]
    Io {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// What a log request asks for, from the query string of the API route. The names are the
/// Kubernetes API's (`container`, `follow`, `previous`, `tailLines`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    pub container: Option<String>,
    pub follow: bool,
    pub previous: bool,
    /// The last N lines only; `None` is all of them.
    pub tail_lines: Option<u64>,
}

impl Options {
    /// Parses a query string. Unknown parameters are refused rather than ignored, so a
    /// `sinceSeconds` or `timestamps` a user expects from kubectl does not silently do nothing.
    pub fn from_query(query: Option<&str>) -> Result<Options, LogsError> {
        let mut o = Options::default();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, raw) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .map_err(|_| LogsError::BadQuery(format!("{key}: not UTF-8")))?;
            match key {
                "container" => {
                    crate::names::check_label(&value).map_err(|reason| {
                        LogsError::InvalidContainer {
                            name: value.to_string(),
                            reason,
                        }
                    })?;
                    o.container = Some(value.into_owned());
                }
                "follow" => o.follow = flag(key, &value)?,
                "previous" => o.previous = flag(key, &value)?,
                "tailLines" => {
                    let n: i64 = value.parse().map_err(|_| {
                        LogsError::BadQuery(format!("tailLines: {value:?} is not an integer"))
                    })?;
                    // kubectl's --tail=-1: everything.
                    o.tail_lines = u64::try_from(n).ok();
                }
                other => {
                    return Err(LogsError::BadQuery(format!(
                        "unsupported query parameter {other:?} (supported: container, follow, previous, tailLines)"
                    )))
                }
            }
        }
        Ok(o)
    }
}

fn flag(key: &str, value: &str) -> Result<bool, LogsError> {
    match value {
        "true" | "1" | "" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(LogsError::BadQuery(format!(
            "{key}: {value:?} is not true or false"
        ))),
    }
}

/// The container a request is served from, and the pod's containers for kubectl's
/// "Defaulted container" notice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub container: String,
    /// True when the request named no container and the pod has more than one.
    pub defaulted: bool,
    /// All containers, then init containers marked ` (init)`, as kubectl lists them.
    pub all: Vec<String>,
}

/// Picks the container of `pod` (its cached JSON) to read: the one asked for, which must be
/// one of the pod's containers or init containers; else the one named by the
/// `kubectl.kubernetes.io/default-container` annotation; else the first container, as
/// `kubectl logs` does.
pub fn choose_container(
    pod: &Value,
    pod_name: &str,
    requested: Option<&str>,
) -> Result<Choice, LogsError> {
    let names = |field: &str| -> Vec<String> {
        pod.pointer(&format!("/spec/{field}"))
            .and_then(Value::as_array)
            .map(|cs| {
                cs.iter()
                    .filter_map(|c| c["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let containers = names("containers");
    let init = names("initContainers");
    let all: Vec<String> = containers
        .iter()
        .cloned()
        .chain(init.iter().map(|c| format!("{c} (init)")))
        .collect();
    if let Some(c) = requested {
        if !containers.iter().chain(&init).any(|n| n == c) {
            return Err(LogsError::NotInPod {
                container: c.to_string(),
                pod: pod_name.to_string(),
            });
        }
        return Ok(Choice {
            container: c.to_string(),
            defaulted: false,
            all,
        });
    }
    let annotated = pod
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(DEFAULT_CONTAINER_ANNOTATION))
        .and_then(Value::as_str)
        .filter(|a| containers.iter().any(|c| c == a));
    let container = annotated
        .map(str::to_string)
        .or_else(|| containers.first().cloned())
        .ok_or_else(|| LogsError::NoContainers {
            pod: pod_name.to_string(),
        })?;
    Ok(Choice {
        container,
        defaulted: all.len() > 1,
        all,
    })
}

pub use crate::names::{log_file_name, parse_file_name};

/// Container log rotation (`[logs]`), the kubelet's container log manager's knobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogsConfig {
    /// A container's log is rotated once it is this large (the kubelet's
    /// `containerLogMaxSize`).
    pub max_size_bytes: u64,
    /// Files kept per container attempt, the one being written included (the kubelet's
    /// `containerLogMaxFiles`).
    pub max_files: usize,
    /// How often the logs' sizes are checked (`containerLogMonitorInterval`).
    pub monitor_interval: std::time::Duration,
}

/// Where the pod runtime has the CRI write a pod's container logs; `None` for a uid that
/// cannot name a directory (such a pod never ran: see `pod::desired::pod_dir`).
pub fn pod_log_dir(data_dir: &Path, pod_uid: &str) -> Option<PathBuf> {
    crate::names::check_uid(pod_uid).ok()?;
    Some(data_dir.join("pods").join(pod_uid).join("logs"))
}

/// The log files of `container` in `dir`, by attempt, oldest first: each attempt's current
/// file (`<container>_<attempt>.log`), also for an attempt whose current file is renamed
/// away for a moment by a rotation (only `<container>_<attempt>.log.<timestamp>` exists). A
/// missing directory (a pod that never started) has none.
pub fn attempts(dir: &Path, container: &str) -> io::Result<Vec<(u32, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut found = std::collections::BTreeSet::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if let Some((c, attempt)) = name.to_str().and_then(rotate::parse_any_file_name) {
            if c == container {
                found.insert(attempt);
            }
        }
    }
    Ok(found
        .into_iter()
        .map(|a| (a, dir.join(format!("{container}_{a}.log"))))
        .collect())
}

/// Opens a container attempt's current log file. In the moment a rotation has renamed it and
/// the runtime has not reopened it yet, the newest rotated file (uncompressed, the one just
/// renamed) is opened instead: it holds the latest lines, and a follower moves on to the new
/// file when it appears.
pub fn open_current(path: &Path) -> io::Result<std::fs::File> {
    match std::fs::File::open(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let (Some(dir), Some(name)) =
                (path.parent(), path.file_name().and_then(|n| n.to_str()))
            else {
                return Err(e);
            };
            let prefix = format!("{name}.");
            let newest = std::fs::read_dir(dir)?
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| {
                    n.starts_with(&prefix)
                        && !n.ends_with(rotate::COMPRESSED)
                        && !n.ends_with(rotate::TEMPORARY)
                })
                .max();
            match newest {
                Some(n) => std::fs::File::open(dir.join(n)),
                None => Err(e),
            }
        }
        other => other,
    }
}

/// The file to read: the newest attempt, or with `previous` the one before it.
pub fn pick(
    found: &[(u32, PathBuf)],
    previous: bool,
    container: &str,
    pod: &str,
) -> Result<(u32, PathBuf), LogsError> {
    let at = match (found.len(), previous) {
        (0, _) => {
            return Err(LogsError::NotStarted {
                container: container.to_string(),
                pod: pod.to_string(),
            })
        }
        (1, true) => {
            return Err(LogsError::NoPrevious {
                container: container.to_string(),
                pod: pod.to_string(),
            })
        }
        (n, true) => n - 2,
        (n, false) => n - 1,
    };
    Ok(found[at].clone())
}

/// Which output a record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// One record of a CRI log file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<'a> {
    pub timestamp: &'a str,
    pub stream: Stream,
    /// `P`: the runtime split a long line and more of it follows.
    pub partial: bool,
    pub content: &'a [u8],
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("no timestamp")]
    Timestamp,
    #[error("stream is neither stdout nor stderr")]
    Stream,
    #[error("tag is neither P nor F")]
    Tag,
}

/// Parses one record (without its newline): `<timestamp> <stream> <tag> <content>`. The tag
/// may carry more `:`-separated tags after the first, as the CRI allows.
pub fn parse_record(line: &[u8]) -> Result<Record<'_>, ParseError> {
    let mut fields = line.splitn(4, |b| *b == b' ');
    let timestamp = fields
        .next()
        .and_then(|t| std::str::from_utf8(t).ok())
        .filter(|t| looks_like_rfc3339(t))
        .ok_or(ParseError::Timestamp)?;
    let stream = match fields.next() {
        Some(b"stdout") => Stream::Stdout,
        Some(b"stderr") => Stream::Stderr,
        _ => return Err(ParseError::Stream),
    };
    let tag = fields.next().ok_or(ParseError::Tag)?;
    let partial = match tag.split(|b| *b == b':').next() {
        Some(b"P") => true,
        Some(b"F") => false,
        _ => return Err(ParseError::Tag),
    };
    // An empty line may come without the space before its (empty) content.
    let content = fields.next().unwrap_or(b"");
    Ok(Record {
        timestamp,
        stream,
        partial,
        content,
    })
}

/// `2026-11-30T23:12:43.713137255Z` or with an offset: enough to tell a record from noise
/// without a date library.
fn looks_like_rfc3339(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() >= 20
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[7] == b'-'
        && b[10] == b'T'
        && b[13] == b':'
}

/// Turns the bytes of a log file, fed in chunks of any size, into what `kubectl logs` prints:
/// each record's content, a newline after each `F` record and none after a `P` one, so a
/// split line comes out whole. Memory stays bounded by one record.
#[derive(Debug, Default)]
pub struct Decoder {
    /// The start of a record whose newline has not been read yet.
    carry: Vec<u8>,
    /// Inside a record longer than [`MAX_RECORD`]: dropping bytes up to its newline.
    skipping: bool,
    /// Records that were not the runtime's format, skipped.
    pub malformed: u64,
    /// What the kubelet's log options add: timestamps, a start time.
    pub shape: Shape,
    /// The next output starts a line (for the timestamp).
    mid_line: bool,
}

/// How records come out beyond their content, as the kubelet's `timestamps` and
/// `sinceSeconds`/`sinceTime` ask.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shape {
    /// Each line starts with its record's timestamp and a space.
    pub timestamps: bool,
    /// Records stamped before this (unix nanoseconds) are left out.
    pub since_nanos: Option<i128>,
}

/// An RFC 3339 timestamp (`2026-11-30T23:12:43.713137255Z`, or with a `+hh:mm` offset) as
/// unix nanoseconds; `None` when it is not one. Read byte by byte and as strictly as Go's
/// `time.Parse(time.RFC3339, ...)` reads the kubelet's `sinceTime` (digits only, each field in
/// its range, the day in its month; fractional digits past the ninth are dropped, as Go drops
/// them): the text comes from callers of the node API, so no index may fall inside a
/// character (issue 31: one did, and the panic aborted the agent).
pub fn rfc3339_nanos(t: &str) -> Option<i128> {
    let b = t.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let d = b.get(r)?;
        d.iter().all(u8::is_ascii_digit).then(|| {
            d.iter()
                .fold(0i64, |n, c| n * 10 + i64::from(c.saturating_sub(b'0')))
        })
    };
    if !looks_like_rfc3339(t) || b.get(16) != Some(&b':') {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || d < 1 || d > days_in_month(y, mo) || h > 23 || mi > 59 || s > 59 {
        return None;
    }
    let mut at = 19;
    let mut nanos: i64 = 0;
    if b.get(at) == Some(&b'.') {
        let digits = b[at + 1..]
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        if digits == 0 {
            return None;
        }
        for i in 0..9 {
            let digit = if i < digits { b[at + 1 + i] - b'0' } else { 0 };
            nanos = nanos * 10 + i64::from(digit);
        }
        at += 1 + digits;
    }
    let offset: i64 = match &b[at..] {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), _, _, b':', _, _] => {
            let (hh, mm) = (num(at + 1..at + 3)?, num(at + 4..at + 6)?);
            if hh > 23 || mm > 59 {
                return None;
            }
            let v = hh * 3600 + mm * 60;
            if *sign == b'-' {
                -v
            } else {
                v
            }
        }
        _ => return None,
    };
    // Days from 1970-01-01 to a civil date (Howard Hinnant's days_from_civil).
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + s - offset;
    Some(secs as i128 * 1_000_000_000 + nanos as i128)
}

/// The days of month `mo` (1 to 12) of year `y`.
fn days_in_month(y: i64, mo: i64) -> i64 {
    let leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
    match mo {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

impl Decoder {
    /// Decodes `chunk`, appending output to `out`. An incomplete last record waits in the
    /// decoder for the next chunk.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|b| *b == b'\n') {
            let (line, tail) = (&rest[..nl], &rest[nl + 1..]);
            rest = tail;
            if std::mem::take(&mut self.skipping) {
                self.carry.clear();
                continue;
            }
            if self.carry.is_empty() {
                self.emit(line, out);
            } else {
                let mut whole = std::mem::take(&mut self.carry);
                whole.extend_from_slice(line);
                self.emit(&whole, out);
            }
        }
        if self.skipping {
            return;
        }
        self.carry.extend_from_slice(rest);
        if self.carry.len() > MAX_RECORD {
            self.carry = Vec::new();
            self.skipping = true;
            self.malformed += 1;
        }
    }

    fn emit(&mut self, line: &[u8], out: &mut Vec<u8>) {
        match parse_record(line) {
            Ok(r) => {
                if let Some(since) = self.shape.since_nanos {
                    // A record whose stamp cannot be read is kept, as the kubelet keeps it.
                    if rfc3339_nanos(r.timestamp).is_some_and(|t| t < since) {
                        return;
                    }
                }
                if self.shape.timestamps && !self.mid_line {
                    out.extend_from_slice(r.timestamp.as_bytes());
                    out.push(b' ');
                }
                out.extend_from_slice(r.content);
                if r.partial {
                    self.mid_line = true;
                } else {
                    out.push(b'\n');
                    self.mid_line = false;
                }
            }
            Err(_) => self.malformed += 1,
        }
    }
}

/// The offset to start reading at so that exactly the last `n` lines come out. Scans
/// backwards in chunks from the end, so memory is one chunk plus one record however long the
/// file and however large `n`. A line ends at an `F` record; `P` records after the last `F`
/// (a line still being written) count as one more line, as they print. Bytes after the last
/// newline are a record still being written and not counted.
pub fn tail_start<R: Read + Seek>(r: &mut R, n: u64) -> io::Result<u64> {
    let len = r.seek(SeekFrom::End(0))?;
    if n == 0 {
        return Ok(len);
    }
    let mut buf = vec![0u8; READ_CHUNK];
    // Find the last newline: the end of the last complete record.
    let mut pos = len;
    let last_newline = loop {
        if pos == 0 {
            return Ok(0);
        }
        let take = (pos as usize).min(READ_CHUNK);
        pos -= take as u64;
        r.seek(SeekFrom::Start(pos))?;
        r.read_exact(&mut buf[..take])?;
        if let Some(i) = buf[..take].iter().rposition(|b| *b == b'\n') {
            break pos + i as u64;
        }
    };
    let mut counter = TailCounter { n, lines: 0 };
    // The record being assembled ends with the newline at `record_newline`; `tail` holds its
    // bytes that lie after `pos` (read in an earlier chunk).
    let mut record_newline = last_newline;
    let mut tail: Vec<u8> = Vec::new();
    let mut oversized = false;
    pos = last_newline;
    while pos > 0 {
        let take = (pos as usize).min(READ_CHUNK);
        let base = pos - take as u64;
        r.seek(SeekFrom::Start(base))?;
        r.read_exact(&mut buf[..take])?;
        let mut hi = take;
        while let Some(i) = buf[..hi].iter().rposition(|b| *b == b'\n') {
            let found = if std::mem::take(&mut oversized) {
                tail.clear();
                None
            } else if tail.is_empty() {
                counter.record(&buf[i + 1..hi], record_newline)
            } else {
                let mut whole = buf[i + 1..hi].to_vec();
                whole.extend_from_slice(&tail);
                tail.clear();
                counter.record(&whole, record_newline)
            };
            if let Some(off) = found {
                return Ok(off);
            }
            record_newline = base + i as u64;
            hi = i;
        }
        // What precedes the chunk's first newline belongs to a record that starts earlier.
        if tail.len() + hi > MAX_RECORD {
            // Not the runtime's format: drop it instead of holding it in memory.
            tail.clear();
            oversized = true;
        } else {
            let mut head = buf[..hi].to_vec();
            head.extend_from_slice(&tail);
            tail = head;
        }
        pos = base;
    }
    if !oversized {
        if let Some(off) = counter.record(&tail, record_newline) {
            return Ok(off);
        }
    }
    Ok(0)
}

/// Counts lines over records seen from the end of a file, for [`tail_start`].
struct TailCounter {
    n: u64,
    lines: u64,
}

impl TailCounter {
    /// One record (without its newline, which is at `newline`). Returns the offset to start
    /// reading at when the `n` lines are already counted and this record ends the line
    /// before them.
    fn record(&mut self, record: &[u8], newline: u64) -> Option<u64> {
        let Ok(r) = parse_record(record) else {
            return None;
        };
        // An F record ends a line; so does the last record of the file when it is a P (a
        // line still being written). Other P records belong to the line their F ends.
        if r.partial && self.lines > 0 {
            return None;
        }
        if self.lines == self.n {
            return Some(newline + 1);
        }
        self.lines += 1;
        None
    }
}

/// A log file being read: the open file and its decoder.
#[derive(Debug)]
pub struct LogReader<R> {
    file: R,
    decoder: Decoder,
    buf: Vec<u8>,
}

impl LogReader<std::fs::File> {
    /// Opens the current file of the attempt at `path` ([`open_current`]), positioned for the
    /// last `tail` lines (all of them when `None`).
    pub fn open(path: &Path, tail: Option<u64>) -> io::Result<LogReader<std::fs::File>> {
        LogReader::new(open_current(path)?, tail)
    }

    /// Whether `path` now names another file than the one being read: a rotation renamed
    /// this one and the runtime reopened the log. A missing `path` (mid-rotation) is not.
    pub fn rotated_away(&self, path: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        let (Ok(now), Ok(ours)) = (std::fs::metadata(path), self.file.metadata()) else {
            return false;
        };
        (now.dev(), now.ino()) != (ours.dev(), ours.ino())
    }

    /// Goes on with the new file at `path`, from its start, keeping the decoder (a line the
    /// runtime split across the rotation still comes out whole).
    pub fn follow_to(&mut self, path: &Path) -> io::Result<()> {
        self.file = std::fs::File::open(path)?;
        Ok(())
    }
}

impl<R: Read + Seek> LogReader<R> {
    pub fn new(mut file: R, tail: Option<u64>) -> io::Result<LogReader<R>> {
        let start = match tail {
            Some(n) => tail_start(&mut file, n)?,
            None => 0,
        };
        file.seek(SeekFrom::Start(start))?;
        Ok(LogReader {
            file,
            decoder: Decoder::default(),
            buf: vec![0u8; READ_CHUNK],
        })
    }

    /// Reads one chunk of what the file holds now and appends the output to `out`. Returns
    /// the bytes read: 0 at the current end of the file (which may still grow).
    pub fn read_some(&mut self, out: &mut Vec<u8>) -> io::Result<usize> {
        let n = self.file.read(&mut self.buf)?;
        self.decoder.feed(&self.buf[..n], out);
        Ok(n)
    }

    /// Sets what each record adds beyond its content (timestamps, a start time).
    pub fn set_shape(&mut self, shape: Shape) {
        self.decoder.shape = shape;
    }

    /// Records skipped because they were not in the runtime's format.
    pub fn malformed(&self) -> u64 {
        self.decoder.malformed
    }
}

#[cfg(test)]
mod tests;

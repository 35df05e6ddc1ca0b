use super::*;
use serde_json::json;
use std::io::Cursor;

const TS: &str = "2026-11-30T23:12:43.713137255Z";

fn rec(stream: &str, tag: &str, content: &str) -> String {
    format!("{TS} {stream} {tag} {content}\n")
}

fn decode(bytes: &[u8]) -> (String, u64) {
    let mut d = Decoder::default();
    let mut out = Vec::new();
    d.feed(bytes, &mut out);
    (String::from_utf8(out).unwrap(), d.malformed)
}

/// Everything a reader positioned for `tail` prints.
fn read_all(file: &[u8], tail: Option<u64>) -> String {
    let mut r = LogReader::new(Cursor::new(file.to_vec()), tail).unwrap();
    let mut out = Vec::new();
    while r.read_some(&mut out).unwrap() > 0 {}
    String::from_utf8(out).unwrap()
}

#[test]
fn records_parse() {
    let line = format!("{TS} stdout F hello world");
    let r = parse_record(line.as_bytes()).unwrap();
    assert_eq!(
        r,
        Record {
            timestamp: TS,
            stream: Stream::Stdout,
            partial: false,
            content: b"hello world"
        }
    );
    let line = format!("{TS} stderr P part");
    let r = parse_record(line.as_bytes()).unwrap();
    assert_eq!(
        (r.stream, r.partial, r.content),
        (Stream::Stderr, true, &b"part"[..])
    );
    // More tags after the first, as the CRI allows.
    assert!(
        parse_record(format!("{TS} stdout P:x part").as_bytes())
            .unwrap()
            .partial
    );
    // Empty lines, with and without the separating space.
    assert_eq!(
        parse_record(format!("{TS} stdout F ").as_bytes())
            .unwrap()
            .content,
        b""
    );
    assert_eq!(
        parse_record(format!("{TS} stdout F").as_bytes())
            .unwrap()
            .content,
        b""
    );
    // Content keeps its own spaces, leading ones too.
    assert_eq!(
        parse_record(format!("{TS} stdout F   indented").as_bytes())
            .unwrap()
            .content,
        b"  indented"
    );
    let offset = "2026-11-30T23:12:43.713+01:00 stdout F x";
    assert!(parse_record(offset.as_bytes()).is_ok());
}

#[test]
fn malformed_records_are_refused() {
    assert_eq!(parse_record(b"hello"), Err(ParseError::Timestamp));
    assert_eq!(parse_record(b""), Err(ParseError::Timestamp));
    assert_eq!(
        parse_record(format!("{TS} stdin F x").as_bytes()),
        Err(ParseError::Stream)
    );
    assert_eq!(
        parse_record(format!("{TS} stdout").as_bytes()),
        Err(ParseError::Tag)
    );
    assert_eq!(
        parse_record(format!("{TS} stdout X x").as_bytes()),
        Err(ParseError::Tag)
    );
}

#[test]
fn partial_records_are_joined_into_their_line() {
    let file = [
        rec("stdout", "P", "a long "),
        rec("stdout", "P", "line in "),
        rec("stdout", "F", "three parts"),
        rec("stderr", "F", "an error"),
        rec("stdout", "F", ""),
        rec("stdout", "F", "last"),
    ]
    .concat();
    let (out, bad) = decode(file.as_bytes());
    assert_eq!(out, "a long line in three parts\nan error\n\nlast\n");
    assert_eq!(bad, 0);
}

#[test]
fn chunk_boundaries_do_not_matter() {
    let file = [
        rec("stdout", "P", "split "),
        rec("stdout", "F", "line"),
        rec("stderr", "F", "ünïcödé"),
        "garbage\n".to_string(),
        rec("stdout", "F", "end"),
    ]
    .concat();
    let (whole, bad) = decode(file.as_bytes());
    assert_eq!(whole, "split line\nünïcödé\nend\n");
    assert_eq!(bad, 1, "the garbage line is skipped and counted");
    for size in [1, 2, 3, 7, 31, 64] {
        let mut d = Decoder::default();
        let mut out = Vec::new();
        for chunk in file.as_bytes().chunks(size) {
            d.feed(chunk, &mut out);
        }
        assert_eq!(String::from_utf8(out).unwrap(), whole, "chunks of {size}");
    }
}

#[test]
fn an_incomplete_record_waits_for_its_newline() {
    let mut d = Decoder::default();
    let mut out = Vec::new();
    d.feed(
        format!("{TS} stdout F first\n{TS} stdout F sec").as_bytes(),
        &mut out,
    );
    assert_eq!(out, b"first\n");
    d.feed(b"ond\n", &mut out);
    assert_eq!(out, b"first\nsecond\n");
}

#[test]
fn an_oversized_record_is_skipped_not_buffered() {
    let mut d = Decoder::default();
    let mut out = Vec::new();
    let junk = vec![b'x'; MAX_RECORD / 4];
    for _ in 0..6 {
        d.feed(&junk, &mut out);
    }
    assert!(d.carry.len() <= MAX_RECORD, "memory stays bounded");
    d.feed(format!("\n{TS} stdout F after").as_bytes(), &mut out);
    d.feed(b"\n", &mut out);
    assert_eq!(out, b"after\n");
    assert_eq!(d.malformed, 1);
}

/// A file of `lines` lines, every third one split into parts, some on stderr, long enough to
/// cross several read chunks. Returns the file and the lines as printed.
fn big_file(lines: usize) -> (Vec<u8>, Vec<String>) {
    let mut file = String::new();
    let mut printed = Vec::new();
    for i in 0..lines {
        let text = format!("line {i} {}", "x".repeat(i % 50));
        let stream = if i % 5 == 0 { "stderr" } else { "stdout" };
        if i % 3 == 0 {
            let (a, b) = text.split_at(4);
            file.push_str(&rec(stream, "P", a));
            file.push_str(&rec(stream, "F", b));
        } else {
            file.push_str(&rec(stream, "F", &text));
        }
        printed.push(format!("{text}\n"));
    }
    (file.into_bytes(), printed)
}

#[test]
fn tail_prints_exactly_the_last_lines() {
    let (file, printed) = big_file(3000);
    assert!(file.len() > 3 * READ_CHUNK, "crosses read chunks");
    assert_eq!(read_all(&file, None), printed.concat());
    for n in [0u64, 1, 2, 3, 10, 999, 1000, 2999, 3000, 3001, 100_000] {
        let want = printed[printed.len().saturating_sub(n as usize)..].concat();
        assert_eq!(read_all(&file, Some(n)), want, "--tail {n}");
    }
}

#[test]
fn tail_counts_a_line_still_being_written() {
    let file = [
        rec("stdout", "F", "one"),
        rec("stdout", "F", "two"),
        rec("stdout", "P", "three, "),
        rec("stdout", "P", "unfinished"),
        // A record whose newline has not been written yet is not counted or printed.
        format!("{TS} stdout F fo"),
    ]
    .concat();
    assert_eq!(read_all(file.as_bytes(), Some(1)), "three, unfinished");
    assert_eq!(read_all(file.as_bytes(), Some(2)), "two\nthree, unfinished");
    assert_eq!(
        read_all(file.as_bytes(), Some(9)),
        "one\ntwo\nthree, unfinished"
    );
}

#[test]
fn tail_of_odd_files() {
    assert_eq!(read_all(b"", Some(3)), "");
    assert_eq!(read_all(format!("{TS} stdout F x").as_bytes(), Some(3)), "");
    let junk_first = format!("not a record\n{}", rec("stdout", "F", "ok"));
    assert_eq!(read_all(junk_first.as_bytes(), Some(5)), "ok\n");
    assert_eq!(
        read_all(rec("stdout", "F", "only").as_bytes(), Some(1)),
        "only\n"
    );
}

#[test]
fn query_options() {
    assert_eq!(Options::from_query(None).unwrap(), Options::default());
    assert_eq!(Options::from_query(Some("")).unwrap(), Options::default());
    let o = Options::from_query(Some("container=app&follow=true&previous=1&tailLines=20")).unwrap();
    assert_eq!(
        o,
        Options {
            container: Some("app".into()),
            follow: true,
            previous: true,
            tail_lines: Some(20)
        }
    );
    assert_eq!(
        Options::from_query(Some("tailLines=-1"))
            .unwrap()
            .tail_lines,
        None
    );
    assert!(!Options::from_query(Some("follow=false")).unwrap().follow);
    assert_eq!(
        Options::from_query(Some("container=my%2Dapp"))
            .unwrap()
            .container
            .as_deref(),
        Some("my-app")
    );
    for bad in [
        "tailLines=x",
        "follow=yes",
        "sinceSeconds=10",
        "container=App",
        "container=a%2Fb",
        "container=",
        "container=%FF",
    ] {
        assert!(Options::from_query(Some(bad)).is_err(), "{bad}");
    }
}

fn pod(containers: &[&str], init: &[&str], annotation: Option<&str>) -> Value {
    let list = |ns: &[&str]| {
        ns.iter()
            .map(|n| json!({"name": n, "image": "x"}))
            .collect::<Vec<_>>()
    };
    let mut p = json!({"metadata": {"name": "p", "namespace": "ns"},
        "spec": {"containers": list(containers), "initContainers": list(init)}});
    if let Some(a) = annotation {
        p["metadata"]["annotations"] = json!({ DEFAULT_CONTAINER_ANNOTATION: a });
    }
    p
}

#[test]
fn the_container_is_the_one_asked_for_or_kubectls_default() {
    let p = pod(&["app", "sidecar"], &["setup"], None);
    let c = choose_container(&p, "ns/p", Some("sidecar")).unwrap();
    assert_eq!((c.container.as_str(), c.defaulted), ("sidecar", false));
    assert_eq!(
        choose_container(&p, "ns/p", Some("setup"))
            .unwrap()
            .container,
        "setup"
    );
    let c = choose_container(&p, "ns/p", None).unwrap();
    assert_eq!((c.container.as_str(), c.defaulted), ("app", true));
    assert_eq!(c.all, ["app", "sidecar", "setup (init)"]);
    let err = choose_container(&p, "ns/p", Some("nope")).unwrap_err();
    assert_eq!(err.to_string(), "container nope is not valid for pod ns/p");

    let annotated = pod(&["app", "sidecar"], &[], Some("sidecar"));
    assert_eq!(
        choose_container(&annotated, "ns/p", None)
            .unwrap()
            .container,
        "sidecar"
    );
    // An annotation naming no container of the pod is ignored, as kubectl does.
    let stale = pod(&["app", "sidecar"], &[], Some("gone"));
    assert_eq!(
        choose_container(&stale, "ns/p", None).unwrap().container,
        "app"
    );

    let single = pod(&["app"], &[], None);
    assert!(!choose_container(&single, "ns/p", None).unwrap().defaulted);
    assert!(matches!(
        choose_container(&pod(&[], &[], None), "ns/p", None),
        Err(LogsError::NoContainers { .. })
    ));
}

#[test]
fn file_names() {
    assert_eq!(parse_file_name("app_0.log"), Some(("app", 0)));
    assert_eq!(parse_file_name("my-app_12.log"), Some(("my-app", 12)));
    for bad in [
        "app.log",
        "app_.log",
        "_1.log",
        "app_1.txt",
        "app_x.log",
        "app_-1.log",
        "app_99999999999.log",
    ] {
        assert_eq!(parse_file_name(bad), None, "{bad}");
    }
}

#[test]
fn attempts_are_found_and_the_newest_or_previous_picked() {
    let dir = tempfile::tempdir().unwrap();
    assert!(attempts(&dir.path().join("missing"), "app")
        .unwrap()
        .is_empty());
    for f in [
        "app_0.log",
        "app_1.log",
        "app_10.log",
        "app_2.log",
        "sidecar_0.log",
        "other",
    ] {
        std::fs::write(dir.path().join(f), "").unwrap();
    }
    let found = attempts(dir.path(), "app").unwrap();
    let nums: Vec<u32> = found.iter().map(|(a, _)| *a).collect();
    assert_eq!(nums, [0, 1, 2, 10], "numeric order, not lexical");
    assert_eq!(pick(&found, false, "app", "ns/p").unwrap().0, 10);
    assert_eq!(pick(&found, true, "app", "ns/p").unwrap().0, 2);

    let one = attempts(dir.path(), "sidecar").unwrap();
    let err = pick(&one, true, "sidecar", "ns/p").unwrap_err();
    assert_eq!(
        err.to_string(),
        "previous terminated container \"sidecar\" in pod ns/p not found"
    );
    assert!(matches!(
        pick(&[], false, "x", "ns/p"),
        Err(LogsError::NotStarted { .. })
    ));
    assert_eq!(
        pod_log_dir(Path::new("/var/lib/edgehub"), "u-1").as_deref(),
        Some(Path::new("/var/lib/edgehub/pods/u-1/logs"))
    );
}

#[test]
fn log_paths_come_only_from_names_that_stay_in_their_directory() {
    assert_eq!(log_file_name("app", 3).unwrap(), "app_3.log");
    assert_eq!(
        parse_file_name(&log_file_name("app", 3).unwrap()),
        Some(("app", 3))
    );
    for bad in ["../../../evil", "a/b", "..", "", "App"] {
        assert!(log_file_name(bad, 0).is_err(), "{bad:?}");
    }
    let data = Path::new("/var/lib/edgehub");
    assert_eq!(
        pod_log_dir(data, "b6a7f3c2-0d5e"),
        Some(PathBuf::from("/var/lib/edgehub/pods/b6a7f3c2-0d5e/logs"))
    );
    for bad in ["..", ".", "a/b", "", "../x"] {
        assert_eq!(pod_log_dir(data, bad), None, "{bad:?}");
    }
}

#[test]
fn rfc3339_stamps_as_unix_nanoseconds() {
    assert_eq!(rfc3339_nanos("1970-01-01T00:00:00Z"), Some(0));
    assert_eq!(
        rfc3339_nanos("2026-11-29T18:42:49.5Z"),
        Some(1_795_977_769_500_000_000)
    );
    assert_eq!(
        rfc3339_nanos("2026-11-29T20:42:49.000000001+02:00"),
        Some(1_795_977_769_000_000_001)
    );
    assert_eq!(rfc3339_nanos("2026-11-29T18:42:49"), None);
    assert_eq!(rfc3339_nanos("yesterday"), None);
    assert_eq!(rfc3339_nanos("2026-11-29T18:42:49.Z"), None);
}

/// Issue 31: a `sinceTime` with a multi-byte character where the offset's `:` belongs
/// (`+00é0`, six bytes) made the offset check slice inside the character, a panic that
/// aborts the agent. Every malformed stamp is `None`, whatever its bytes.
#[test]
fn malformed_stamps_are_none_never_a_panic() {
    for bad in [
        "2026-01-01T00:00:00+00\u{e9}0",
        "2026-01-01T00:00:00+0\u{e9}00",
        "2026-01-01T00:00:00+\u{e9}:00",
        "2026-01-01T00:00:00\u{e9}",
        "2026-01-01T00:00:00.\u{e9}Z",
        "2026-01-01T00:00:\u{e9}Z",
        "2026-01-01T00:00:0\u{e9}Z",
        "2026-01-01T00:\u{e9}:00Z",
        "2026-\u{e9}1T00:00:00Z",
        "\u{e9}026-01-01T00:00:00Z",
        "2026-01-01T00:00:00+\u{1f600}",
        "2026-01-01T00:00:00-\u{1f600}0",
    ] {
        assert_eq!(rfc3339_nanos(bad), None, "{bad:?}");
    }
    // Every prefix and every byte position of a valid stamp with a character put in.
    let good = "2026-11-29T20:42:49.000000001+02:00";
    for at in 0..=good.len() {
        let mut s = good[..at].to_string();
        if at < good.len() {
            assert_eq!(rfc3339_nanos(&s), None, "a prefix: {s:?}");
        }
        s.push('\u{e9}');
        s.push_str(&good[at..]);
        assert_eq!(rfc3339_nanos(&s), None, "{s:?}");
    }
}

/// What Go's `time.Parse(time.RFC3339, ...)` refuses is refused: signs and spaces in the
/// numbers, fields out of range, a bad offset.
#[test]
fn stamps_out_of_range_are_none() {
    for bad in [
        "2026-13-01T00:00:00Z",
        "2026-00-01T00:00:00Z",
        "2026-02-30T00:00:00Z",
        "2026-01-32T00:00:00Z",
        "2026-01-01T24:00:00Z",
        "2026-01-01T00:60:00Z",
        "2026-01-01T00:00:60Z",
        "2026-+1-01T00:00:00Z",
        "2026-01--1T00:00:00Z",
        "2026-01-01T+1:00:00Z",
        "2026-01-01T00:00:00+24:00",
        "2026-01-01T00:00:00+02:60",
        "2026-01-01T00:00:00+-1:00",
        "2026-01-01T00:00:00+02-00",
        "2026-01-01T00:00:00+02:00Z",
    ] {
        assert_eq!(rfc3339_nanos(bad), None, "{bad:?}");
    }
    assert_eq!(
        rfc3339_nanos("2024-02-29T00:00:00-00:30"),
        Some(1_709_166_600_000_000_000)
    );
    // Go drops fractional digits past the ninth.
    assert_eq!(
        rfc3339_nanos("1970-01-01T00:00:01.1234567899999Z"),
        Some(1_123_456_789)
    );
}

#[test]
fn timestamps_start_lines_and_since_leaves_older_records_out() {
    let file = "2026-11-30T10:00:00.000000001Z stdout F old\n\
                2026-11-30T10:00:05Z stdout P new \n\
                2026-11-30T10:00:06Z stdout F and whole\n\
                2026-11-30T10:00:07Z stderr F last\n";
    let mut d = Decoder {
        shape: Shape {
            timestamps: true,
            since_nanos: None,
        },
        ..Decoder::default()
    };
    let mut out = Vec::new();
    d.feed(file.as_bytes(), &mut out);
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "2026-11-30T10:00:00.000000001Z old\n2026-11-30T10:00:05Z new and whole\n2026-11-30T10:00:07Z last\n"
    );
    let mut d = Decoder {
        shape: Shape {
            timestamps: false,
            since_nanos: rfc3339_nanos("2026-11-30T10:00:05Z"),
        },
        ..Decoder::default()
    };
    let mut out = Vec::new();
    d.feed(file.as_bytes(), &mut out);
    assert_eq!(String::from_utf8(out).unwrap(), "new and whole\nlast\n");
}

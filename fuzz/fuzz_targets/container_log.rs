//! A container's CRI log file as `kubectl logs` and `edgehub logs` read it, whatever its bytes
//! (a file cut by a power loss, a runtime's bug, a disk's): the record parser, the decoder fed
//! in chunks of any size, and the `--tail` search from the end. None may panic, the decoder's
//! output never outgrows its input nor depends on how the input was chunked, and a tail of
//! `n` lines holds at most `n` whole lines.
#![no_main]

use edgehub::logs::{self, Decoder, Shape};
use libfuzzer_sys::fuzz_target;
use std::io::Cursor;

fuzz_target!(|data: &[u8]| {
    // First bytes: the chunk size, the options, the tail; the rest is the file.
    let [chunk, flags, tail, file @ ..] = data else {
        return;
    };
    let shape = Shape {
        timestamps: flags & 1 != 0,
        since_nanos: (flags & 2 != 0).then_some(1_795_977_769_000_000_000),
    };
    for line in file.split(|b| *b == b'\n') {
        if let Ok(r) = logs::parse_record(line) {
            let _ = logs::rfc3339_nanos(r.timestamp);
        }
    }
    let decode = |step: usize| {
        let mut d = Decoder::default();
        d.shape = shape;
        let mut out = Vec::new();
        for c in file.chunks(step.max(1)) {
            d.feed(c, &mut out);
        }
        out
    };
    let whole = decode(file.len());
    assert!(whole.len() <= file.len(), "the output outgrew the file");
    assert_eq!(decode(usize::from(*chunk)), whole, "chunking changed the output");

    let n = u64::from(*tail % 16);
    let start = logs::tail_start(&mut Cursor::new(file), n).expect("a cursor reads");
    assert!(start as usize <= file.len());
    let mut reader =
        logs::LogReader::new(Cursor::new(file), Some(n)).expect("a cursor reads");
    let mut out = Vec::new();
    while reader.read_some(&mut out).expect("a cursor reads") > 0 {}
    let lines = out.iter().filter(|b| **b == b'\n').count() as u64;
    assert!(lines <= n, "{lines} lines for a tail of {n}");
});

//! The importer's decisions on arbitrary bytes (`images::inspect`: each tar header judged as
//! the import judges it, extension headers, paths, links, index.json and manifest.json parsed,
//! links followed, the names images get), plain and gzip-compressed: never a panic, never more
//! memory than its limits, and the same answer either way.
#![no_main]

use edgehub::images::inspect::inspect;
use libfuzzer_sys::fuzz_target;
use std::io::Write;

fuzz_target!(|data: &[u8]| {
    let plain = inspect(data);
    // Empty bytes are "empty", their gzip "no entries"; bytes that start as gzip does are
    // read as gzip, plain: nothing to compare.
    if data.is_empty() || data.starts_with(&[0x1f, 0x8b]) {
        return;
    }
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    z.write_all(data).unwrap();
    let gz = z.finish().unwrap();
    let zipped = inspect(&gz[..]);
    match (&plain, &zipped) {
        (Ok(p), Ok(z)) => assert_eq!(p, z),
        (Err(p), Err(z)) => assert_eq!(p.to_string(), z.to_string()),
        _ => panic!("plain {plain:?}, gzip {zipped:?}"),
    }
});

//! The image archive scanner (`images::scan`, what the drop directory and `edgehub images load
//! FILE` read before an import) on arbitrary bytes, as a plain tar and gzip-compressed: never a
//! panic, never more memory than its limits, and a gzip archive that scans scans the same
//! plain.
#![no_main]

use edgehub::images::scan::scan;
use libfuzzer_sys::fuzz_target;
use std::io::{Cursor, Write};

fuzz_target!(|data: &[u8]| {
    let plain = scan(Cursor::new(data));
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    z.write_all(data).unwrap();
    let gz = z.finish().unwrap();
    let zipped = scan(Cursor::new(&gz));
    // Bytes that start as gzip does are read as gzip, plain: nothing to compare.
    if let (Ok(z), false) = (&zipped, data.starts_with(&[0x1f, 0x8b])) {
        match &plain {
            Ok(p) => assert_eq!(p.blobs, z.blobs),
            Err(e) => panic!("scans as gzip, not plain: {e}"),
        }
    }
});

//! The `Edgehub-Blobs` declaration (`images::declare`) on arbitrary header values: never a
//! panic; what parses prints back to itself, and the ledger admits every blob declared.
#![no_main]

use edgehub::images::declare::{self, Ledger};
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(blobs) = declare::parse(value) else {
        return;
    };
    let printed = declare::format(&blobs);
    assert_eq!(declare::parse(&printed).as_ref(), Ok(&blobs), "{printed}");
    if let Some(h) = declare::header(&blobs) {
        assert!(h.len() <= declare::MAX_HEADER);
    }
    let all: u64 = blobs.iter().fold(0u64, |a, b| a.saturating_add(b.size));
    assert!(declare::bytes_to_add(&blobs, &HashMap::new()) <= all);
    let mut ledger = Ledger::new(&blobs);
    for (i, b) in blobs.iter().enumerate() {
        let path = format!("entry-{i}");
        ledger
            .admit(&path, b.digest.as_deref(), b.size)
            .unwrap_or_else(|e| panic!("{printed}: {e}"));
    }
});

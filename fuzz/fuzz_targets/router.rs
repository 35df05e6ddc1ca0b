//! The local API's request router and path parser on arbitrary method and path bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let (method, path) = s.split_once(' ').unwrap_or(("GET", s));
    if let Ok(route) = edgehub::api::router::route(method, path) {
        // Whatever is routed has names that passed the DNS-1123 checks.
        let _ = route.name();
    }
    let _ = edgehub::local_client::upgrade_path(s, "upgrade");
});

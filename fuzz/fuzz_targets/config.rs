//! The configuration reader: a TOML file, `EDGEHUB_*` environment variables and the content
//! of `identity.node_name_file`, resolved into a `Config` (`Config::resolve_reading`, what
//! `edgehub run` and `edgehub check-config` call). Whatever the file says, the answer is a
//! config whose invariants hold, or an error naming a field: never a panic.
#![no_main]

use edgehub::config::{Config, Overrides};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    // Parts split by NUL: the TOML text, `KEY=value` lines (KEY without its EDGEHUB_
    // prefix), the node-name file's content.
    let mut parts = data.splitn(3, |b| *b == 0);
    let Ok(text) = std::str::from_utf8(parts.next().unwrap_or_default()) else {
        return;
    };
    let env: Vec<(String, String)> = String::from_utf8_lossy(parts.next().unwrap_or_default())
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (format!("EDGEHUB_{k}"), v.to_string()))
        .collect();
    let name_file = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let read = |_: &Path| Ok(name_file.clone());
    let resolve = || {
        Config::resolve_reading(
            Some(text),
            Path::new("/etc/edgehub/config.toml"),
            &env,
            &Overrides::default(),
            Some("edge-1".into()),
            &read,
        )
    };
    let Ok(c) = resolve() else {
        return;
    };
    assert!(edgehub::names::check_subdomain(&c.node_name).is_ok());
    assert!(c.data_dir.is_absolute() && c.cri_socket.is_absolute());
    assert!(
        c.api_addr.is_some() || c.api.socket.is_some(),
        "nothing could reach the local API"
    );
    assert!(c.api.socket_mode <= 0o777);
    assert!(c.api.socket.as_ref().is_none_or(|p| p.is_absolute()));
    assert!(c.api.token_file.as_ref().is_none_or(|p| p.is_absolute()));
    assert!(edgehub::config::check_log_filter(&c.log).is_ok());
    assert_eq!(resolve().ok(), Some(c), "the same input resolves the same");
});

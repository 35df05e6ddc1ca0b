//! The kubeconfig reader (`Kubeconfig::parse_reading`): YAML text, and what the files it
//! names hold, given by the fuzzer instead of read from disk. The answer is a kubeconfig edgehub
//! can use (an https server, a credential) or an error: never a panic, never a credential
//! in its Debug output.
#![no_main]

use edgehub::kube::kubeconfig::TokenSource;
use edgehub::kube::Kubeconfig;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    // The YAML text, then NUL, then what every file it names holds.
    let mut parts = data.splitn(2, |b| *b == 0);
    let Ok(text) = std::str::from_utf8(parts.next().unwrap_or_default()) else {
        return;
    };
    let file = parts.next().unwrap_or_default().to_vec();
    let read = |p: &Path| {
        if p.as_os_str().len() % 7 == 0 {
            Err(std::io::Error::other("not there"))
        } else {
            Ok(file.clone())
        }
    };
    let Ok(k) = Kubeconfig::parse_reading(
        text,
        Path::new("/etc/edgehub/kubeconfig"),
        Path::new("/etc/edgehub"),
        &read,
    ) else {
        return;
    };
    assert!(k.server.starts_with("https://") && !k.server.ends_with('/'));
    assert!(k.token.is_some() || k.client_cert.is_some(), "no credential");
    if let Some(TokenSource::File(p)) = &k.token {
        assert!(p.is_absolute(), "a token file relative to nothing");
    }
    // Debug shows the server and the name, and only that there are credentials.
    let redacted = |some: bool| some.then_some("<redacted>");
    assert_eq!(
        format!("{k:?}"),
        format!(
            "Kubeconfig {{ server: {:?}, tls_server_name: {:?}, token: {:?}, client_cert: {:?} }}",
            k.server,
            k.tls_server_name,
            redacted(k.token.is_some()),
            redacted(k.client_cert.is_some())
        ),
        "Debug shows a credential"
    );
});

//! meta-edgehub's README, security policy, licence and ignore rules as a standalone copy of
//! the layer and a build from the checkout need them, and the OTA managers' integrations the
//! recipe installs on request; tests/yocto.rs checks the rest of the layer.

use std::collections::BTreeSet;
use std::path::PathBuf;

fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(p)
}

fn read(p: &str) -> String {
    std::fs::read_to_string(repo(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
}

const LAYER: &str = "yocto/meta-edgehub";

fn recipe() -> String {
    read(&format!(
        "{LAYER}/recipes-core/edgehub/edgehub_{}.bb",
        env!("CARGO_PKG_VERSION")
    ))
}

/// The value of a one-line `NAME = "value"` (or `??=`) assignment in `text`.
fn assignment(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.trim_start();
        let rest = ["??=", "?=", "="]
            .iter()
            .find_map(|op| rest.strip_prefix(op))?;
        Some(rest.trim().trim_matches('"').to_string())
    })
}

#[test]
fn no_mail_goes_to_an_address_where_it_cannot_arrive() {
    // The maintainers, patches and security reports go through the project's issue tracker.
    for file in ["README.md", "SECURITY.md"] {
        let text = read(&format!("{LAYER}/{file}"));
        let dead = undeliverable_addresses(&text);
        assert!(dead.is_empty(), "{file}: mail to {dead:?} cannot arrive");
        assert!(
            text.contains("issue tracker"),
            "{file} names the issue tracker"
        );
    }
}

/// The mail addresses in `text` whose domain is reserved (RFC 2606, RFC 6761): mail to them
/// cannot arrive.
fn undeliverable_addresses(text: &str) -> Vec<String> {
    let addr_char = |c: char| c.is_ascii_alphanumeric() || "._+-".contains(c);
    let mut out = Vec::new();
    for (i, _) in text.match_indices('@') {
        let local: String = text[..i]
            .chars()
            .rev()
            .take_while(|c| addr_char(*c))
            .collect();
        let domain: String = text[i + 1..]
            .chars()
            .take_while(|c| addr_char(*c))
            .collect();
        let domain = domain.trim_end_matches('.').to_ascii_lowercase();
        if local.is_empty() || !domain.contains('.') {
            continue;
        }
        let reserved = [".example", ".invalid", ".test", ".localhost"]
            .iter()
            .any(|tld| domain.ends_with(tld))
            || ["example.com", "example.net", "example.org"]
                .iter()
                .any(|d| domain == *d || domain.ends_with(&format!(".{d}")));
        if reserved {
            out.push(format!(
                "{}@{domain}",
                local.chars().rev().collect::<String>()
            ));
        }
    }
    out
}

#[test]
fn the_reserved_domain_check_knows_a_dead_address_from_a_live_one() {
    assert_eq!(
        undeliverable_addresses("edgehub <maintainers@users.noreply.a-seed-033fda1c.example>"),
        ["maintainers@users.noreply.a-seed-033fda1c.example"]
    );
    assert_eq!(
        undeliverable_addresses("a@mail.example.com, b@x.invalid"),
        ["a@mail.example.com", "b@x.invalid"]
    );
    for live in [
        "yocto@lists.yoctoproject.org",
        "${@d.getVar('X')}",
        "user@localhost-ish.org",
    ] {
        assert!(undeliverable_addresses(live).is_empty(), "{live}");
    }
}

#[test]
fn the_layer_carries_its_own_licence() {
    // A copy of yocto/meta-edgehub alone (a layer index, a vendored copy) must say its licence.
    let layer = std::fs::read(repo(&format!("{LAYER}/LICENSE"))).expect("the layer's LICENSE");
    assert_eq!(
        layer,
        std::fs::read(repo("LICENSE")).unwrap(),
        "the repository's Apache-2.0 text"
    );
    let readme = read(&format!("{LAYER}/README.md"));
    assert!(readme.contains("`LICENSE` in this directory"));
}

/// The download URL the crate fetcher builds from the recipe's `crate://` URL of NAME and
/// VERSION, by the BitBake that builds it, as each release's `lib/bb/fetch2/crate.py` writes
/// it, the registry's hosts left out: (what runs it, the path it fetches, the PREMIRRORS
/// pattern that matches only it).
const CRATE_URLS: &[(&str, &str, &str)] = &[
    // 2.18 since "fetch2/crate: use CDN for fetching crates" (yocto-6.0.1, the kas file's 6.0.2).
    (
        "BitBake 2.18",
        "/crates/NAME/VERSION/download",
        "https://.*/crates/.*",
    ),
    // 2.16 on every whinlatter release, and 2.18.0 (yocto-6.0).
    (
        "BitBake 2.16",
        "/api/v1/crates/NAME/VERSION/download",
        "https://.*/api/v1/crates/.*",
    ),
];

#[test]
fn the_offline_crates_section_spells_out_each_releases_premirrors_pattern() {
    let readme = read(&format!("{LAYER}/README.md"));
    for (bitbake, path, pattern) in CRATE_URLS {
        assert!(readme.contains(path), "README: {bitbake} fetches {path}");
        let line = format!("PREMIRRORS:prepend = \"{pattern} https://MIRROR/crates/ \\n\"");
        assert!(readme.contains(&line), "README lacks {line}");
        // BitBake anchors the path pattern at the path's start (re.match): each pattern
        // matches its own release's path and not the other's.
        let re_path = pattern.trim_start_matches("https://.*");
        for (_, other, _) in CRATE_URLS {
            let matches = regex_prefix_match(re_path, other);
            assert_eq!(matches, other == path, "{pattern} against {other}");
        }
    }
    assert!(
        !readme.contains("<the crate download URL's prefix>"),
        "a literal pattern, not a hint"
    );
}

/// `re.match(pattern, text)` for the patterns above: literal text, then `.*` at the end.
fn regex_prefix_match(pattern: &str, text: &str) -> bool {
    let literal = pattern.strip_suffix(".*").unwrap_or(pattern);
    assert!(
        !literal.contains(['.', '*', '[', '(', '?', '+']),
        "{pattern}: more than a prefix"
    );
    text.starts_with(literal)
}

#[test]
fn gitignore_covers_what_kas_clones_and_builds_in_the_checkout() {
    let ignore = read(".gitignore");
    let lines: BTreeSet<&str> = ignore.lines().map(str::trim).collect();
    let mut want = BTreeSet::from(["/build/".to_string()]);
    for file in ["yocto/kas/edgehub.yml", "yocto/kas/virtualization.yml"] {
        let kas: serde_yaml_ng::Value = serde_yaml_ng::from_str(&read(file)).unwrap();
        for (name, r) in kas["repos"].as_mapping().unwrap() {
            // A repository with no url is the checkout itself.
            if r["url"].is_string() {
                want.insert(format!("/{}/", name.as_str().unwrap()));
            }
        }
    }
    assert!(want.len() >= 5, "{want:?}");
    for w in &want {
        assert!(lines.contains(w.as_str()), ".gitignore lacks {w}");
    }
}

/// A firmware team asks for an OTA manager's integration with PACKAGECONFIG; the recipe then
/// installs the repository's script where the manager runs it.
#[test]
fn the_managers_integrations_are_installed_when_packageconfig_asks() {
    let bb = recipe();
    // The multi-line FILES:${PN} += "...".
    let files = {
        let start = bb
            .find("\nFILES:${PN} += \"")
            .expect("FILES:${PN} += \"...\"")
            + 1;
        let body = &bb[start + "FILES:${PN} += \"".len()..];
        body[..body.find("\"\n").unwrap()].replace("\\\n", " ")
    };
    let readme = read(&format!("{LAYER}/README.md"));
    for (cfg, src, dest) in [
        (
            "mender",
            "integrations/mender/edgehub",
            // Mender 3.x runs Update Modules only from here, named after the payload type.
            "${datadir}/mender/modules/v3/edgehub",
        ),
        (
            "swupdate",
            "integrations/swupdate/edgehub-swupdate",
            "${libexecdir}/edgehub/edgehub-swupdate",
        ),
    ] {
        assert!(
            bb.contains(&format!("PACKAGECONFIG[{cfg}] = \"\"")),
            "{cfg}: no build dependency"
        );
        assert!(bb.contains(&format!(
            "if ${{@bb.utils.contains('PACKAGECONFIG', '{cfg}', 'true', 'false', d)}}; then"
        )));
        assert!(
            bb.contains(&format!("install -m 0755 ${{S}}/{src} ${{D}}{dest}")),
            "{cfg}: installs {src} as {dest}"
        );
        assert!(repo(src).is_file(), "{src}");
        assert!(
            files.split_whitespace().any(|f| f == dest),
            "FILES has {dest}"
        );
        assert!(readme.contains(&format!("PACKAGECONFIG:append:pn-edgehub = \" {cfg}\"")));
    }
    assert_eq!(
        assignment(&bb, "PACKAGECONFIG").as_deref(),
        Some(""),
        "off unless asked"
    );
}

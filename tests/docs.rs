//! The documentation that can drift from the code is checked against it: the config file the
//! Yocto layer installs, which the docs send readers to as the reference of every key, shows
//! every key the parser takes.

use edgehub::config::{Config, ConfigError, Overrides};
use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The keys the config file accepts, as `key` (top level) and `section.key`, read from the
/// parser itself: a file with an unknown key is refused with the list of the keys it knows
/// (the file's shape denies unknown fields), so this cannot miss one the parser takes.
fn config_keys() -> Vec<String> {
    /// The keys the parser lists when `text` has an unknown one; none when it refuses `text`
    /// for another reason (a plain key written as a table: "invalid type: map").
    fn known(text: &str) -> Vec<String> {
        let err = Config::resolve(
            Some(text),
            Path::new("config.toml"),
            &[],
            &Overrides::default(),
            Some("edge-1".into()),
        )
        .expect_err("an unknown key is refused");
        let ConfigError::Parse { message, .. } = err else {
            panic!("an unknown key is a parse error, got {err}");
        };
        let Some(list) = message.split("unknown field").nth(1) else {
            return Vec::new();
        };
        list.split('`')
            .skip(3)
            .step_by(2)
            .filter(|k| *k != "zz_not_a_key")
            .map(str::to_string)
            .collect()
    }
    let mut keys = Vec::new();
    for top in known("zz_not_a_key = 1") {
        let section = known(&format!("[{top}]\nzz_not_a_key = 1"));
        // a plain key is not a table: the parser says so instead of listing keys
        if section.is_empty() {
            keys.push(top);
        } else {
            keys.extend(section.into_iter().map(|k| format!("{top}.{k}")));
        }
    }
    keys
}

/// The keys a TOML file sets or shows commented out (`# key = ...`), as `key` and
/// `section.key`.
fn keys_in_toml(text: &str) -> Vec<String> {
    let mut section = String::new();
    let mut out = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        if let Some(name) = l.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            section = name.trim().to_string();
            continue;
        }
        let l = l.strip_prefix('#').map(str::trim).unwrap_or(l);
        let Some((key, _)) = l.split_once('=') else {
            continue;
        };
        let key = key.trim();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
            continue;
        }
        out.push(if section.is_empty() {
            key.to_string()
        } else {
            format!("{section}.{key}")
        });
    }
    out
}

const SHIPPED_CONFIG: &str = "yocto/meta-edgehub/recipes-core/edgehub/files/config.toml";

#[test]
fn the_shipped_config_shows_every_key_the_parser_takes() {
    let text = std::fs::read_to_string(Path::new(ROOT).join(SHIPPED_CONFIG)).unwrap();
    let shown = keys_in_toml(&text);
    let missing: Vec<_> = config_keys()
        .into_iter()
        .filter(|k| !shown.contains(k))
        .collect();
    assert!(
        missing.is_empty(),
        "{SHIPPED_CONFIG} is the reference of every key (docs/configuration.md sends readers \
         there), and lacks: {missing:?}"
    );
}

#[test]
fn the_key_reader_reads_tables_and_commented_keys() {
    let t = "a = 1\n# b = \"x\"   # default\n[s]\n# A comment, not a key: x = y.\nc = []\n";
    assert_eq!(keys_in_toml(t), ["a", "b", "s.c"]);
}

/// The rows between a document's numbers markers.
fn numbers_rows(doc: &str) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(ROOT).join(doc)).unwrap();
    let start = text
        .find("<!-- numbers:begin")
        .unwrap_or_else(|| panic!("{doc} has its numbers markers"));
    let end = text[start..]
        .find("<!-- numbers:end -->")
        .map(|e| start + e)
        .unwrap_or_else(|| panic!("{doc} closes its numbers markers"));
    text[start..end]
        .lines()
        .skip(1)
        .filter(|l| l.starts_with("| "))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_readmes_numbers_are_the_budgeted_rows_of_docs_numbers() {
    let full = numbers_rows("docs/numbers.md");
    let readme = numbers_rows("README.md");
    let budgeted: Vec<_> = full
        .iter()
        .filter(|r| r.trim_end().ends_with("| ok |") || r.trim_end().ends_with("| OVER |"))
        .cloned()
        .collect();
    assert_eq!(
        readme[2..],
        budgeted[..],
        "README.md's numbers table is docs/numbers.md's budgeted rows (benches/report.py \
         writes both); regenerate with `bash benches/run.sh --readme-only`"
    );
}

/// Every relative link in the README and in docs/ names a file that exists.
#[test]
fn the_documents_link_only_to_files_that_exist() {
    let mut docs = vec![Path::new(ROOT).join("README.md")];
    for e in std::fs::read_dir(Path::new(ROOT).join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            docs.push(p);
        }
    }
    let mut broken = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        let dir = doc.parent().unwrap();
        for (i, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("](") {
                let after = &rest[at + 2..];
                let Some(close) = after.find(')') else {
                    break;
                };
                let target = &after[..close];
                rest = &after[close..];
                if target.contains("://")
                    || target.starts_with('#')
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                let file = target.split('#').next().unwrap_or(target);
                if !dir.join(file).exists() {
                    broken.push(format!(
                        "{}:{}: {target}",
                        doc.strip_prefix(ROOT).unwrap().display(),
                        i + 1
                    ));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to nothing:\n{}",
        broken.join("\n")
    );
}

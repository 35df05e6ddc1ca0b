//! meta-edgehub: the recipe's crate list is exactly Cargo.lock's, the recipe matches the
//! crate's version and license line, and the systemd unit verifies.

use edgehub_testsupport::yocto;
use std::collections::BTreeSet;
use std::path::PathBuf;

fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(p)
}

fn read(p: &str) -> String {
    std::fs::read_to_string(repo(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
}

const RECIPE_DIR: &str = "yocto/meta-edgehub/recipes-core/edgehub";

#[test]
fn crate_list_is_not_stale() {
    let want = yocto::crates_inc(&read("Cargo.lock")).unwrap();
    let have = read(&format!("{RECIPE_DIR}/edgehub-crates.inc"));
    assert!(
        have == want,
        "{RECIPE_DIR}/edgehub-crates.inc is stale; regenerate it with\n  \
         cargo run -q -p edgehub-testsupport --bin yocto-crates > {RECIPE_DIR}/edgehub-crates.inc"
    );
}

#[test]
fn recipe_src_uri_matches_cargo_lock_exactly() {
    let inc = read(&format!("{RECIPE_DIR}/edgehub-crates.inc"));
    let uris: BTreeSet<(String, String)> = inc
        .lines()
        .filter_map(|l| l.trim().strip_prefix("crate://${EDGEHUB_CRATE_REGISTRY}/"))
        .map(|rest| {
            let rest = rest.trim_end_matches('\\').trim();
            let (name, version) = rest.split_once('/').expect("crate://REGISTRY/NAME/VERSION");
            (name.to_string(), version.to_string())
        })
        .collect();
    let sums: BTreeSet<(String, String)> = inc
        .lines()
        .filter_map(|l| l.strip_prefix("SRC_URI["))
        .map(|l| {
            let (key, value) = l
                .split_once(".sha256sum] = ")
                .expect("SRC_URI[NAME-VERSION.sha256sum] = \"SUM\"");
            (key.to_string(), value.trim_matches('"').to_string())
        })
        .collect();
    let lock = yocto::registry_crates(&read("Cargo.lock")).unwrap();
    let want_uris: BTreeSet<(String, String)> = lock
        .iter()
        .map(|(n, v, _)| (n.clone(), v.clone()))
        .collect();
    let want_sums: BTreeSet<(String, String)> = lock
        .iter()
        .map(|(n, v, s)| (format!("{n}-{v}"), s.clone()))
        .collect();
    assert_eq!(uris, want_uris, "crate:// entries differ from Cargo.lock");
    assert_eq!(sums, want_sums, "checksums differ from Cargo.lock");
    assert!(
        uris.iter().any(|(n, _)| n == "rusqlite"),
        "the list is the real one"
    );
}

#[test]
fn recipe_version_license_and_files() {
    let recipe = format!("{RECIPE_DIR}/edgehub_{}.bb", env!("CARGO_PKG_VERSION"));
    let bb = read(&recipe);
    assert!(
        bb.contains("inherit cargo systemd"),
        "{recipe} uses Yocto's cargo class"
    );
    assert!(bb.contains("require edgehub-crates.inc"));
    assert!(bb.contains("SYSTEMD_SERVICE:${PN} = \"edgehub.service\""));
    assert!(
        bb.contains("${localstatedir}/lib/edgehub"),
        "packages /var/lib/edgehub"
    );
    assert!(
        bb.contains("${sysconfdir}/edgehub/config.toml"),
        "installs the default config"
    );
    for installed in [
        "yocto/meta-edgehub/recipes-core/edgehub/files/config.toml",
        "yocto/meta-edgehub/recipes-core/edgehub/files/edgehub.service",
        "README.md",
        "deploy/rbac.yaml",
        "deploy/kubeconfig.template.yaml",
    ] {
        assert!(
            bb.contains(&format!("${{S}}/{installed}")),
            "the recipe installs {installed}"
        );
        assert!(repo(installed).exists(), "{installed} exists");
    }

    // LIC_FILES_CHKSUM: the md5 of Cargo.toml's license line, as BitBake computes it.
    let lic = bb
        .lines()
        .find(|l| l.starts_with("LIC_FILES_CHKSUM"))
        .unwrap();
    let begin: usize = lic
        .split("beginline=")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let md5 = lic.split("md5=").nth(1).unwrap().trim_end_matches('"');
    let line = read("Cargo.toml")
        .lines()
        .nth(begin - 1)
        .unwrap()
        .to_string()
        + "\n";
    assert_eq!(line, "license = \"Apache-2.0\"\n");
    let mut child = std::process::Command::new("md5sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("md5sum (coreutils)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(line.as_bytes())
        .unwrap();
    let out = String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(out.split_whitespace().next(), Some(md5));

    let layer = read("yocto/meta-edgehub/conf/layer.conf");
    assert!(layer.contains("BBFILE_COLLECTIONS += \"edgehub\""));
    assert!(layer.contains("recipes-*/*/*.bb"));
}

#[test]
fn systemd_unit_is_notify_restart_always_hardened_and_verifies() {
    let unit = read(&format!("{RECIPE_DIR}/files/edgehub.service"));
    for want in [
        "Type=notify",
        "Restart=always",
        "StateDirectory=edgehub",
        "NoNewPrivileges=yes",
        "ProtectSystem=full",
        "PrivateTmp=yes",
        "ExecStart=/usr/bin/edgehub run",
    ] {
        assert!(unit.lines().any(|l| l == want), "unit lacks {want}");
    }
    // systemd's own parser, with ExecStart pointed at a binary that exists here.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edgehub.service");
    std::fs::write(
        &path,
        unit.replace("/usr/bin/edgehub", env!("CARGO_BIN_EXE_edgehub")),
    )
    .unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze (Debian package systemd) is needed to verify the unit");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {stderr}"
    );
}

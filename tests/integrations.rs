//! The OTA managers' integrations (integrations/), checked as files: POSIX sh that shellcheck
//! passes (a Yocto image may have only busybox), executable, and the block of functions the
//! Mender module and the SWUpdate handler share kept identical. tests/mender.rs and
//! tests/swupdate.rs run them under the real managers.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(p)
}

const SCRIPTS: &[&str] = &[
    "integrations/mender/edgehub",
    "integrations/mender/edgehub-artifact",
    "integrations/swupdate/edgehub-swupdate",
    "integrations/swupdate/edgehub-swu",
];

#[test]
fn the_scripts_are_executable_posix_sh_that_shellcheck_passes() {
    for s in SCRIPTS {
        let path = repo(s);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("#!/bin/sh\n"), "{s}: #!/bin/sh");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert!(mode & 0o111 == 0o111, "{s}: mode {mode:o}");
    }
    let out = std::process::Command::new("shellcheck")
        .args(["--shell=sh", "--severity=style"])
        .args(SCRIPTS.iter().map(|s| repo(s)))
        .output()
        .expect("shellcheck (Debian package shellcheck; scripts/setup.sh test installs it)");
    assert!(
        out.status.success(),
        "shellcheck:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The lines between the markers of the shared block.
fn common_block(path: &str) -> String {
    let text = std::fs::read_to_string(repo(path)).unwrap();
    let start = text
        .find("# --- edgehub OTA common: begin")
        .unwrap_or_else(|| panic!("{path}: no common block"));
    let end = text
        .find("# --- edgehub OTA common: end ---")
        .unwrap_or_else(|| panic!("{path}: no end of the common block"));
    text[start..end].to_string()
}

#[test]
fn the_mender_module_and_the_swupdate_handler_share_one_block_of_functions() {
    let mender = common_block("integrations/mender/edgehub");
    let swupdate = common_block("integrations/swupdate/edgehub-swupdate");
    assert!(mender.contains("read_manifest()") && mender.contains("start_transaction()"));
    assert!(
        mender == swupdate,
        "the common blocks differ: change both (integrations/mender/edgehub is the reference)"
    );
}

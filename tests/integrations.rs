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

/// What the module's manifest check must decide, written again in Rust from the format
/// (docs/mender.md): Ok(targets), or Err(the 1-based line at fault, 0 for the whole file).
fn oracle(manifest: &[u8]) -> Result<Vec<String>, usize> {
    fn label(s: &[u8], max: usize, dots: bool) -> bool {
        let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        !s.is_empty()
            && s.len() <= max
            && s.iter()
                .all(|c| alnum(c) || *c == b'-' || (dots && *c == b'.'))
            && alnum(&s[0])
            && alnum(&s[s.len() - 1])
    }
    fn target(t: &[u8]) -> bool {
        let Some(slash) = t.iter().position(|c| *c == b'/') else {
            return false;
        };
        let (ns, rest) = (&t[..slash], &t[slash + 1..]);
        let (pod, rev) = match rest.iter().position(|c| *c == b'@') {
            Some(at) => (&rest[..at], Some(&rest[at + 1..])),
            None => (rest, None),
        };
        if let Some(rev) = rev {
            let ok = |c: &u8| c.is_ascii_alphanumeric() || *c == b'.' || *c == b'-';
            if rev.is_empty() || rev.len() > 253 || !rev.iter().all(ok) {
                return false;
            }
        }
        label(ns, 63, false) && label(pod, 253, true)
    }
    let mut seen = Vec::new();
    let lines: Vec<&[u8]> = manifest.split(|c| *c == b'\n').collect();
    // A final newline ends the last line; it starts none.
    let n = if manifest.ends_with(b"\n") {
        lines.len() - 1
    } else {
        lines.len()
    };
    for (i, line) in lines[..n].iter().enumerate() {
        let line = &line[..line.iter().position(|c| *c == b'#').unwrap_or(line.len())];
        let words: Vec<&[u8]> = line
            .split(|c| *c == b' ' || *c == b'\t')
            .filter(|w| !w.is_empty())
            .collect();
        match words.as_slice() {
            [] => continue,
            [t] if target(t) => {
                let t = String::from_utf8(t.to_vec()).unwrap();
                let pod = t.split('@').next().unwrap().to_string();
                if seen
                    .iter()
                    .any(|s: &String| s.split('@').next().unwrap() == pod)
                {
                    return Err(i + 1);
                }
                if seen.len() == 16 {
                    return Err(i + 1);
                }
                seen.push(t);
            }
            _ => return Err(i + 1),
        }
    }
    if seen.is_empty() {
        Err(0)
    } else {
        Ok(seen)
    }
}

/// A random manifest, mostly near the format: lines of targets (valid names, then a byte or
/// two the shell might trip on, now and then), comments, blanks, several words on a line.
fn random_manifest() -> Vec<u8> {
    const ALNUM: &[u8] = b"abcxyz0189";
    const INNER: &[u8] = b"abcxyz0189-.";
    const NASTY: &[&[u8]] = &[
        b" ",
        b"\t",
        b"\r",
        b"#",
        b"@",
        b"/",
        b"$(",
        b"`",
        b";",
        b"*",
        b"?",
        b"[",
        b"\\",
        b"'",
        b"\"",
        b"A",
        b"_",
        b"..",
        b"-",
        b".",
        b"\xc3\xa9",
        b"\xff",
        b"%",
        b"~",
        b"|",
        b"&",
        b"",
    ];
    let name = |out: &mut Vec<u8>| {
        out.push(ALNUM[fastrand::usize(..ALNUM.len())]);
        for _ in 0..fastrand::usize(0..6) {
            out.push(INNER[fastrand::usize(..INNER.len())]);
        }
        out.push(ALNUM[fastrand::usize(..ALNUM.len())]);
    };
    let mut out = Vec::new();
    for _ in 0..fastrand::usize(0..6) {
        match fastrand::u8(0..12) {
            0 => out.extend_from_slice(b"# a comment"),
            1 => {}
            2 => out.extend_from_slice(b"  \t "),
            _ => {
                let start = out.len();
                name(&mut out);
                out.push(b'/');
                name(&mut out);
                if fastrand::bool() {
                    out.push(b'@');
                    name(&mut out);
                }
                if fastrand::u8(0..6) == 0 {
                    out.extend_from_slice(b" # trailing");
                }
                // Now and then a byte the format refuses, somewhere in the line.
                if fastrand::u8(0..3) == 0 {
                    let at = fastrand::usize(start..=out.len());
                    let nasty = NASTY[fastrand::usize(..NASTY.len())];
                    out.splice(at..at, nasty.iter().copied());
                }
            }
        }
        if fastrand::u8(0..20) != 0 {
            out.push(b'\n');
        }
    }
    out
}

/// The module's manifest check under busybox's shell against the oracle above, on random
/// manifests: it accepts exactly what the format allows (and then asks edgehub, which here
/// does not answer), refuses the rest naming the right line, and never hangs.
#[test]
fn the_manifest_check_accepts_exactly_the_format_on_random_manifests() {
    let seed = fastrand::u64(..);
    fastrand::seed(seed);
    let dir = tempfile::tempdir().unwrap();
    // An edgehub whose API is nowhere: a manifest that passes gets as far as asking it.
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "node_name = \"fuzz\"\napi_addr = \"none\"\ndata_dir = \"{}\"\n[api]\nsocket = \"{}\"\n",
            dir.path().join("data").display(),
            dir.path().join("nowhere.sock").display()
        ),
    )
    .unwrap();
    let tree = dir.path().join("tree");
    std::fs::create_dir_all(tree.join("files")).unwrap();
    std::fs::create_dir_all(tree.join("tmp")).unwrap();
    let (mut accepted, mut refused) = (0, 0);
    // EDGEHUB_FUZZ_CASES runs more (by hand, under nice); the suite runs 300.
    let cases: usize = std::env::var("EDGEHUB_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for case in 0..cases {
        let manifest = if case < 3 {
            [
                &b"vehicle/telemetry-sv74m\n"[..],
                b"a/b@c\n# x\n",
                b"x-1/y.z  # c\n\tq/r@S-1.2",
            ][case]
                .to_vec()
        } else {
            random_manifest()
        };
        std::fs::write(tree.join("files/pods"), &manifest).unwrap();
        let _ = std::fs::remove_file(tree.join("tmp/edgehub-transaction"));
        let started = std::time::Instant::now();
        let out = std::process::Command::new("timeout")
            .args(["20", "busybox", "sh"])
            .arg(repo("integrations/mender/edgehub"))
            .arg("ArtifactInstall")
            .arg(&tree)
            .env("EDGEHUB", env!("CARGO_BIN_EXE_edgehub"))
            .env("EDGEHUB_CONFIG", &config)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let shown = String::from_utf8_lossy(&manifest)
            .escape_debug()
            .to_string();
        assert!(
            out.status.code() == Some(1),
            "seed {seed}, {shown}: exit {:?} after {:?}\n{err}",
            out.status,
            started.elapsed()
        );
        match oracle(&manifest) {
            Ok(targets) => {
                accepted += 1;
                let want = format!("starting the transaction of {}", targets.join(" "));
                assert!(
                    err.contains(&want),
                    "seed {seed}, {shown}: wanted {want:?}\n{err}"
                );
            }
            Err(line) => {
                refused += 1;
                assert!(
                    !err.contains("starting the transaction"),
                    "seed {seed}, {shown}: accepted\n{err}"
                );
                if line > 0 {
                    let want = format!("manifest line {line}:");
                    assert!(
                        err.contains(&want),
                        "seed {seed}, {shown}: wanted {want}\n{err}"
                    );
                } else {
                    assert!(
                        err.contains("the manifest names no pod"),
                        "seed {seed}, {shown}\n{err}"
                    );
                }
            }
        }
    }
    println!("seed {seed}: {accepted} manifests accepted, {refused} refused");
    assert!(
        accepted >= cases / 6 && refused >= cases / 6,
        "{accepted} accepted, {refused} refused"
    );
}

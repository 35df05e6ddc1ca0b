//! meta-edgehub, checked without BitBake (CI cannot fetch oe-core): the releases it claims
//! against the Rust each ships, the conventions of a Yocto Project Compatible layer, the crate
//! list and licences against Cargo.lock and the crates, the kas files, and the systemd unit.
//! The facts about oe-core releases are data here, read off each release branch.

use edgehub_testsupport::yocto::{self, Lic};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(p)
}

fn read(p: &str) -> String {
    std::fs::read_to_string(repo(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
}

const LAYER: &str = "yocto/meta-edgehub";
const RECIPE_DIR: &str = "yocto/meta-edgehub/recipes-core/edgehub";

fn recipe_path() -> String {
    format!("{RECIPE_DIR}/edgehub_{}.bb", env!("CARGO_PKG_VERSION"))
}

fn recipe() -> String {
    read(&recipe_path())
}

/// oe-core's releases: series name, Yocto version, the Rust it ships (the version of
/// meta/recipes-devtools/rust/rust_*.bb on the release branch), and whether it is released
/// (master's next series is not).
/// A Rust version, (major, minor, patch).
type RustVersion = (u32, u32, u32);

const RELEASES: &[(&str, &str, RustVersion, bool)] = &[
    ("kirkstone", "4.0", (1, 59, 0), true),
    ("langdale", "4.1", (1, 63, 0), true),
    ("mickledore", "4.2", (1, 68, 2), true),
    ("nanbield", "4.3", (1, 70, 0), true),
    ("scarthgap", "5.0", (1, 75, 0), true),
    ("styhead", "5.1", (1, 79, 0), true),
    ("walnascar", "5.2", (1, 84, 1), true),
    ("whinlatter", "5.3", (1, 90, 0), true),
    ("wrynose", "6.0", (1, 94, 1), true),
    ("blacksail", "6.1", (1, 97, 1), false),
];

fn version3(v: &str) -> RustVersion {
    let mut it = v.split('.').map(|p| p.parse::<u32>().unwrap());
    (
        it.next().unwrap(),
        it.next().unwrap_or(0),
        it.next().unwrap_or(0),
    )
}

/// The lines of BitBake metadata that are not comments.
fn code_lines(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The value of a one-line `NAME = "value"` (or `+=`, `?=`, `??=`) assignment in `text`.
fn assignment(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.trim_start();
        let rest = ["??=", "?=", "+=", ":=", "="]
            .iter()
            .find_map(|op| rest.strip_prefix(op))?;
        Some(rest.trim().trim_matches('"').to_string())
    })
}

/// The text of a multi-line `NAME = " \ ... "` (or `+=`) assignment, its lines joined.
fn multiline(text: &str, name: &str) -> String {
    let (start, op) = [" = \"", " += \""]
        .iter()
        .find_map(|op| text.find(&format!("{name}{op}")).map(|i| (i, op.len())))
        .unwrap_or_else(|| panic!("no {name} = \"...\""));
    let body = &text[start + name.len() + op..];
    let end = body
        .find("\"\n")
        .unwrap_or_else(|| panic!("{name}: no closing quote"));
    body[..end].replace("\\\n", " ")
}

fn rust_version() -> RustVersion {
    let cargo: toml::Value = toml::from_str(&read("Cargo.toml")).unwrap();
    version3(cargo["package"]["rust-version"].as_str().unwrap())
}

#[test]
fn compat_lists_exactly_the_released_series_whose_rust_compiles_edgehub() {
    let msrv = rust_version();
    let layer = read(&format!("{LAYER}/conf/layer.conf"));
    let have: BTreeSet<String> = assignment(&layer, "LAYERSERIES_COMPAT_edgehub")
        .expect("layer.conf sets LAYERSERIES_COMPAT_edgehub")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let want: BTreeSet<String> = RELEASES
        .iter()
        .filter(|(_, _, rust, released)| *released && *rust >= msrv)
        .map(|(name, ..)| name.to_string())
        .collect();
    assert_eq!(
        have, want,
        "LAYERSERIES_COMPAT_edgehub must list the released series whose Rust is at least \
         rust-version {msrv:?}"
    );
    assert!(have.contains("wrynose"), "the LTS that can build edgehub");
    let code = code_lines(&layer);
    for (name, ..) in RELEASES {
        if !have.contains(*name) {
            assert!(
                !code.contains(name),
                "layer.conf names {name}, a series it cannot support"
            );
        }
    }
}

#[test]
fn rust_version_is_what_the_linked_crates_need() {
    // Cargo.toml's rust-version is the compat list's premise: it must not be lower than a
    // linked crate's (the claim would be false) nor higher (it could honestly be lowered).
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(&cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["metadata", "--format-version", "1", "--offline", "--locked"])
        .output()
        .expect("cargo metadata");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let crates = yocto::linked_crates(&cargo, &repo(".")).unwrap();
    let linked: BTreeSet<(String, String)> = crates
        .iter()
        .map(|c| (c.name.clone(), c.version.clone()))
        .collect();
    let (max, who) = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| {
            linked.contains(&(
                p["name"].as_str().unwrap().to_string(),
                p["version"].as_str().unwrap().to_string(),
            ))
        })
        .filter(|p| p["source"].is_string())
        .filter_map(|p| {
            Some((
                version3(p["rust_version"].as_str()?),
                p["name"].as_str().unwrap().to_string(),
            ))
        })
        .max()
        .unwrap();
    let msrv = rust_version();
    assert_eq!(
        (msrv.0, msrv.1),
        (max.0, max.1),
        "rust-version {msrv:?}, but {who} needs {max:?}"
    );
}

#[test]
fn s_is_left_to_oe_core() {
    let bb = recipe();
    assert!(
        !bb.contains("${WORKDIR}/git"),
        "S = \"${{WORKDIR}}/git\" is fatal at do_unpack on whinlatter and later"
    );
    assert!(
        !bb.lines().any(|l| l.trim_start().starts_with("S =")),
        "every supported release unpacks the git source to ${{UNPACKDIR}}/${{BP}}, oe-core's S"
    );
}

/// The bodies of the recipe's anonymous python functions (run at parse time).
fn anonymous_python(bb: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = bb.lines();
    while let Some(l) = lines.next() {
        let t = l.trim();
        if t == "python () {" || t == "python __anonymous () {" {
            let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "}").collect();
            out.push(body.join("\n"));
        }
    }
    out
}

#[test]
fn an_unconfigured_recipe_skips_itself_and_stops_no_parse() {
    for file in layer_metadata() {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(!text.contains("bb.fatal"), "{}: bb.fatal", file.display());
        assert!(!text.contains("AUTOREV"), "{}: AUTOREV", file.display());
    }
    let bb = recipe();
    let anon = anonymous_python(&bb);
    assert_eq!(anon.len(), 1, "one anonymous python function");
    assert!(anon[0].contains("raise bb.parse.SkipRecipe("));
    for var in ["EDGEHUB_GIT_URI", "EDGEHUB_SRCREV"] {
        assert!(
            anon[0].contains(&format!("\"{var}\"")),
            "skips without {var}"
        );
        assert_eq!(
            assignment(&bb, var).as_deref(),
            Some(""),
            "{var} has no default"
        );
    }
    assert_eq!(
        assignment(&bb, "SRCREV").as_deref(),
        Some("${EDGEHUB_SRCREV}")
    );
}

#[test]
fn pv_carries_the_commit() {
    let pv = assignment(&recipe(), "PV").expect("PV");
    assert_eq!(pv, format!("{}+git", env!("CARGO_PKG_VERSION")));
}

/// Every .bb, .bbappend, .inc and .conf of the layer.
fn layer_metadata() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| {
                ["bb", "bbappend", "inc", "conf", "bbclass"].contains(&&*x.to_string_lossy())
            }) {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo(LAYER), &mut out);
    out.sort();
    assert!(out.len() >= 4, "{out:?}");
    out
}

#[test]
fn the_containerd_recommendation_needs_meta_virtualization() {
    for file in layer_metadata() {
        let text = code_lines(&std::fs::read_to_string(&file).unwrap());
        let rel = file
            .strip_prefix(repo(LAYER))
            .unwrap()
            .to_string_lossy()
            .to_string();
        let runtime_deps = text.lines().any(|l| {
            let l = l.trim_start();
            l.starts_with("RRECOMMENDS") || l.starts_with("RDEPENDS")
        });
        if runtime_deps {
            assert!(
                rel.starts_with("dynamic-layers/virtualization-layer/"),
                "{rel}: a recommendation outside the virtualization layer's dynamic layer"
            );
        }
    }
    let layer = read(&format!("{LAYER}/conf/layer.conf"));
    assert_eq!(
        assignment(&layer, "LAYERRECOMMENDS_edgehub").as_deref(),
        Some("virtualization-layer")
    );
    let dynamic = multiline(&layer, "BBFILES_DYNAMIC");
    let entries: Vec<&str> = dynamic.split_whitespace().collect();
    assert_eq!(
        entries,
        ["virtualization-layer:${LAYERDIR}/dynamic-layers/virtualization-layer/*/*/*.bbappend"]
    );
    let append = read(&format!(
        "{LAYER}/dynamic-layers/virtualization-layer/recipes-core/edgehub/edgehub_%.bbappend"
    ));
    // meta-virtualization's containerd recipe: RPROVIDES:${PN} = "virtual-containerd ...".
    assert!(append
        .lines()
        .any(|l| l == "RRECOMMENDS:${PN} += \"virtual-containerd\""));
}

#[test]
fn the_unit_and_config_come_from_the_layer() {
    let bb = recipe();
    let src_uri = multiline(&bb, "SRC_URI");
    let files: Vec<&str> = src_uri
        .split_whitespace()
        .filter_map(|u| u.strip_prefix("file://"))
        .collect();
    assert_eq!(
        files,
        ["edgehub.service", "config.toml", "bootstrap-kubeconfig"]
    );
    for f in &files {
        assert!(
            repo(&format!("{RECIPE_DIR}/files/{f}")).is_file(),
            "file://{f} is in the layer's files/"
        );
    }
    let installs: Vec<&str> = bb
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("install -m"))
        .collect();
    let mut from_unpackdir = BTreeSet::new();
    for l in &installs {
        for word in l.split_whitespace() {
            if let Some(f) = word.strip_prefix("${UNPACKDIR}/") {
                from_unpackdir.insert(f);
            }
            assert!(
                !word.starts_with("${S}/yocto/"),
                "installs {word} from the fetched source, where no bbappend can override it"
            );
        }
    }
    assert_eq!(from_unpackdir, files.iter().copied().collect());
    assert!(bb.contains(
        "install -m 0644 ${UNPACKDIR}/config.toml ${D}${sysconfdir}/edgehub/config.toml"
    ));
    assert!(bb.contains(
        "install -m 0644 ${UNPACKDIR}/edgehub.service ${D}${systemd_system_unitdir}/edgehub.service"
    ));
    // One image for the fleet: the bootstrap kubeconfig template, and the directory where
    // each device keeps the key and certificate it makes (docs/identity.md).
    assert!(bb.contains(
        "install -m 0644 ${UNPACKDIR}/bootstrap-kubeconfig ${D}${sysconfdir}/edgehub/bootstrap-kubeconfig"
    ));
    assert!(bb.contains("install -d -m 0700 ${D}${localstatedir}/lib/edgehub/identity"));
    let template = read(&format!("{RECIPE_DIR}/files/bootstrap-kubeconfig"));
    let kc = edgehub::kube::Kubeconfig::parse(
        &template.replace(
            "certificate-authority: /etc/edgehub/ca.crt",
            "certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==",
        ),
        Path::new("/etc/edgehub/bootstrap-kubeconfig"),
        Path::new("/etc/edgehub"),
    )
    .expect("the template is a kubeconfig edgehub takes");
    assert!(
        matches!(kc.token, Some(edgehub::kube::kubeconfig::TokenSource::File(ref p))
        if p == Path::new("/var/lib/edgehub/identity/bootstrap-token"))
    );
    let config = read(&format!("{RECIPE_DIR}/files/config.toml"));
    assert!(config.contains("# bootstrap_kubeconfig = \"/etc/edgehub/bootstrap-kubeconfig\""));
    assert!(
        bb.contains("${sysconfdir}/edgehub/bootstrap-kubeconfig\""),
        "a conffile"
    );
    // The documents come from the source, which has them.
    for doc in [
        "README.md",
        "deploy/rbac.yaml",
        "deploy/kubeconfig.template.yaml",
    ] {
        assert!(bb.contains(&format!("${{S}}/{doc}")), "installs {doc}");
        assert!(repo(doc).is_file(), "{doc} exists");
    }
    // Every page the installed README links to under docs/ is installed beside it, at the
    // same relative path.
    assert!(bb.contains(
        "install -m 0644 ${S}/docs/*.md ${S}/docs/openapi.yaml ${D}${docdir}/edgehub/docs/"
    ));
    let readme = read("README.md");
    for link in readme.split("](docs/").skip(1) {
        let target = link.split([')', '#']).next().unwrap_or_default();
        assert!(
            target.ends_with(".md") || target == "openapi.yaml",
            "README links docs/{target}, which the recipe does not install"
        );
        assert!(
            repo(&format!("docs/{target}")).is_file(),
            "docs/{target} exists"
        );
    }
    assert!(bb.contains("inherit cargo cargo-update-recipe-crates systemd"));
    assert!(bb.contains("SYSTEMD_SERVICE:${PN} = \"edgehub.service\""));
    assert!(
        bb.contains("${localstatedir}/lib/edgehub"),
        "packages /var/lib/edgehub"
    );
    assert!(bb.contains(
        "CONFFILES:${PN} = \"${sysconfdir}/edgehub/config.toml ${sysconfdir}/edgehub/bootstrap-kubeconfig\""
    ));
}

#[test]
fn crate_list_is_what_update_crates_writes_from_cargo_lock() {
    let want = yocto::crates_inc(&read("Cargo.lock")).unwrap();
    let have = read(&format!("{RECIPE_DIR}/edgehub-crates.inc"));
    assert!(
        have == want,
        "{RECIPE_DIR}/edgehub-crates.inc is stale; regenerate it with\n  \
         cargo run -q -p edgehub-testsupport --bin yocto-crates > {RECIPE_DIR}/edgehub-crates.inc"
    );
    assert!(recipe().contains("require ${BPN}-crates.inc"));
}

#[test]
fn recipe_fetches_each_crate_of_cargo_lock_from_the_default_registry() {
    let inc = read(&format!("{RECIPE_DIR}/edgehub-crates.inc"));
    let uris: BTreeSet<(String, String)> = inc
        .lines()
        .filter(|l| l.trim().starts_with("crate://"))
        .map(|l| {
            let rest = l
                .trim()
                .strip_prefix("crate://crates.io/")
                .unwrap_or_else(|| panic!("{l}: the default registry, plain crate://crates.io"));
            let rest = rest.trim_end_matches('\\').trim();
            let (name, version) = rest.split_once('/').expect("NAME/VERSION");
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
    for file in layer_metadata() {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(
            !text.contains("EDGEHUB_CRATE_REGISTRY"),
            "{}: crates come from crate://crates.io, mirrored with PREMIRRORS",
            file.display()
        );
    }
}

#[test]
fn update_crates_finds_only_the_workspace_lock() {
    // cargo-update-recipe-crates walks ${S} and adds every Cargo.lock it finds: a second one
    // (fuzz/, a vendored crate) would put its crates in the recipe.
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                if name != "target" && name != ".git" {
                    walk(&p, out);
                }
            } else if name == "Cargo.lock" {
                out.push(p);
            }
        }
    }
    let mut locks = Vec::new();
    walk(&repo("."), &mut locks);
    assert_eq!(locks, [repo("./Cargo.lock")]);
}

/// The recipe's LICENSE as a set, and the `LIC_FILES_CHKSUM` entries.
fn recipe_licences() -> (BTreeSet<String>, Vec<String>) {
    let inc = read(&format!("{RECIPE_DIR}/edgehub-licenses.inc"));
    let lic = assignment(&inc, "LICENSE").expect("LICENSE");
    let parsed = yocto::parse_licence(&lic, false).unwrap();
    let set = match parsed {
        Lic::And(v) => v
            .into_iter()
            .map(|l| match l {
                Lic::Id(id) => id,
                other => panic!("LICENSE is a plain list of licences, not {other:?}"),
            })
            .collect(),
        Lic::Id(id) => BTreeSet::from([id]),
        other => panic!("LICENSE: {other:?}"),
    };
    let files = multiline(&inc, "LIC_FILES_CHKSUM")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    (set, files)
}

#[test]
fn repository_has_a_licence_file() {
    let text = read("LICENSE");
    assert!(text.contains("Apache License"));
    assert!(text.contains("Version 2.0, January 2004"));
    assert!(text.contains("END OF TERMS AND CONDITIONS"));
    let cargo: toml::Value = toml::from_str(&read("Cargo.toml")).unwrap();
    assert_eq!(cargo["package"]["license"].as_str(), Some("Apache-2.0"));
}

#[test]
fn recipe_licences_cover_every_linked_crate_and_no_more() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let crates = yocto::linked_crates(&cargo, &repo(".")).unwrap();
    let want = yocto::licenses_inc(&repo("."), &crates).unwrap();
    let have = read(&format!("{RECIPE_DIR}/edgehub-licenses.inc"));
    assert!(
        have == want,
        "{RECIPE_DIR}/edgehub-licenses.inc is stale; regenerate it with\n  \
         cargo run -q -p edgehub-testsupport --bin yocto-crates -- licenses \
         > {RECIPE_DIR}/edgehub-licenses.inc"
    );
    assert!(recipe().contains("require edgehub-licenses.inc"));

    let (set, files) = recipe_licences();
    // Every linked crate's expression holds under LICENSE, and each licence in LICENSE is
    // needed by one: without it some crate's expression fails.
    let mut exprs: Vec<(String, Lic)> = crates
        .iter()
        .map(|c| {
            (
                format!("{} {}", c.name, c.version),
                yocto::parse_licence(&c.license, true).unwrap(),
            )
        })
        .collect();
    exprs.push(("the SQLite amalgamation".into(), Lic::Id("PD".into())));
    for (who, e) in &exprs {
        assert!(e.holds(&set), "{who}: {e:?} not covered by LICENSE {set:?}");
    }
    for id in &set {
        let mut without = set.clone();
        without.remove(id);
        assert!(
            exprs.iter().any(|(_, e)| !e.holds(&without)),
            "LICENSE lists {id}, which no linked crate needs"
        );
    }
    assert!(set.contains("Apache-2.0") && set.contains("MIT") && set.contains("PD"));
    assert!(crates.iter().any(|c| c.name == "rusqlite"), "the real list");
    assert!(
        // rcgen is linked (the device makes its own key and CSR); x509-parser is the test
        // support's alone.
        crates.iter().all(|c| c.name != "x509-parser"),
        "test support is not linked"
    );

    // LIC_FILES_CHKSUM: edgehub's LICENSE, and licence text of every registry crate.
    assert!(files[0].starts_with("file://LICENSE;md5="));
    let by_crate: BTreeMap<String, usize> = files[1..]
        .iter()
        .map(|f| {
            let rest = f
                .strip_prefix("file://${CARGO_VENDORING_DIRECTORY}/")
                .unwrap_or_else(|| panic!("{f}: a file of an unpacked crate"));
            rest.split('/').next().unwrap().to_string()
        })
        .fold(BTreeMap::new(), |mut m, k| {
            *m.entry(k).or_default() += 1;
            m
        });
    for c in crates.iter().filter(|c| c.registry) {
        assert!(
            by_crate.contains_key(&format!("{}-{}", c.name, c.version)),
            "no licence file of {} {} in LIC_FILES_CHKSUM",
            c.name,
            c.version
        );
    }
    // The checksum BitBake will compute of the root LICENSE.
    let md5 = yocto::licence_md5(&repo("LICENSE"), None).unwrap();
    assert_eq!(files[0], format!("file://LICENSE;md5={md5}"));
}

#[test]
fn readme_has_maintainer_submission_security_and_tells_how_it_links() {
    let readme = read(&format!("{LAYER}/README.md"));
    let sections: Vec<&str> = readme.lines().filter(|l| l.starts_with("## ")).collect();
    for want in [
        "## Maintainer",
        "## Submitting patches",
        "## Security",
        "## Releases",
    ] {
        assert!(
            sections.contains(&want),
            "README lacks {want}: {sections:?}"
        );
    }
    let section = |name: &str| -> String {
        let start = readme.find(name).unwrap() + name.len();
        let rest = &readme[start..];
        rest[..rest.find("\n## ").unwrap_or(rest.len())].to_string()
    };
    // yocto-check-layer's README test wants the words "maintainer" and "patch".
    assert!(readme.to_lowercase().contains("maintainer") && readme.contains("patch"));
    let security = read(&format!("{LAYER}/SECURITY.md"));
    // Addresses that cannot receive mail: tests/yocto_layer.rs.
    assert!(
        section("## Maintainer").contains("issue tracker"),
        "the maintainers are reached through the issue tracker"
    );
    let submit = section("## Submitting patches");
    assert!(
        submit.contains("issue") && submit.contains("[meta-edgehub]"),
        "{submit}"
    );
    assert!(security.contains("issue tracker") && security.contains("[meta-edgehub security]"));
    // The cargo class links against the image's C library; the README must not promise a
    // static binary for the Yocto build.
    assert!(!readme.contains("a static binary;"));
    assert!(readme.contains("linked dynamically against the image's C"));
    // Every supported series is named in the README's table, with its Rust.
    for (name, _, rust, released) in RELEASES {
        if *released && *rust >= rust_version() {
            let row = readme
                .lines()
                .find(|l| l.starts_with(&format!("| {name}")))
                .unwrap_or_else(|| panic!("README's release table lacks {name}"));
            assert!(
                row.contains(&format!("{}.{}.{}", rust.0, rust.1, rust.2)),
                "{row}"
            );
        }
    }
}

#[test]
fn kas_file_pins_bitbake_oe_core_and_the_layer_for_qemuarm64() {
    let kas: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&read("yocto/kas/edgehub.yml")).unwrap();
    assert_eq!(kas["machine"].as_str(), Some("qemuarm64"));
    assert!(kas["target"].as_str().unwrap().contains("image"));
    assert!(kas["header"]["version"].as_u64().unwrap() >= 16);
    let repos = &kas["repos"];
    for name in ["bitbake", "openembedded-core"] {
        let commit = repos[name]["commit"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} pinned"));
        assert!(
            commit.len() == 40 && commit.chars().all(|c| c.is_ascii_hexdigit()),
            "{name}: a full commit"
        );
    }
    // yocto-6.0.2 is wrynose's release: a series the layer claims.
    assert_eq!(
        repos["openembedded-core"]["tag"].as_str(),
        Some("yocto-6.0.2")
    );
    assert!(repos["openembedded-core"]["layers"]["meta"].is_null());
    assert!(
        repos["edgehub"]["url"].is_null()
            && repos["edgehub"]["layers"]["yocto/meta-edgehub"].is_null(),
        "the layer is this repository's"
    );
    assert!(kas["env"]
        .as_mapping()
        .unwrap()
        .contains_key("EDGEHUB_SRCREV"));
    let conf = kas["local_conf_header"]["edgehub"].as_str().unwrap();
    assert!(conf.contains("IMAGE_INSTALL:append = \" edgehub\""));
    assert!(conf.contains("EDGEHUB_GIT_URI = \"${EDGEHUB_LAYERDIR}/../..\""));
    assert!(
        read(&format!("{LAYER}/conf/layer.conf")).contains("EDGEHUB_LAYERDIR := \"${LAYERDIR}\"")
    );

    let virt: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&read("yocto/kas/virtualization.yml")).unwrap();
    for (name, layers) in [
        (
            "meta-openembedded",
            &[
                "meta-oe",
                "meta-python",
                "meta-networking",
                "meta-filesystems",
            ][..],
        ),
        ("meta-virtualization", &[][..]),
    ] {
        let r = &virt["repos"][name];
        assert_eq!(r["branch"].as_str(), Some("wrynose"), "{name}");
        assert_eq!(
            r["commit"].as_str().map(str::len),
            Some(40),
            "{name} pinned"
        );
        for l in layers {
            assert!(r["layers"][*l].is_null(), "{name}/{l}");
        }
    }
    let musl: serde_yaml_ng::Value = serde_yaml_ng::from_str(&read("yocto/kas/musl.yml")).unwrap();
    assert!(musl["local_conf_header"]["musl"]
        .as_str()
        .unwrap()
        .contains("TCLIBC = \"musl\""));
}

/// The settings of a unit's `[Service]` section that make systemd run the service in a mount
/// namespace of its own (systemd's `exec_needs_mount_namespace()`), as `Key=value` lines.
fn mount_namespace_settings(unit: &str) -> Vec<String> {
    // Booleans that create one when true.
    const BOOLEANS: &[&str] = &[
        "PrivateTmp",
        "PrivateDevices",
        "PrivateMounts",
        "PrivateNetwork",
        "PrivateIPC",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "MountAPIVFS",
        "DynamicUser",
    ];
    // Settings that create one whenever they are set, to anything but their default.
    const ANY: &[(&str, &str)] = &[
        ("ProtectSystem", "no"),
        ("ProtectHome", "no"),
        ("ProtectProc", "default"),
        ("ProcSubset", "all"),
        ("MountFlags", "shared"),
    ];
    // Settings that create one whenever they are present.
    const PRESENT: &[&str] = &[
        "ReadWritePaths",
        "ReadOnlyPaths",
        "InaccessiblePaths",
        "ExecPaths",
        "NoExecPaths",
        "BindPaths",
        "BindReadOnlyPaths",
        "TemporaryFileSystem",
        "RootDirectory",
        "RootImage",
        "MountImages",
        "ExtensionImages",
        "ExtensionDirectories",
        "NetworkNamespacePath",
        "IPCNamespacePath",
        "LogNamespace",
        "JoinsNamespaceOf",
    ];
    let truthy = |v: &str| ["yes", "true", "on", "1"].contains(&v.to_ascii_lowercase().as_str());
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with(';'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim(), v.trim()))
        .filter(|(k, v)| {
            (BOOLEANS.contains(k) && (truthy(v) || (*k == "PrivateTmp" && *v == "disconnected")))
                || ANY.iter().any(|(name, default)| {
                    k == name && !v.eq_ignore_ascii_case(default) && !v.is_empty()
                })
                || (PRESENT.contains(k) && !v.is_empty())
        })
        .map(|(k, v)| format!("{k}={v}"))
        .collect()
}

/// The check above catches what the shipped unit had, and each kind of setting.
#[test]
fn the_mount_namespace_check_knows_the_settings_that_create_one() {
    let old = "[Service]\nNoNewPrivileges=yes\nProtectSystem=full\nPrivateTmp=yes\n\
               ProtectKernelModules=yes\nProtectKernelLogs=yes\nProtectClock=yes\n\
               ProtectHostname=yes\n";
    assert_eq!(
        mount_namespace_settings(old),
        [
            "ProtectSystem=full",
            "PrivateTmp=yes",
            "ProtectKernelModules=yes",
            "ProtectKernelLogs=yes"
        ]
    );
    for bad in [
        "ProtectHome=read-only",
        "ReadOnlyPaths=/etc",
        "PrivateDevices=true",
        "MountFlags=slave",
        "TemporaryFileSystem=/var",
    ] {
        assert_eq!(mount_namespace_settings(bad), [bad]);
    }
    for fine in [
        "ProtectSystem=no",
        "PrivateTmp=no",
        "MountFlags=shared",
        "# ProtectSystem=full",
        "ProtectClock=yes",
        "SystemCallFilter=~@module",
    ] {
        assert_eq!(
            mount_namespace_settings(fine),
            Vec::<String>::new(),
            "{fine}"
        );
    }
}

#[test]
fn systemd_unit_is_notify_restart_always_hardened_and_verifies() {
    let unit = read(&format!("{RECIPE_DIR}/files/edgehub.service"));
    for want in [
        "Type=notify",
        "Restart=always",
        "StateDirectory=edgehub",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=~CAP_SYS_MODULE CAP_SYSLOG",
        "SystemCallFilter=~@module",
        "ExecStart=/usr/bin/edgehub run",
    ] {
        assert!(unit.lines().any(|l| l == want), "unit lacks {want}");
    }
    assert_eq!(
        mount_namespace_settings(&unit),
        Vec::<String>::new(),
        "these settings give edgehub a mount namespace of its own, whose tmpfs volumes \
         containerd cannot see (tests/security.rs shows what that does to a pod's token)"
    );
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

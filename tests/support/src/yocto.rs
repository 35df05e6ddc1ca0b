//! The crate list of meta-edgehub's recipe, generated from Cargo.lock, so that BitBake's crate
//! fetcher downloads exactly the crates (and checksums) cargo resolved.

use serde::Deserialize;

#[derive(Deserialize)]
struct Lock {
    #[serde(default)]
    package: Vec<Package>,
}

#[derive(Deserialize)]
struct Package {
    name: String,
    version: String,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    checksum: Option<String>,
}

/// `(name, version, sha256)` of every registry crate in a Cargo.lock.
pub fn registry_crates(cargo_lock: &str) -> Result<Vec<(String, String, String)>, String> {
    let lock: Lock = toml::from_str(cargo_lock).map_err(|e| format!("Cargo.lock: {e}"))?;
    let mut out = Vec::new();
    for p in lock.package {
        if !p
            .source
            .as_deref()
            .is_some_and(|s| s.starts_with("registry+"))
        {
            continue;
        }
        let sum = p
            .checksum
            .ok_or_else(|| format!("Cargo.lock: {} {} has no checksum", p.name, p.version))?;
        out.push((p.name, p.version, sum));
    }
    out.sort();
    Ok(out)
}

/// The text of `edgehub-crates.inc`.
pub fn crates_inc(cargo_lock: &str) -> Result<String, String> {
    let crates = registry_crates(cargo_lock)?;
    let mut s = String::from(
        "# Generated from Cargo.lock by `cargo run -q -p edgehub-testsupport --bin yocto-crates`.\n\
         # Do not edit: tests/yocto.rs fails when this file and Cargo.lock disagree.\n\
         # EDGEHUB_CRATE_REGISTRY is the crate registry's host, or a mirror's (set in local.conf).\n\
         SRC_URI += \" \\\n",
    );
    for (name, version, _) in &crates {
        s.push_str(&format!(
            "    crate://${{EDGEHUB_CRATE_REGISTRY}}/{name}/{version} \\\n"
        ));
    }
    s.push_str("\"\n\n");
    for (name, version, sum) in &crates {
        s.push_str(&format!(
            "SRC_URI[{name}-{version}.sha256sum] = \"{sum}\"\n"
        ));
    }
    Ok(s)
}

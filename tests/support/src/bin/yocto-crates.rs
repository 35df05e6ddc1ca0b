//! Prints meta-edgehub's generated files for the workspace:
//!
//!   cargo run -q -p edgehub-testsupport --bin yocto-crates \
//!       > yocto/meta-edgehub/recipes-core/edgehub/edgehub-crates.inc
//!   cargo run -q -p edgehub-testsupport --bin yocto-crates -- licenses \
//!       > yocto/meta-edgehub/recipes-core/edgehub/edgehub-licenses.inc
//!
//! The first is also what `bitbake -c update_crates edgehub` writes; the second needs the
//! crates' sources, so run `cargo fetch` first on a machine that has not built edgehub.

use anyhow::{bail, Context};
use edgehub_testsupport::yocto;
use std::path::Path;

fn main() -> anyhow::Result<()> {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    match std::env::args().nth(1).as_deref() {
        None | Some("crates") => {
            let lock = std::fs::read_to_string(root.join("Cargo.lock")).context("Cargo.lock")?;
            print!("{}", yocto::crates_inc(&lock).map_err(anyhow::Error::msg)?);
        }
        Some("licenses") => {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
            let crates = yocto::linked_crates(&cargo, root).map_err(anyhow::Error::msg)?;
            print!(
                "{}",
                yocto::licenses_inc(root, &crates).map_err(anyhow::Error::msg)?
            );
        }
        Some(other) => bail!("usage: yocto-crates [crates|licenses], not {other:?}"),
    }
    Ok(())
}

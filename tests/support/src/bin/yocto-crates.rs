//! Prints meta-edgehub's `edgehub-crates.inc` for the workspace's Cargo.lock:
//!
//!   cargo run -q -p edgehub-testsupport --bin yocto-crates \
//!       > yocto/meta-edgehub/recipes-core/edgehub/edgehub-crates.inc

fn main() -> anyhow::Result<()> {
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.lock"))?;
    print!(
        "{}",
        edgehub_testsupport::yocto::crates_inc(&lock).map_err(anyhow::Error::msg)?
    );
    Ok(())
}

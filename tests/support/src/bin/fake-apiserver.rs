//! The project's test apiserver as a standalone program, for the quickstart demo and manual
//! runs: it serves TLS on the given address, seeds the recorded fixtures (the node `edge-1`,
//! its pods, DaemonSets and ControllerRevisions), writes a kubeconfig for edgehub, and runs
//! until interrupted.
//!
//! Usage: fake-apiserver [--listen 127.0.0.1:6443] [--kubeconfig-dir DIR]

use edgehub_testsupport::{FakeApiServer, NODE_TOKEN};
use std::path::PathBuf;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut listen = "127.0.0.1:6443".to_string();
    let mut dir = PathBuf::from("fake-apiserver");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => listen = args.next().ok_or_else(|| anyhow::anyhow!("--listen needs a value"))?,
            "--kubeconfig-dir" => {
                dir = args.next().ok_or_else(|| anyhow::anyhow!("--kubeconfig-dir needs a value"))?.into()
            }
            other => anyhow::bail!("unknown argument {other:?}; usage: fake-apiserver [--listen ADDR] [--kubeconfig-dir DIR]"),
        }
    }
    let server = FakeApiServer::start_on(listen.parse()?).await?;
    server.seed_recorded_cluster();
    let kc = server.write_kubeconfig(&dir, NODE_TOKEN)?;
    println!(
        "fake apiserver on {} (node edge-1); kubeconfig: {}",
        server.url(),
        kc.display()
    );
    tokio::signal::ctrl_c().await?;
    Ok(())
}

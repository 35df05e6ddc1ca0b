//! The `edgehub` binary: a thin shell over the library. Each subcommand is one function here;
//! everything it does lives in a library module.

use anyhow::Context;
use clap::{Parser, Subcommand};
use edgehub::config::{Config, Overrides, Source};
use edgehub::kube::ApiClient;
use edgehub::store::{OpenMode, Store};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "edgehub",
    about = "Offline-capable OTA upgrades for DaemonSet pods on edge devices",
    version
)]
struct Cli {
    /// Config file (TOML). Default: /etc/edgehub/config.toml, if it exists.
    #[arg(long, global = true, env = "EDGEHUB_CONFIG")]
    config: Option<PathBuf>,
    /// Node name; default: the hostname.
    #[arg(long, global = true)]
    node_name: Option<String>,
    /// Data directory holding edgehub.db.
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    /// Kubeconfig with the node's credentials.
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// Local API address (IP:port).
    #[arg(long, global = true)]
    api_addr: Option<String>,
    /// CRI socket path.
    #[arg(long, global = true)]
    cri_socket: Option<PathBuf>,
    /// Log filter, e.g. `info` or `edgehub::sync=debug`.
    #[arg(long, global = true)]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent.
    Run {
        /// Start the cache over: empty it, or move an unusable database aside, then relist.
        #[arg(long)]
        reset_cache: bool,
    },
    /// Validate the configuration and kubeconfig, print the result, and exit.
    CheckConfig,
    /// Print the version.
    Version,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Version => {
            println!("edgehub {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Command::CheckConfig => check_config(&cli),
        Command::Run { reset_cache } => run(&cli, *reset_cache),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("edgehub: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(cli: &Cli) -> anyhow::Result<Config> {
    let source = match &cli.config {
        Some(p) => Source::Explicit(p.clone()),
        None => Source::Default,
    };
    let flags = Overrides {
        node_name: cli.node_name.clone(),
        data_dir: cli.data_dir.clone(),
        kubeconfig: cli.kubeconfig.clone(),
        api_addr: cli.api_addr.clone(),
        cri_socket: cli.cri_socket.clone(),
        log: cli.log.clone(),
    };
    Ok(Config::load(&source, &flags)?)
}

fn api_client(config: &Config) -> anyhow::Result<ApiClient> {
    Ok(ApiClient::from_config(config)?)
}

fn check_config(cli: &Cli) -> anyhow::Result<()> {
    let config = load_config(cli)?;
    println!("node_name   = {}", config.node_name);
    println!("data_dir    = {}", config.data_dir.display());
    println!("kubeconfig  = {}", config.kubeconfig.display());
    println!("api_addr    = {}", config.api_addr);
    println!("cri_socket  = {}", config.cri_socket.display());
    let client = api_client(&config)?;
    println!("apiserver   = {}", client.server());
    println!("config OK");
    Ok(())
}

fn run(cli: &Cli, reset_cache: bool) -> anyhow::Result<()> {
    let config = load_config(cli)?;
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&config.log))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(run_async(config, reset_cache))
}

async fn run_async(config: Config, reset_cache: bool) -> anyhow::Result<()> {
    let mode = if reset_cache {
        OpenMode::ResetCache
    } else {
        OpenMode::Normal
    };
    let store = Arc::new(Store::open(&config.db_path(), mode)?);
    tracing::info!(node = %config.node_name, db = %store.path().display(), "store open");
    let client = api_client(&config)?;
    tracing::info!(server = %client.server(), "sync starting");
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let sync = edgehub::sync::Sync::spawn(&config, client, store.clone(), shutdown_rx);

    wait_for_signal().await?;
    tracing::info!("shutting down");
    // Ignore the error: it only means every reflector already stopped.
    let _ = shutdown_tx.send(true);
    sync.join().await;
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot install SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot install SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

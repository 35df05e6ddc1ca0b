//! The `edgehub` binary: a thin shell over the library. Each subcommand is one function here;
//! everything it does lives in a library module.

#[cfg(feature = "controller")]
use anyhow::Context;
use clap::{Parser, Subcommand};
use edgehub::config::{Config, Overrides, Source};
use edgehub::kube::ApiClient;
use edgehub::local_client::{self as local};
use std::path::PathBuf;
use std::process::ExitCode;

#[path = "main/local.rs"]
mod local_cmds;
#[path = "main/run.rs"]
mod run_cmd;
#[path = "main/txn.rs"]
mod txn_cmds;

use local_cmds::{bootstrap, images_list, images_load, logs, pods, status, upgrade};
use run_cmd::run;
#[cfg(feature = "controller")]
use run_cmd::Signals;

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
    /// Local API address (IP:port), or `none` for the unix socket alone.
    #[arg(long, global = true)]
    api_addr: Option<String>,
    /// CRI socket path.
    #[arg(long, global = true)]
    cri_socket: Option<PathBuf>,
    /// Log filter: a level, or levels per target, e.g. `info` or `info,edgehub::sync=debug`.
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
    /// List the node's pods with their running and target revisions (asks the local API).
    Pods,
    /// Trigger the OTA upgrade of a pod (asks the local API); with --manual-commit, a
    /// transaction of one or more pods that stops at Verified for `edgehub commit` or
    /// `edgehub rollback`.
    Upgrade {
        /// The pods, as NAMESPACE/NAME; with --manual-commit several, each optionally
        /// NAMESPACE/NAME@REVISION (refused unless the cache's target revision is that one).
        #[arg(required = true, value_name = "NS/POD[@REV]")]
        pods: Vec<String>,
        /// Without --manual-commit: follow the upgrade to its end, printing each state. With
        /// it: wait until every pod is Verified (non-zero exit if it ends otherwise).
        #[arg(long)]
        wait: bool,
        /// Without --manual-commit: how long --wait follows the upgrade (seconds, or 90s,
        /// 5m; default 300). With it: the commit deadline (default from the config, 30m).
        #[arg(long, value_name = "D")]
        timeout: Option<String>,
        /// Start a transaction the OTA manager commits (`edgehub commit ID`) or rolls back
        /// (`edgehub rollback ID`); prints its id alone on the first line.
        #[arg(long)]
        manual_commit: bool,
    },
    /// Commit a transaction: the old revisions go; waits until every pod is Done.
    Commit {
        /// The transaction id `edgehub upgrade --manual-commit` printed.
        id: String,
    },
    /// Roll a transaction back: the old revisions run again; waits until they do, verified.
    Rollback {
        id: String,
        /// Why, for the cloud's UpgradeRolledBack Event.
        #[arg(long)]
        reason: Option<String>,
    },
    /// List the transactions, or show one.
    Transactions {
        id: Option<String>,
        /// The local API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show link state, cache sizes and active upgrades (asks the local API).
    Status,
    /// Hand a bootstrap token (`<id>.<secret>`) over to a node whose credentials lapsed, so
    /// it bootstraps again at once (asks the local API: PUT /v1/bootstrap-token).
    Bootstrap {
        /// A file holding the token, or `-` for standard input.
        #[arg(long, value_name = "FILE")]
        token_file: String,
    },
    /// Print a container's log as `kubectl logs` does, from the CRI log files on this node
    /// (asks the local API; works offline).
    Logs {
        /// The pod, as NAMESPACE/NAME.
        pod: String,
        /// The container; default: the pod's `kubectl.kubernetes.io/default-container`, else
        /// its first container.
        #[arg(short = 'c', long)]
        container: Option<String>,
        /// Keep printing lines as the container writes them, until it stops.
        #[arg(short = 'f', long)]
        follow: bool,
        /// The container's previous attempt, before its last restart.
        #[arg(short = 'p', long)]
        previous: bool,
        /// Only the last N lines (-1: all).
        #[arg(long, allow_negative_numbers = true)]
        tail: Option<i64>,
    },
    /// The node's images: size, the revisions that name them, what garbage collection would
    /// do with them; `images load` side-loads one (asks the local API).
    Images(ImagesArgs),
    /// Print the version.
    Version,
    /// Run the cloud-side controller: AdvancedRollingUpdate and OTA `PodNeedUpgrade` for
    /// OpenYurt-annotated OnDelete DaemonSets. Uses --kubeconfig, else KUBECONFIG,
    /// ~/.kube/config or the in-cluster service account.
    #[cfg(feature = "controller")]
    Controller(ControllerArgs),
}

#[derive(clap::Args)]
struct ImagesArgs {
    #[command(subcommand)]
    command: Option<ImagesCommand>,
}

#[derive(Subcommand)]
enum ImagesCommand {
    /// Import an image archive (OCI layout: skopeo copy ... oci-archive:FILE:NAME, or docker
    /// save), gzip or not, into the container runtime. Only images a cached DaemonSet
    /// revision of this node names are accepted, by digest where the template pins one.
    Load {
        /// The archive, or `-` for standard input.
        file: String,
        /// Import it even though no cached revision names it (the operator's override).
        #[arg(long)]
        force: bool,
    },
}

#[cfg(feature = "controller")]
#[derive(clap::Args)]
struct ControllerArgs {
    /// Where /metrics, /healthz and /readyz are served.
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_addr: std::net::SocketAddr,
    /// Run without the leader Lease (only ever one replica!).
    #[arg(long)]
    no_leader_elect: bool,
    /// Namespace of the leader Lease (in a pod: its own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    lease_namespace: String,
    #[arg(long, default_value = "edgehub-controller")]
    lease_name: String,
    /// This replica's name in the Lease. Default: the pod name, else the hostname.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a Lease stays valid without renewal.
    #[arg(long, default_value_t = 15)]
    lease_duration_secs: u64,
    /// Seconds the leader keeps trying to renew before it stops leading.
    #[arg(long, default_value_t = 10)]
    renew_deadline_secs: u64,
    /// Seconds between Lease attempts and renewals.
    #[arg(long, default_value_t = 2)]
    retry_period_secs: u64,
    /// Seconds between reconciles of a DaemonSet when nothing changes.
    #[arg(long, default_value_t = 300)]
    resync_secs: u64,
    /// Approve a node's first certificate only for a device whose factory certificate chains
    /// to this fleet CA (key ca.crt of configmap/<namespace>/<name> or
    /// secret/<namespace>/<name>), and deny the rest. Off without it.
    #[arg(long, value_name = "KIND/NAMESPACE/NAME")]
    attest_fleet_ca: Option<edgehub::controller::approve::CaSource>,
    /// Approve nodes' serving certificates (signer kubernetes.io/kubelet-serving) when the
    /// node itself asks for addresses its Node reports, and deny the rest. Off without it:
    /// they wait for `kubectl certificate approve`.
    #[arg(long)]
    approve_serving_certs: bool,
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
        Command::Pods => pods(&cli),
        Command::Upgrade {
            pods,
            wait,
            timeout,
            manual_commit: true,
        } => txn_cmds::start(&cli, pods, *wait, timeout.as_deref()),
        Command::Upgrade {
            pods,
            wait,
            timeout,
            manual_commit: false,
        } => upgrade(&cli, pods, *wait, timeout.as_deref()),
        Command::Commit { id } => txn_cmds::commit(&cli, id),
        Command::Rollback { id, reason } => txn_cmds::rollback(&cli, id, reason.as_deref()),
        Command::Transactions { id, json } => txn_cmds::show(&cli, id.as_deref(), *json),
        Command::Status => status(&cli),
        Command::Bootstrap { token_file } => bootstrap(&cli, token_file),
        Command::Images(ImagesArgs {
            command: Some(ImagesCommand::Load { file, force }),
        }) => images_load(&cli, file, *force),
        Command::Images(ImagesArgs { command: None }) => images_list(&cli),
        Command::Logs {
            pod,
            container,
            follow,
            previous,
            tail,
        } => logs(
            &cli,
            pod,
            &local::LogsRequest {
                container: container.as_deref(),
                follow: *follow,
                previous: *previous,
                tail: tail.and_then(|n| u64::try_from(n).ok()),
            },
        ),
        #[cfg(feature = "controller")]
        Command::Controller(args) => controller(&cli, args),
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
    Ok(config.api_client()?)
}

/// The node's client, and with `[identity] bootstrap_kubeconfig` the task that makes and
/// renews its credential.
fn node_client(
    config: &Config,
) -> anyhow::Result<(ApiClient, Option<edgehub::identity::Identity>)> {
    let Some(boot) = &config.identity.bootstrap_kubeconfig else {
        return Ok((api_client(config)?, None));
    };
    let opts = config.client_options();
    let (client, identity) = edgehub::identity::Identity::setup(
        &config.identity,
        boot,
        &config.data_dir,
        &config.node_name,
        opts,
    )?;
    Ok((client, Some(identity)))
}

fn check_config(cli: &Cli) -> anyhow::Result<()> {
    let config = load_config(cli)?;
    println!("node_name   = {}", config.node_name);
    println!("data_dir    = {}", config.data_dir.display());
    println!("kubeconfig  = {}", config.kubeconfig.display());
    match config.api_addr {
        Some(a) => println!("api_addr    = {a}"),
        None => println!("api_addr    = none (the unix socket alone)"),
    }
    if let Some(p) = &config.api.socket {
        println!("api.socket  = {}", p.display());
    }
    match edgehub::store::seal::load(&config.seal)? {
        Some(k) => println!("seal        = {}", k.source),
        None => println!("seal        = none (Secrets and tokens are kept in the clear)"),
    }
    println!("cri_socket  = {}", config.cri_socket.display());
    if let Some(p) = &config.api.token_file {
        edgehub::api::listen::read_token(&config.api)?;
        println!("api.token   = {} (read)", p.display());
    }
    // The credentials: the node's kubeconfig, or the bootstrap kubeconfig and the node
    // credential made from it.
    let now = std::time::SystemTime::now();
    let check = |what: &str, kc: &edgehub::kube::Kubeconfig| -> anyhow::Result<()> {
        for line in edgehub::identity::check::credentials(kc, now)
            .map_err(|e| anyhow::anyhow!("{what}: {e}"))?
        {
            println!("credential  = {what}: {line}");
        }
        Ok(())
    };
    match &config.identity.bootstrap_kubeconfig {
        None => check(
            "kubeconfig",
            &edgehub::kube::Kubeconfig::load(&config.kubeconfig)?,
        )?,
        Some(b) => {
            check("bootstrap_kubeconfig", &edgehub::kube::Kubeconfig::load(b)?)?;
            let node = edgehub::identity::files::credential_path(&config.data_dir);
            match std::fs::read_to_string(&node) {
                Ok(text) => match edgehub::identity::check::client_cert_dates(&text, now) {
                    Ok(line) => println!("credential  = node: {line}"),
                    // Not fatal: the next round goes back to the bootstrap credential.
                    Err(e) => println!("credential  = node: {e}; edgehub will bootstrap again"),
                },
                Err(_) => println!(
                    "credential  = node: none yet ({}); made at the first bootstrap",
                    node.display()
                ),
            }
        }
    }
    let (client, _) = node_client(&config)?;
    println!("apiserver   = {}", client.server());
    println!("config OK");
    Ok(())
}

/// `edgehub controller`: everything but flag parsing and signals is in the library.
#[cfg(feature = "controller")]
fn controller(cli: &Cli, args: &ControllerArgs) -> anyhow::Result<()> {
    use edgehub::controller;
    use std::time::Duration;
    let log = cli
        .log
        .clone()
        .or_else(|| std::env::var("EDGEHUB_LOG").ok())
        .unwrap_or_else(|| "info".into());
    let filter = edgehub::config::log_filter(&log)
        .map_err(|r| anyhow::anyhow!("--log / EDGEHUB_LOG: {r}"))?;
    init_logging(filter);
    let identity = match &args.identity {
        Some(i) => i.clone(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty())
            .context("no --identity, POD_NAME or hostname for the leader Lease")?,
    };
    let opts = controller::Options {
        kubeconfig: cli.kubeconfig.clone(),
        metrics_addr: args.metrics_addr,
        leader_elect: !args.no_leader_elect,
        lease_namespace: args.lease_namespace.clone(),
        lease_name: args.lease_name.clone(),
        identity,
        lease: controller::Timings {
            lease_duration: Duration::from_secs(args.lease_duration_secs),
            renew_deadline: Duration::from_secs(args.renew_deadline_secs),
            retry_period: Duration::from_secs(args.retry_period_secs),
        },
        resync: Duration::from_secs(args.resync_secs.max(1)),
        attest_fleet_ca: args.attest_fleet_ca.clone(),
        approve_serving: args.approve_serving_certs,
        ..controller::Options::default()
    };
    if opts.lease.renew_deadline >= opts.lease.lease_duration {
        anyhow::bail!("--renew-deadline-secs must be less than --lease-duration-secs, or two replicas could lead at once");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let mut signals = Signals::install()?;
        controller::run(opts, async move { signals.wait().await }).await?;
        Ok(())
    })
}

/// Logs to stderr through `filter`, in colour on a terminal (`run` and `controller`).
fn init_logging(filter: tracing_subscriber::filter::Targets) {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    tracing_subscriber::fmt()
        // The builder's own ceiling is INFO; the filter decides instead.
        .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .finish()
        .with(filter)
        .init();
}

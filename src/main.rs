//! The `edgehub` binary: a thin shell over the library. Each subcommand is one function here;
//! everything it does lives in a library module.

use anyhow::Context;
use clap::{Parser, Subcommand};
use edgehub::api::{self, listen};
use edgehub::config::{Config, Overrides, Source};
use edgehub::cri::{self, CriClient};
use edgehub::kube::ApiClient;
use edgehub::local_client::{self as local, LocalClient};
use edgehub::store::{OpenMode, Store};
use edgehub::{node, runtime};
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
    /// Trigger the OTA upgrade of a pod (asks the local API).
    Upgrade {
        /// The pod, as NAMESPACE/NAME.
        pod: String,
        /// Follow the upgrade to its end, printing each state.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this many seconds.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
    /// Show link state, cache sizes and active upgrades (asks the local API).
    Status,
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
        Command::Upgrade { pod, wait, timeout } => upgrade(&cli, pod, *wait, *timeout),
        Command::Status => status(&cli),
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
    let mut signals = Signals::install()?;
    let mode = if reset_cache {
        OpenMode::ResetCache
    } else {
        OpenMode::Normal
    };
    // Start-up order: the store, then the CRI, then the pod runtime, then the local API, then
    // the sync. Pods run and the cache is served before the apiserver has answered (or when
    // it never does).
    let key = edgehub::store::seal::load(&config.seal)?;
    match &key {
        Some(k) => {
            tracing::info!(key = %k.source, "Secrets and service-account tokens are sealed at rest with the device key")
        }
        None => tracing::warn!(db = %config.db_path().display(),
            "no device key ([seal] key_file, or the systemd credential edgehub-seal-key): Secrets and service-account tokens are kept on flash in the clear"),
    }
    let store = Arc::new(Store::open_with(&config.db_path(), mode, key)?);
    tracing::info!(node = %config.node_name, db = %store.path().display(), "store open");
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    edgehub::mountns::set_runtime_socket(&config.cri_socket);
    let cri_health = cri::spawn_monitor(CriClient::new(&config.cri_socket), shutdown_rx.clone());
    let token = listen::read_token(&config.api)?;
    let listeners = listen::bind(config.api_addr, &config.api).await?;
    let (client, identity) = node_client(&config)?;
    let identity_task = identity.map(|i| tokio::spawn(i.run(shutdown_rx.clone())));
    // Image garbage collection: after each commit and under disk pressure, which the Node
    // reports while it lasts.
    let (image_gc, image_pressure) = edgehub::images::ImageGc::new(
        CriClient::new(&config.cri_socket),
        store.clone(),
        config.images.gc,
    );
    let image_gc_stats = image_gc.stats();
    let probe = Arc::new(node::HostProbe {
        data_dir: config.data_dir.clone(),
        apiserver: node::server_host_port(client.server()),
        cri: cri_health.clone(),
        image_fs: Some(image_pressure),
    });
    let agent = node::NodeAgent::new(
        client.clone(),
        probe,
        config.node.clone(),
        config.node_name.clone(),
    );
    // The pod runtime: runs the cached pods through the CRI, with or without the link.
    let mut reconciler = runtime::Reconciler::new(
        CriClient::new(&config.cri_socket),
        store.clone(),
        Some(client.clone()),
        config.data_dir.clone(),
        config.node_name.clone(),
    );
    reconciler.adopt_timeout = config.report.adopt_timeout;
    reconciler.host_ip = node::server_host_port(client.server())
        .and_then(|a| node::local_ip_towards(&a))
        .map(|ip| ip.to_string());
    // The upgrade engine shares the runtime's pod locks, and holds the pods of unfinished
    // upgrades before the runtime's first pass (after a crash, a half-swapped pod is the
    // engine's to finish or roll back, not the runtime's to "repair").
    // Prepared (not started) here: the engine and the report sender follow its link state.
    let mut sync = edgehub::sync::Sync::prepare(
        &config.node_name,
        &config.sync,
        client.clone(),
        store.clone(),
    );
    let engine = Arc::new(edgehub::upgrade::Engine {
        cri: Arc::new(CriClient::new(&config.cri_socket)),
        store: store.clone(),
        locks: reconciler.locks.clone(),
        node_name: config.node_name.clone(),
        data_dir: config.data_dir.clone(),
        host_ip: reconciler.host_ip.clone(),
        config: config.upgrade.clone(),
        link: Some(sync.link.clone()),
    });
    let resumed = engine.claim_active()?;
    if resumed > 0 {
        tracing::info!(upgrades = resumed, "resuming unfinished upgrades");
    }
    let engine_task = tokio::spawn(engine.run(shutdown_rx.clone()));
    let runtime_task =
        tokio::spawn(reconciler.run(std::time::Duration::from_secs(10), shutdown_rx.clone()));
    // No kubelet rotates the containers' logs: edgehub does, as the kubelet would.
    let logs_task = tokio::spawn(
        edgehub::logs::rotate::Manager {
            cri: Arc::new(CriClient::new(&config.cri_socket)),
            node_name: config.node_name.clone(),
            data_dir: config.data_dir.clone(),
            policy: edgehub::logs::rotate::Policy::from_config(&config.logs),
            interval: config.logs.monitor_interval,
        }
        .run(shutdown_rx.clone()),
    );
    // What the pods reference (ConfigMaps, Secrets, tokens), fetched beside the runtime.
    let sources_task = tokio::spawn(
        edgehub::sources::fetch::Fetcher::new(client.clone(), store.clone())
            .run(shutdown_rx.clone()),
    );
    // The outbox's sender: what the runtime and the engine report, delivered in a task of its own.
    let report_task = tokio::spawn(
        {
            let mut r = edgehub::outbox::Sender::new(client, store.clone());
            r.revision_report = config.report.mode;
            r.reconnect_jitter = config.report.reconnect_jitter;
            r.max_rate = config.report.max_rate;
            r.retry.max = config.report.retry_max;
            r
        }
        .run(Some(sync.link.clone()), shutdown_rx.clone()),
    );
    // Side-loaded images: what a killed import left goes first, then the drop directory.
    let importer = Arc::new(edgehub::images::Importer::new(
        CriClient::new(&config.cri_socket),
        store.clone(),
        config.images.clone(),
        &config.node_name,
    ));
    let drop_task = {
        let importer = importer.clone();
        let dir = config.images.drop_dir.clone();
        let shutdown = shutdown_rx.clone();
        tokio::spawn(async move {
            match importer.clean_leftovers().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(imports = n, "removed interrupted image imports"),
                Err(e) => tracing::warn!(error = %e, "cannot look for interrupted image imports"),
            }
            if let Some(dir) = dir {
                edgehub::images::drop::run(importer, dir, shutdown).await;
            }
        })
    };
    let gc_task = tokio::spawn(image_gc.run(config.images.gc_interval, shutdown_rx.clone()));
    let state = Arc::new(api::ApiState {
        store: store.clone(),
        link: sync.link.clone(),
        sync_stats: sync.stats.clone(),
        metrics: Default::default(),
        token,
        node_name: config.node_name.clone(),
        cri: cri_health,
        runtime: Some(CriClient::new(&config.cri_socket)),
        streams: Default::default(),
        images: Some(importer.clone()),
        image_gc: Some(image_gc_stats),
    });
    let mut servers = Vec::new();
    for l in listeners {
        servers.push(tokio::spawn(api::serve(
            l,
            state.clone(),
            shutdown_rx.clone(),
        )));
    }
    tracing::info!(addr = ?config.api_addr, socket = ?config.api.socket, "local API serving");
    sync.start(shutdown_rx.clone());
    let node_task = tokio::spawn(agent.run(sync.link.clone(), shutdown_rx.clone()));
    edgehub::notify::notify("READY=1");

    signals.wait().await;
    tracing::info!("shutting down");
    edgehub::notify::notify("STOPPING=1");
    // Ignore the error: it only means every task already stopped.
    let _ = shutdown_tx.send(true);
    for s in servers {
        let _ = s.await;
    }
    let _ = node_task.await;
    let _ = gc_task.await;
    let _ = runtime_task.await;
    let _ = logs_task.await;
    let _ = engine_task.await;
    let _ = sources_task.await;
    let _ = report_task.await;
    let _ = drop_task.await;
    if let Some(t) = identity_task {
        let _ = t.await;
    }
    sync.join().await;
    tracing::info!("stopped");
    Ok(())
}

/// SIGTERM and SIGINT, caught from the moment this is created: installed at the start of
/// `run`, a signal sent right after READY=1 (or during start-up) still ends in a clean
/// shutdown instead of the default action killing the process.
///
/// SIGHUP is caught too. Its default action kills the process on the spot, with no clean
/// stop: no checkpointed cursor, tasks cut mid-step. It comes from `systemctl reload`, a
/// `kill -HUP` out of habit, or the terminal of a field engineer's ssh session closing.
/// edgehub does not reload its configuration, so it says so and keeps running.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot install SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("cannot install SIGINT handler")?,
            hup: signal(SignalKind::hangup()).context("cannot install SIGHUP handler")?,
        })
    }

    /// Returns on SIGTERM or SIGINT.
    async fn wait(&mut self) {
        loop {
            tokio::select! {
                _ = self.term.recv() => return,
                _ = self.int.recv() => return,
                _ = self.hup.recv() => tracing::warn!(
                    "SIGHUP received: edgehub does not reload its configuration and keeps \
                     running; restart it to apply a changed configuration"
                ),
            }
        }
    }
}

/// `edgehub controller`: everything but flag parsing and signals is in the library.
#[cfg(feature = "controller")]
fn controller(cli: &Cli, args: &ControllerArgs) -> anyhow::Result<()> {
    use edgehub::controller;
    use std::io::IsTerminal;
    use std::time::Duration;
    let log = cli
        .log
        .clone()
        .or_else(|| std::env::var("EDGEHUB_LOG").ok())
        .unwrap_or_else(|| "info".into());
    edgehub::config::check_log_filter(&log)
        .map_err(|r| anyhow::anyhow!("--log / EDGEHUB_LOG: {r}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&log))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
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

/// A client for this node's local API, from the same configuration `edgehub run` uses.
fn local_client(cli: &Cli) -> anyhow::Result<LocalClient> {
    let config = load_config(cli)?;
    Ok(LocalClient::for_config(
        &config,
        listen::read_token(&config.api)?,
        std::time::Duration::from_secs(30),
    ))
}

fn pods(cli: &Cli) -> anyhow::Result<()> {
    let a = local_client(cli)?.get("/pods")?;
    if a.status != 200 {
        anyhow::bail!("GET /pods: {} {}", a.status, a.body.trim());
    }
    print!(
        "{}",
        local::pods_table(&a.body).map_err(anyhow::Error::msg)?
    );
    Ok(())
}

fn status(cli: &Cli) -> anyhow::Result<()> {
    let a = local_client(cli)?.get("/v1/status")?;
    if a.status != 200 {
        anyhow::bail!("GET /v1/status: {} {}", a.status, a.body.trim());
    }
    print!(
        "{}",
        local::status_text(&a.body).map_err(anyhow::Error::msg)?
    );
    Ok(())
}

fn images_list(cli: &Cli) -> anyhow::Result<()> {
    let a = local_client(cli)?.get("/v1/images")?;
    if a.status != 200 {
        anyhow::bail!("{} ({})", a.body.trim(), a.status);
    }
    print!(
        "{}",
        local::images_table(&a.body).map_err(anyhow::Error::msg)?
    );
    Ok(())
}

fn images_load(cli: &Cli, file: &str, force: bool) -> anyhow::Result<()> {
    let (reader, len): (Box<dyn std::io::Read + Send>, Option<u64>) = if file == "-" {
        (Box::new(std::io::stdin()), None)
    } else {
        let f = std::fs::File::open(file).with_context(|| format!("cannot open {file}"))?;
        let len = f.metadata().ok().map(|m| m.len());
        (Box::new(f), len)
    };
    let path = if force {
        "/v1/images/load?force=true"
    } else {
        "/v1/images/load"
    };
    let a = local_client(cli)?.upload(path, reader, len)?;
    if a.status != 200 {
        anyhow::bail!("{} ({})", a.body.trim(), a.status);
    }
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap_or_default();
    for name in v["images"].as_array().into_iter().flatten() {
        println!("loaded {}", name.as_str().unwrap_or_default());
    }
    Ok(())
}

fn logs(cli: &Cli, pod: &str, req: &local::LogsRequest<'_>) -> anyhow::Result<()> {
    let path = local::logs_path(pod, req).map_err(anyhow::Error::msg)?;
    let header = |h: &hyper::HeaderMap, name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let mut on_head = |h: &hyper::HeaderMap| {
        let notice = local::defaulted_notice(
            header(h, api::CONTAINER_HEADER).as_deref(),
            header(h, api::CONTAINERS_HEADER).as_deref(),
        );
        if let Some(n) = notice {
            eprintln!("{n}");
        }
    };
    let refused =
        local_client(cli)?.get_streaming(&path, &mut on_head, &mut std::io::stdout().lock())?;
    if let Some(a) = refused {
        anyhow::bail!("{} {}", a.status, a.body.trim());
    }
    Ok(())
}

fn upgrade(cli: &Cli, pod: &str, wait: bool, timeout_secs: u64) -> anyhow::Result<()> {
    let path = local::upgrade_path(pod, "upgrade").map_err(anyhow::Error::msg)?;
    let client = local_client(cli)?;
    let a = client.post(&path)?;
    if a.status != 200 {
        anyhow::bail!("{} {}", a.status, a.body.trim());
    }
    println!("{}", a.body.trim());
    if !wait {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout_secs);
    let mut last = String::new();
    loop {
        let a = client.get(&path)?;
        if a.status != 200 {
            anyhow::bail!("{} {}", a.status, a.body.trim());
        }
        let v: serde_json::Value = serde_json::from_str(&a.body)?;
        let state = v["state"].as_str().unwrap_or("?").to_string();
        if state != last {
            println!("{pod}: {state}");
            last = state.clone();
        }
        match state.as_str() {
            "Done" => return Ok(()),
            "RolledBack" | "Failed" => anyhow::bail!(
                "upgrade of {pod} ended {state}: {}",
                v["error"].as_str().unwrap_or("no error recorded")
            ),
            _ => {}
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("gave up after {timeout_secs}s; the upgrade of {pod} is still {state}");
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

//! `edgehub run`: the device process. Every task is built from the configuration and wired
//! together here (the store, the apiserver client and identity, the node agent, the runtime,
//! the upgrade engine, the outbox, logs, images and their collection, the local API), then
//! run until SIGTERM or SIGINT.

use anyhow::Context;
use edgehub::api::{self, listen};
use edgehub::config::Config;
use edgehub::cri::{self, CriClient};
use edgehub::store::{OpenMode, Store};
use edgehub::{node, runtime};
use std::sync::Arc;

use super::{load_config, node_client};

pub fn run(cli: &super::Cli, reset_cache: bool) -> anyhow::Result<()> {
    let config = load_config(cli)?;
    // The config's loading checked the filter already; this only parses it again.
    let filter = edgehub::config::log_filter(&config.log)
        .map_err(|r| anyhow::anyhow!("the config's log filter: {r}"))?;
    super::init_logging(filter);
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
    // One CRI connection for everything on the main runtime (the health check, image GC and
    // import, the upgrade engine, log rotation, the local and node APIs): a channel is a
    // buffer task with a 32-request block (9 KiB, heaptrack) and, once used, an HTTP/2
    // connection with its buffers, and each of these users had its own: six channels more
    // than needed. Calls multiplex as streams on the one connection. The pod runtime has its
    // own, on its own thread.
    let cri_client = CriClient::new(&config.cri_socket);
    let cri_health = cri::spawn_monitor(cri_client.clone(), shutdown_rx.clone());
    let token = listen::read_token(&config.api)?;
    let socket_access = listen::socket_access(&config.api)?;
    let listeners = listen::bind(config.api_addr, &config.api).await?;
    let (client, mut identity) = node_client(&config)?;
    // The handed-over bootstrap token is sealed with the same device key as Secrets.
    let identity_handle = match identity.as_mut() {
        Some(i) => {
            let seal = edgehub::store::seal::load(&config.seal)?
                .map(|k| Arc::new(k) as Arc<dyn edgehub::identity::handover::TokenSeal>);
            i.set_seal(seal);
            Some(api::identity::IdentityHandle {
                status: i.status(),
                handover: i.handover(),
            })
        }
        None => None,
    };
    let identity_task = identity.map(|i| tokio::spawn(i.run(shutdown_rx.clone())));
    // Image garbage collection: after each commit and under disk pressure, which the Node
    // reports while it lasts.
    let (image_gc, image_pressure) =
        edgehub::images::ImageGc::new(cri_client.clone(), store.clone(), config.images.gc);
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
    )
    // The sync's watch of this Node tells the agent when the cloud overrode its Ready.
    .with_cache(store.clone());
    let node_api_task = match config.node_api.addr {
        Some(addr) => {
            Some(start_node_api(&config, &client, &store, &cri_client, addr, &shutdown_rx).await?)
        }
        None => None,
    };
    // The pod runtime: runs the cached pods through the CRI, with or without the link. It
    // runs on a thread of its own (`PodsThread`), with its CRI connection made there.
    let pods_thread = PodsThread::new()?;
    let mut reconciler = runtime::Reconciler::new(
        pods_thread.cri_client(&config.cri_socket),
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
        cri: Arc::new(cri_client.clone()),
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
    let runtime_task = pods_thread
        .spawn(reconciler.run(std::time::Duration::from_secs(10), shutdown_rx.clone()))?;
    // No kubelet rotates the containers' logs: edgehub does, as the kubelet would.
    let logs_task = tokio::spawn(
        edgehub::logs::rotate::Manager {
            cri: Arc::new(cri_client.clone()),
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
        cri_client.clone(),
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
        socket: socket_access,
        node_name: config.node_name.clone(),
        cri: cri_health,
        runtime: Some(cri_client.clone()),
        streams: Default::default(),
        images: Some(importer.clone()),
        image_gc: Some(image_gc_stats),
        identity: identity_handle,
        pods: Default::default(),
        commit_deadline: config.upgrade.manual_commit_deadline,
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
    if let Some((cert, server)) = node_api_task {
        let _ = cert.await;
        let _ = server.await;
    }
    sync.join().await;
    tracing::info!("stopped");
    Ok(())
}

/// The thread the pod runtime runs on: a current-thread tokio runtime of its own.
///
/// An idle node's work is the runtime's: a relist every second (two CRI calls) and the
/// probes. On the two-worker runtime each of those wake-ups woke both workers, and each CRI
/// call crossed between them on its way through tonic's buffer task and the h2 connection
/// task (about nine context switches per call, 1,700 per idle minute with two probed pods).
/// Here the timer, the calls, their connection (made from this runtime, so its tasks live
/// here) and the probes' tasks are all polled by one thread, which sleeps in between. The
/// local API, the sync and the engine keep the two workers, so a slow pass here delays no
/// request there, and the reverse.
struct PodsThread {
    rt: tokio::runtime::Runtime,
}

impl PodsThread {
    fn new() -> anyhow::Result<PodsThread> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the pod runtime's async runtime")?;
        Ok(PodsThread { rt })
    }

    /// A CRI client whose connection tasks (tonic's buffer, the h2 connection) are spawned
    /// on this thread's runtime: `Channel` spawns its buffer task when it is made.
    fn cri_client(&self, socket: &std::path::Path) -> CriClient {
        let _inside = self.rt.enter();
        CriClient::new(socket)
    }

    /// Runs `task` to its end on the thread; the returned handle ends with it.
    fn spawn<F>(self, task: F) -> anyhow::Result<tokio::sync::oneshot::Receiver<()>>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("edgehub-pods".into())
            .spawn(move || {
                self.rt.block_on(task);
                // Ignore the error: nobody waits when the process is already going.
                let _ = done_tx.send(());
            })
            .context("cannot start the pod runtime's thread")?;
        Ok(done_rx)
    }
}

/// SIGTERM and SIGINT, caught from the moment this is created: installed at the start of
/// `run`, a signal sent right after READY=1 (or during start-up) still ends in a clean
/// shutdown instead of the default action killing the process.
///
/// SIGHUP is caught too. Its default action kills the process on the spot, with no clean
/// stop: no checkpointed cursor, tasks cut mid-step. It comes from `systemctl reload`, a
/// `kill -HUP` out of habit, or the terminal of a field engineer's ssh session closing.
/// edgehub does not reload its configuration, so it says so and keeps running.
pub struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    pub fn install() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot install SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("cannot install SIGINT handler")?,
            hup: signal(SignalKind::hangup()).context("cannot install SIGHUP handler")?,
        })
    }

    /// Returns on SIGTERM or SIGINT.
    pub async fn wait(&mut self) {
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

/// The node's API on port 10250 (`[node] node_api_addr`): the serving-certificate task (a
/// kubelet-serving CSR for the Node's Hostname and InternalIP, or self-signed on opt-in) and
/// the server, which answers no handshake until a certificate exists.
async fn start_node_api(
    config: &Config,
    client: &edgehub::kube::ApiClient,
    store: &Arc<Store>,
    cri_client: &CriClient,
    addr: std::net::SocketAddr,
    shutdown: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<(tokio::task::JoinHandle<()>, tokio::task::JoinHandle<()>)> {
    use edgehub::identity::serving::{Sans, ServingCert};
    use edgehub::kubelet_api::{reviews, KubeletApi};
    let apiserver = node::server_host_port(client.server());
    let node_name = config.node_name.clone();
    let sans = Arc::new(move || Sans {
        dns: vec![node_name.clone()],
        ips: apiserver
            .as_deref()
            .and_then(node::local_ip_towards)
            .into_iter()
            .collect(),
    });
    let (cert, serving) = ServingCert::setup(
        client.clone(),
        &config.data_dir,
        &config.node_name,
        sans,
        None,
        config.node_api.self_signed,
    )?;
    let reviewer = reviews::Reviewer::new(
        client.clone(),
        &config.node_name,
        reviews::CacheTtl::default(),
    );
    let api = Arc::new(KubeletApi::new(
        &config.node_api,
        &config.node_name,
        Some(cri_client.clone()),
        reviewer,
        store.clone(),
        &config.data_dir,
        serving,
    )?);
    let listener = KubeletApi::bind(addr).await?;
    tracing::info!(%addr, "node API listening (served once a serving certificate exists)");
    Ok((
        tokio::spawn(cert.run(shutdown.clone())),
        tokio::spawn(api.serve(listener, shutdown.clone())),
    ))
}

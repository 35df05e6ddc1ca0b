//! The test's handle on the fake: seeding and editing objects, faults (failures, lost answers, stalls, offline), tokens and RBAC switches, and the request log.

use super::*;

impl FakeApiServer {
    /// Starts on 127.0.0.1 with a random port.
    pub async fn start() -> anyhow::Result<FakeApiServer> {
        Self::start_on("127.0.0.1:0".parse()?).await
    }

    pub async fn start_on(addr: SocketAddr) -> anyhow::Result<FakeApiServer> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let pki = Arc::new(TestPki::generate()?);
        let tls = Arc::new(server_tls(&pki)?);
        let (rv_tx, _) = watch::channel(0);
        let (kill_tx, _) = watch::channel(0);
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            db: Mutex::new(Db::default()),
            rv_tx,
            faults: Mutex::new(Faults::default()),
            stalled: AtomicBool::new(false),
            held: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
            tokens: Mutex::new(HashMap::from([
                (NODE_TOKEN.to_string(), NODE_USER.to_string()),
                (ADMIN_TOKEN.to_string(), "admin".to_string()),
            ])),
            certs: Mutex::new(HashMap::new()),
            csr: Mutex::new(csr::CsrState::default()),
            reviews: Mutex::new(reviews::Rbac::default()),
            pki: pki.clone(),
            kill_tx,
            rbac_edgehub: AtomicBool::new(true),
            bookmark_ms: AtomicU64::new(60_000),
            authorizer_lag_ms: AtomicU64::new(0),
            uid_counter: AtomicU64::new(1),
            token_len: AtomicU64::new(0),
            addr,
            kubelet: kubelet::KubeletClient::new(&pki)?,
            proxy_users: Mutex::new(Default::default()),
            loopback_node_proxy: AtomicBool::new(false),
            metrics: Mutex::new(Default::default()),
        });
        let server = FakeApiServer {
            addr,
            pki,
            state,
            tls,
            accept: Mutex::new(None),
        };
        server.spawn_accept(listener);
        Ok(server)
    }

    fn spawn_accept(&self, listener: TcpListener) {
        let state = self.state.clone();
        let acceptor = tokio_rustls::TlsAcceptor::from(self.tls.clone());
        let h = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let state = state.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let mut kill = state.kill_tx.subscribe();
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let cert_user = tls
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .map(|c| lock(&state.certs).get(c.as_ref()).cloned());
                    let st = state.clone();
                    let svc = hyper::service::service_fn(move |req| {
                        let st = st.clone();
                        let cu = cert_user.clone();
                        // An error closes the connection without an answer.
                        async move { handle(st, cu, req).await }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                        .with_upgrades();
                    tokio::select! {
                        _ = conn => {}
                        _ = kill.changed() => {}
                    }
                });
            }
        });
        *lock(&self.accept) = Some(h);
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Writes a kubeconfig for this server into `dir` and returns its path.
    pub fn write_kubeconfig(
        &self,
        dir: &std::path::Path,
        token: &str,
    ) -> anyhow::Result<std::path::PathBuf> {
        std::fs::create_dir_all(dir)?;
        let ca = dir.join("ca.crt");
        std::fs::write(&ca, &self.pki.ca_pem)?;
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            kubeconfig_yaml(&self.url(), "ca.crt", &format!("token: {token}")),
        )?;
        Ok(path)
    }

    /// Writes a kubeconfig that authenticates with a fresh client certificate for `user`.
    pub fn write_cert_kubeconfig(
        &self,
        dir: &std::path::Path,
        user: &str,
    ) -> anyhow::Result<std::path::PathBuf> {
        std::fs::create_dir_all(dir)?;
        let cert = self.pki.client_cert(user, "system:nodes")?;
        let mut groups = Vec::new();
        if user.starts_with("system:node:") {
            groups.push("system:nodes".to_string());
        }
        groups.push("system:authenticated".to_string());
        lock(&self.state.certs).insert(
            cert.der.clone(),
            csr::CertIdentity {
                user: user.to_string(),
                groups,
                not_before: std::time::UNIX_EPOCH,
                not_after: std::time::SystemTime::now() + Duration::from_secs(10 * 365 * 86_400),
                credential_id: csr::credential_id(&cert.der),
            },
        );
        std::fs::write(dir.join("ca.crt"), &self.pki.ca_pem)?;
        std::fs::write(dir.join("client.crt"), &cert.cert_pem)?;
        std::fs::write(dir.join("client.key"), &cert.key_pem)?;
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            kubeconfig_yaml(
                &self.url(),
                "ca.crt",
                "client-certificate: client.crt\n    client-key: client.key",
            ),
        )?;
        Ok(path)
    }

    // ---- state manipulation, as the cloud side would do it ----

    /// Creates or replaces an object (kind and apiVersion are filled in), bumping the
    /// resourceVersion and emitting ADDED or MODIFIED. Returns the stored object.
    pub fn apply(&self, plural: &str, mut obj: Value) -> Value {
        let rt = resource_type(plural);
        let mut db = lock(&self.state.db);
        fill_type(&mut obj, rt);
        let key = key_of(rt, &obj);
        let prev = db.objects.get(&key).cloned();
        if obj.pointer("/metadata/uid").is_none() {
            let uid = prev
                .as_ref()
                .and_then(|p| p.pointer("/metadata/uid").cloned())
                .unwrap_or_else(|| Value::String(self.state.new_uid()));
            obj["metadata"]["uid"] = uid;
        }
        commit(&self.state, &mut db, rt, key, obj, prev)
    }

    /// Changes an existing object in place with `f`.
    pub fn modify(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Value {
        let mut obj = self
            .get(plural, namespace, name)
            .unwrap_or_else(|| panic!("no {plural} {namespace}/{name}"));
        f(&mut obj);
        self.apply(plural, obj)
    }

    /// Deletes an object at once, emitting DELETED.
    pub fn remove(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        let rt = resource_type(plural);
        let mut db = lock(&self.state.db);
        remove_locked(&self.state, &mut db, rt, namespace, name)
    }

    pub fn get(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.state.db)
            .objects
            .get(&(plural.to_string(), namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Waits for the object to satisfy `pred`, looking at it again at each write the server
    /// commits (no polling): `Ok` with the object, or, after `timeout`, `Err` with what it
    /// last was (`Null` when absent).
    pub async fn wait_for_object(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Result<Value, Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut writes = self.state.rv_tx.subscribe();
        loop {
            let now = self.get(plural, namespace, name).unwrap_or(Value::Null);
            if pred(&now) {
                return Ok(now);
            }
            match tokio::time::timeout_at(deadline, writes.changed()).await {
                Ok(Ok(())) => {}
                _ => return Err(now),
            }
        }
    }

    pub fn list(&self, plural: &str) -> Vec<Value> {
        lock(&self.state.db)
            .objects
            .iter()
            .filter(|((p, _, _), _)| p == plural)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Loads the items of a recorded list response (a fixture) as they are, keeping their
    /// resourceVersions, and moves the server's version past the list's.
    pub fn seed_list(&self, plural: &str, list: &Value) {
        let rt = resource_type(plural);
        let mut db = lock(&self.state.db);
        for item in list["items"].as_array().cloned().unwrap_or_default() {
            let mut obj = item;
            fill_type(&mut obj, rt);
            let key = key_of(rt, &obj);
            db.objects.insert(key, obj);
        }
        let list_rv: u64 = list
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        db.rv = db.rv.max(list_rv);
        self.state.rv_tx.send_replace(db.rv);
    }

    /// The recorded cluster of the fixtures: node edge-1, its two DaemonSet pods, the two
    /// DaemonSets and their first ControllerRevisions.
    pub fn seed_recorded_cluster(&self) {
        self.seed_list("pods", &crate::fixture_body("pods_list_node"));
        self.seed_list(
            "daemonsets",
            &crate::fixture_body("daemonsets_list_as_node"),
        );
        self.seed_list(
            "controllerrevisions",
            &crate::fixture_body("controllerrevisions_list_rev1"),
        );
        self.apply("nodes", crate::fixture_body("node_get_self"));
        // What the recorded pods reference: their ConfigMap, and the two CA bundles of the
        // projected token volume (the recording's apiserver is OpenShift's build).
        self.apply("configmaps", crate::fixture_body("configmap_get_as_node"));
        let ca = self.pki.ca_pem.clone();
        for (name, key) in [
            ("kube-root-ca.crt", "ca.crt"),
            ("openshift-service-ca.crt", "service-ca.crt"),
        ] {
            self.apply(
                "configmaps",
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": name, "namespace": "vehicle"},
                       "data": {key: ca}}),
            );
        }
    }

    /// Plays the fleet operator as the recording did: rolls the recorded `telemetry`
    /// DaemonSet to `127.0.0.1:5000/busybox:2.0` (a second ControllerRevision appears).
    pub fn roll_telemetry(&self) {
        for item in crate::fixture_body("controllerrevisions_list_rev2")["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            self.apply("controllerrevisions", item);
        }
        self.apply("daemonsets", crate::fixture_body("daemonset_after_update"));
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.state.db).rv
    }

    /// Forgets history up to now: watches and continue tokens from older versions get 410.
    pub fn compact(&self) {
        let mut db = lock(&self.state.db);
        db.compacted = db.rv;
        db.history.clear();
    }

    /// The cluster's objects and resourceVersion, as an etcd backup holds them.
    pub fn snapshot(&self) -> Snapshot {
        let db = lock(&self.state.db);
        Snapshot {
            rv: db.rv,
            objects: db.objects.clone(),
        }
    }

    /// An etcd restore from `snap`, as an operator does it: the objects and the
    /// resourceVersion go back to the backup's, and the apiserver restarts (every connection
    /// drops). Its new watch cache starts at the restored version, so older versions get 410
    /// and newer ones (a client's cursor from before the restore) are "too large".
    pub fn restore(&self, snap: &Snapshot) {
        {
            let mut db = lock(&self.state.db);
            db.objects = snap.objects.clone();
            db.rv = snap.rv;
            db.compacted = snap.rv;
            db.history.clear();
            self.state.rv_tx.send_replace(db.rv);
        }
        self.state.kill_tx.send_modify(|v| *v += 1);
    }

    // ---- knobs ----

    /// The next `n` requests whose path and query contain every string of `uri_contains` fail
    /// with `status`.
    pub fn fail_next(
        &self,
        n: usize,
        status: u16,
        retry_after: Option<u64>,
        uri_contains: &[&str],
    ) {
        let mut f = lock(&self.state.faults);
        for _ in 0..n {
            f.fail_next.push_back(Failure {
                status,
                retry_after,
                uri_contains: uri_contains.iter().map(|s| s.to_string()).collect(),
            });
        }
    }

    /// Forgets the failures [`Self::fail_next`] queued that no request has met yet.
    pub fn clear_failures(&self) {
        lock(&self.state.faults).fail_next.clear();
    }

    /// The next `n` requests with this method whose path and query contain every string of
    /// `uri_contains` are carried out (committed, watchers told) but get no answer: their
    /// connection is closed instead, as when the link drops after the apiserver's commit.
    pub fn lose_next_answers(&self, n: usize, method: &str, uri_contains: &[&str]) {
        self.lose_answers(n, method, uri_contains, false)
    }

    /// As [`Self::lose_next_answers`], once, and the server stalls from that moment (see
    /// [`Self::stall`]): the link stays down right after the write landed, before any watch
    /// could tell of it.
    pub fn lose_next_answer_and_stall(&self, method: &str, uri_contains: &[&str]) {
        self.lose_answers(1, method, uri_contains, true)
    }

    fn lose_answers(&self, n: usize, method: &str, uri_contains: &[&str], then_stall: bool) {
        let mut f = lock(&self.state.faults);
        for _ in 0..n {
            f.lose_answers.push_back(LostAnswer {
                method: method.to_string(),
                uri_contains: uri_contains.iter().map(|s| s.to_string()).collect(),
                then_stall,
            });
        }
    }

    /// The next `n` watch events are cut in the middle, ending their streams.
    pub fn cut_next_watch_events(&self, n: usize) {
        lock(&self.state.faults).cut_watch_events += n;
    }

    /// A malformed line is sent before each of the next `n` watch events.
    pub fn corrupt_next_watch_events(&self, n: usize) {
        lock(&self.state.faults).corrupt_watch_events += n;
    }

    /// While stalled, requests get no answer and watches send nothing.
    pub fn stall(&self, on: bool) {
        self.state.stalled.store(on, Ordering::SeqCst);
    }

    /// Requests that arrived while stalled and are waiting for their answer.
    pub fn held_requests(&self) -> u64 {
        self.state.held.load(Ordering::SeqCst)
    }

    /// Offline: the port refuses connections and open ones are dropped. Online: listen again
    /// on the same port.
    pub async fn set_offline(&self, offline: bool) -> anyhow::Result<()> {
        if offline {
            let handle = lock(&self.accept).take();
            if let Some(h) = handle {
                h.abort();
                let _ = h.await;
            }
            self.state.kill_tx.send_modify(|v| *v += 1);
        } else if lock(&self.accept).is_none() {
            let listener = TcpListener::bind(self.addr).await?;
            self.spawn_accept(listener);
        }
        Ok(())
    }

    /// Drops every open connection (watches included) without refusing new ones.
    pub fn drop_connections(&self) {
        self.state.kill_tx.send_modify(|v| *v += 1);
    }

    /// Whether the `edgehub` ClusterRole (deploy/rbac.yaml) is bound: without it a node gets
    /// 403 on daemonsets and controllerrevisions.
    /// Makes the Node authorizer lag: for `lag` after a pod is bound, the ConfigMaps and
    /// Secrets it references answer the recorded 403 (fixture
    /// `configmap_get_unreferenced_forbidden`).
    /// Issued service-account tokens are `len` bytes long, as a real bound token's JWT is
    /// (about 1 KB), for benchmarks that count what storing them costs.
    pub fn set_token_len(&self, len: usize) {
        self.state.token_len.store(len as u64, Ordering::SeqCst);
    }

    pub fn set_authorizer_lag(&self, lag: Duration) {
        self.state
            .authorizer_lag_ms
            .store(lag.as_millis() as u64, Ordering::SeqCst);
    }

    /// Requests seen, counted by (verb, resource), e.g. `("patch", "pods/status")`.
    pub fn count_by_verb(&self) -> BTreeMap<(String, String), usize> {
        let mut out = BTreeMap::new();
        for r in lock(&self.state.log).iter() {
            *out.entry((r.verb.to_string(), r.resource.clone()))
                .or_insert(0) += 1;
        }
        out
    }

    pub fn set_rbac_edgehub(&self, bound: bool) {
        self.state.rbac_edgehub.store(bound, Ordering::SeqCst);
    }

    pub fn set_bookmark_interval(&self, d: Duration) {
        self.state
            .bookmark_ms
            .store(d.as_millis().max(1) as u64, Ordering::SeqCst);
    }

    pub fn add_token(&self, token: &str, user: &str) {
        lock(&self.state.tokens).insert(token.into(), user.into());
    }

    /// The token no longer authenticates: every request with it gets the recorded 401
    /// (`unauthorized_bad_token`), as when a credential lapses. [`Self::add_token`] restores it.
    pub fn remove_token(&self, token: &str) {
        lock(&self.state.tokens).remove(token);
    }

    // ---- the kubelet API's reviews ----

    /// Binds `system:kubelet-api-admin` to `user`: SubjectAccessReviews for the kubelet's
    /// API (`nodes/proxy`, `nodes/log`, `nodes/stats`, ...) about `user` then answer allowed.
    /// kubeadm binds it to [`APISERVER_KUBELET_CLIENT`], and so does the fake from the start.
    pub fn bind_kubelet_api_admin(&self, user: &str) {
        lock(&self.state.reviews).bind_user(user);
    }

    /// The same for a group.
    pub fn bind_kubelet_api_admin_group(&self, group: &str) {
        lock(&self.state.reviews).bind_group(group);
    }

    /// Removes `user`'s binding.
    pub fn unbind_kubelet_api_admin(&self, user: &str) {
        lock(&self.state.reviews).unbind_user(user);
    }

    /// A token for `user` whose TokenReview answers with `extra` too (a JSON object of
    /// string arrays), as the apiserver answers for a service account's bound token.
    pub fn add_token_with_extra(&self, token: &str, user: &str, extra: serde_json::Value) {
        self.add_token(token, user);
        lock(&self.state.reviews).extra.insert(token.into(), extra);
    }

    /// The specs of the SubjectAccessReviews received, in order.
    pub fn access_reviews(&self) -> Vec<serde_json::Value> {
        lock(&self.state.reviews).received.clone()
    }

    /// RBAC for `user` on the node proxy (`get pods/log`, `create pods/exec`, `pods/attach`,
    /// `pods/portforward`, `nodes/proxy`) and reads of metrics.k8s.io. Without it a user
    /// outside `system:masters` gets the recorded 403s (`pod_log_forbidden_no_rbac`, ...).
    pub fn grant_kubelet_proxy(&self, user: &str) {
        lock(&self.state.proxy_users).insert(user.into());
    }

    /// Test-only: let `nodes/{name}/proxy` reach a loopback address. kube-apiserver refuses
    /// (`node_proxy_loopback_not_allowed`: 400 "address not allowed"), and a test's nodes
    /// live on 127.0.0.x, so only this reaches their `nodes/proxy` at all.
    pub fn set_test_only_loopback_node_proxy(&self, allow: bool) {
        self.state
            .loopback_node_proxy
            .store(allow, Ordering::SeqCst);
    }

    /// Issues a client certificate for `user` in `groups` from the fake's CA (as the cluster
    /// CA signs the apiserver's kubelet-client certificate); the fake authenticates it too.
    pub fn issue_client_cert(
        &self,
        user: &str,
        groups: &[&str],
    ) -> anyhow::Result<crate::certs::ClientCert> {
        let cert = self
            .pki
            .client_cert(user, groups.first().copied().unwrap_or(""))?;
        let mut gs: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        gs.push("system:authenticated".into());
        lock(&self.state.certs).insert(
            cert.der.clone(),
            csr::CertIdentity {
                user: user.to_string(),
                groups: gs,
                not_before: std::time::UNIX_EPOCH,
                not_after: std::time::SystemTime::now() + Duration::from_secs(10 * 365 * 86_400),
                credential_id: csr::credential_id(&cert.der),
            },
        );
        Ok(cert)
    }

    // ---- TLS bootstrap: bootstrap tokens, the CSR approver and signer ----

    /// Creates a bootstrap token (the `bootstrap-token-<id>` Secret): `Bearer <id>.<secret>`
    /// then authenticates as `system:bootstrap:<id>` until its expiration.
    pub fn add_bootstrap_token(&self, token: BootstrapToken) {
        lock(&self.state.csr).add_token(token);
    }

    /// The token's Secret is gone (the tokencleaner, or an operator): a plain 401.
    pub fn remove_bootstrap_token(&self, id: &str) {
        lock(&self.state.csr).remove_token(id);
    }

    /// Replaces the csrapproving stand-in with `approver` (called once per created CSR);
    /// `None` restores it. [`Approval::Pending`] for every CSR leaves approval to an external
    /// approver using the `/approval` subresource, as the attested-approval controller does.
    pub fn set_csr_approver(&self, approver: Option<Approver>) {
        lock(&self.state.csr).set_approver(approver);
    }

    /// Lets `user` (besides `admin`) approve and deny CSRs through `/approval`: RBAC's
    /// `update certificatesigningrequests/approval` and `approve` on the signer.
    pub fn allow_csr_approval(&self, user: &str) {
        lock(&self.state.csr).allow_approver(user);
    }

    /// Whether kubeadm's auto-approve bindings exist: `kubeadm:node-autoapprove-bootstrap`
    /// (`system:bootstrappers` → nodeclient) and `kubeadm:node-autoapprove-certificate-rotation`
    /// (`system:nodes` → selfnodeclient). Both are on by default, as the recording had them.
    pub fn set_csr_autoapprove_bindings(&self, bootstrap: bool, rotation: bool) {
        lock(&self.state.csr).set_bindings(bootstrap, rotation);
    }

    /// TEST ONLY, not a real apiserver behaviour: the signer issues certificates valid from
    /// `backdate` before signing to `valid_for` after it, whatever `expirationSeconds` says
    /// (the real minimum is 600 s, and the real backdate 5 minutes), so rotation tests run in
    /// seconds. `None` restores the real signer's window.
    pub fn set_test_only_certificate_window(&self, window: Option<TestOnlyCertWindow>) {
        lock(&self.state.csr).set_window(window);
    }

    /// TEST ONLY, not a real apiserver behaviour: the certificates the signer issues say a
    /// window `ahead` later than the one the authenticator accepts them in, as a device whose
    /// clock is behind by `ahead` (a vehicle that booted at 1970) sees its certificate: not
    /// valid yet by its own clock, valid by the apiserver's. `None` restores the real signer.
    pub fn set_test_only_not_before_ahead(&self, ahead: Option<Duration>) {
        lock(&self.state.csr).set_not_before_ahead(ahead);
    }

    /// The CertificateSigningRequests stored now.
    pub fn csrs(&self) -> Vec<Value> {
        self.list("certificatesigningrequests")
    }

    pub fn requests(&self) -> Vec<LoggedRequest> {
        lock(&self.state.log).clone()
    }

    pub fn count(&self, f: impl Fn(&LoggedRequest) -> bool) -> usize {
        lock(&self.state.log).iter().filter(|r| f(r)).count()
    }

    pub fn clear_log(&self) {
        lock(&self.state.log).clear();
    }
}

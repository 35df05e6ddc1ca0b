//! Shared by the `edgehub controller` tests: the binary as a child process against the fake
//! apiserver, its `/metrics`, and what the fake saw.

#![allow(dead_code)]

use edgehub_testsupport::daemonset_sim::{is_ready, owner_uid};
use edgehub_testsupport::{FakeApiServer, ADMIN_TOKEN};
use serde_json::Value;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The binary under test: this build's, or `EDGEHUB_CONTROLLER_BIN` (e.g. a release build,
/// for numbers that are not dominated by a debug build).
pub fn bin() -> PathBuf {
    std::env::var_os("EDGEHUB_CONTROLLER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_edgehub")))
}

/// A free loopback port (tiny race with other processes, acceptable in tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `f` every 20 ms until it is true, or panics after `secs` seconds naming `what`.
pub async fn wait_until(secs: u64, what: &str, f: impl FnMut() -> bool) {
    wait_until_every(secs, Duration::from_millis(20), what, f).await
}

/// [`wait_until`] with a polling period: the scale test's checks list a thousand objects.
pub async fn wait_until_every(secs: u64, every: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        if Instant::now() > deadline {
            panic!("timed out after {secs}s waiting for: {what}");
        }
        tokio::time::sleep(every).await;
    }
}

/// An admin kubeconfig for the fake apiserver, as the controller's Deployment would have a
/// service account.
pub fn admin_kubeconfig(server: &FakeApiServer, dir: &Path) -> PathBuf {
    server
        .write_kubeconfig(&dir.join("kube"), ADMIN_TOKEN)
        .unwrap()
}

/// `edgehub controller` as a child process.
pub struct Controller {
    pub child: Child,
    pub port: u16,
    pub identity: String,
}

impl Controller {
    /// Starts with the default Lease timings (a loaded VM must not make it give up leading)
    /// and a long resync, so what happens is caused by watch events.
    pub fn start(kubeconfig: &Path, identity: &str, extra: &[&str]) -> Controller {
        Controller::start_with_lease(kubeconfig, identity, ["15", "10", "2"], extra)
    }

    /// Starts with fast Lease timings: a 6 s Lease, a 4 s renew deadline, 1 s between tries.
    pub fn start_fast_lease(kubeconfig: &Path, identity: &str) -> Controller {
        Controller::start_with_lease(kubeconfig, identity, ["6", "4", "1"], &[])
    }

    /// Starts with Lease timings `[duration, renew deadline, retry period]` in seconds.
    pub fn start_with_lease(
        kubeconfig: &Path,
        identity: &str,
        lease: [&str; 3],
        extra: &[&str],
    ) -> Controller {
        let port = free_port();
        let child = Command::new(bin())
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args([
                "controller",
                "--metrics-addr",
                &format!("127.0.0.1:{port}"),
                "--identity",
                identity,
                "--lease-namespace",
                "kube-system",
                "--lease-duration-secs",
                lease[0],
                "--renew-deadline-secs",
                lease[1],
                "--retry-period-secs",
                lease[2],
                "--resync-secs",
                "3600",
            ])
            .args(extra)
            .env(
                "EDGEHUB_LOG",
                std::env::var("EDGEHUB_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(Stdio::null())
            .spawn()
            .expect("start edgehub controller");
        Controller {
            child,
            port,
            identity: identity.into(),
        }
    }

    /// `GET path` on the metrics port: (status, body), or None if it does not answer.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let mut s = std::net::TcpStream::connect_timeout(
            &([127, 0, 0, 1], self.port).into(),
            Duration::from_secs(1),
        )
        .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let code = out.split_whitespace().nth(1)?.parse().ok()?;
        let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
        Some((code, body))
    }

    /// One sample of `/metrics`, by its full name with labels.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    pub fn leading(&self) -> bool {
        self.metric("edgehub_controller_leader") == Some(1.0)
            && self.get("/readyz").is_some_and(|(c, _)| c == 200)
    }

    pub fn sigterm(&self) {
        // SAFETY: kill(2) with a pid this test spawned and has not reaped yet.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
    }

    /// Waits for the process to exit, up to `secs`.
    pub async fn wait_exit(&mut self, secs: u64) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if Instant::now() > deadline {
                panic!(
                    "edgehub controller {} did not exit in {secs}s",
                    self.identity
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pods of the DaemonSet with `uid` by node name: only live (not terminating) ones.
pub fn live_pods_by_node(server: &FakeApiServer, uid: &str) -> Vec<(String, Value)> {
    server
        .list("pods")
        .into_iter()
        .filter(|p| owner_uid(p) == Some(uid) && p.pointer("/metadata/deletionTimestamp").is_none())
        .map(|p| (p["spec"]["nodeName"].as_str().unwrap_or("").to_string(), p))
        .collect()
}

/// Where the rollout of the DaemonSet `uid` to `hash` stands on the nodes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rollout {
    /// Ready nodes whose one live pod is at `hash` and Ready.
    pub updated: usize,
    /// Ready nodes without exactly one live Ready pod: the rollout's unavailability.
    pub unavailable_ready: usize,
    /// NotReady nodes with an old pod, and such pods being deleted (never, by the rules).
    pub old_not_ready: usize,
    pub deleting_not_ready: usize,
}

pub fn rollout(server: &FakeApiServer, uid: &str, hash: &str) -> Rollout {
    let nodes = server.list("nodes");
    let pods: Vec<Value> = server
        .list("pods")
        .into_iter()
        .filter(|p| owner_uid(p) == Some(uid))
        .collect();
    let mut by_node: std::collections::HashMap<&str, Vec<&Value>> = Default::default();
    for p in &pods {
        by_node
            .entry(p["spec"]["nodeName"].as_str().unwrap_or(""))
            .or_default()
            .push(p);
    }
    let mut r = Rollout::default();
    for n in &nodes {
        let name = n["metadata"]["name"].as_str().unwrap_or("");
        let on = by_node.get(name).cloned().unwrap_or_default();
        let live: Vec<&&Value> = on
            .iter()
            .filter(|p| p.pointer("/metadata/deletionTimestamp").is_none())
            .collect();
        let at = |p: &Value| p["metadata"]["labels"]["controller-revision-hash"] == hash;
        if !is_ready(n) {
            if live.iter().any(|p| !at(p)) {
                r.old_not_ready += 1;
            }
            r.deleting_not_ready += on.len() - live.len();
            continue;
        }
        match live.as_slice() {
            [p] if is_ready(p) => {
                if at(p) {
                    r.updated += 1;
                }
            }
            _ => r.unavailable_ready += 1,
        }
    }
    r
}

/// The controller's Events with `reason`, oldest first, as (message).
pub fn events(server: &FakeApiServer, reason: &str) -> Vec<String> {
    let mut evs: Vec<Value> = server
        .list("events")
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .collect();
    evs.sort_by_key(|e| {
        e["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    });
    evs.iter()
        .map(|e| e["message"].as_str().unwrap_or("").to_string())
        .collect()
}

/// The size of each AdvancedRollingUpdate wave, from the controller's Events.
pub fn waves(server: &FakeApiServer) -> Vec<usize> {
    events(server, "AdvancedRollingUpdate")
        .iter()
        .filter_map(|m| m.strip_prefix("Deleted ")?.split(' ').next()?.parse().ok())
        .collect()
}

/// Requests the controller (the admin identity) made, by `METHOD resource[/status] [watch]`.
pub fn requests_by_kind(server: &FakeApiServer) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for r in server.requests() {
        if r.user.as_deref() != Some("admin") {
            continue;
        }
        let segs: Vec<&str> = r.path.trim_matches('/').split('/').collect();
        // .../<plural>[/<name>[/<sub>]]: find the resource segment after the version or namespace.
        let rest = match segs.as_slice() {
            ["api", _, "namespaces", _, rest @ ..] | ["apis", _, _, "namespaces", _, rest @ ..] => {
                rest
            }
            ["api", _, rest @ ..] | ["apis", _, _, rest @ ..] => rest,
            _ => &[][..],
        };
        let kind = match rest {
            [plural] => plural.to_string(),
            [plural, _] => plural.to_string(),
            [plural, _, sub] => format!("{plural}/{sub}"),
            _ => r.path.clone(),
        };
        let key = format!(
            "{} {kind}{}",
            r.method,
            if r.is_watch() { " (watch)" } else { "" }
        );
        *out.entry(key).or_insert(0) += 1;
    }
    out
}

/// The RBAC rules of `deploy/controller.yaml`: (namespace of a Role or None for the
/// ClusterRole, apiGroup, resource, verb, resourceNames).
type Rule = (Option<String>, String, String, String, Vec<String>);

fn deploy_rules() -> Vec<Rule> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/controller.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc).unwrap();
        let ns = match v["kind"].as_str() {
            Some("ClusterRole") => None,
            Some("Role") => Some(v["metadata"]["namespace"].as_str().unwrap().to_string()),
            _ => continue,
        };
        let strs = |x: &Value| -> Vec<String> {
            x.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        for rule in v["rules"].as_array().unwrap() {
            for g in strs(&rule["apiGroups"]) {
                for r in strs(&rule["resources"]) {
                    for verb in strs(&rule["verbs"]) {
                        out.push((
                            ns.clone(),
                            g.clone(),
                            r.clone(),
                            verb,
                            strs(&rule["resourceNames"]),
                        ));
                    }
                }
            }
        }
    }
    out
}

/// Every request the controller (the admin identity here) made is allowed by the service
/// account's permissions in `deploy/controller.yaml`, so the manifest stays true.
pub fn assert_deploy_rbac_allows_every_request(server: &FakeApiServer) {
    let rules = deploy_rules();
    for r in server.requests() {
        if r.user.as_deref() != Some("admin") {
            continue;
        }
        let segs: Vec<&str> = r.path.trim_matches('/').split('/').collect();
        let (group, rest) = match segs.as_slice() {
            ["api", _, rest @ ..] => ("", rest),
            ["apis", g, _, rest @ ..] => (*g, rest),
            _ => panic!("unexpected path {}", r.path),
        };
        let (ns, rest) = match rest {
            ["namespaces", ns, rest @ ..] => (Some(*ns), rest),
            rest => (None, rest),
        };
        let (resource, name) = match rest {
            [plural] => (plural.to_string(), None),
            [plural, name] => (plural.to_string(), Some(*name)),
            [plural, name, sub] => (format!("{plural}/{sub}"), Some(*name)),
            _ => panic!("unexpected path {}", r.path),
        };
        let verb = match (r.method.as_str(), name) {
            ("GET", None) if r.is_watch() => "watch",
            ("GET", None) => "list",
            ("GET", Some(_)) => "get",
            ("POST", _) => "create",
            ("PUT", _) => "update",
            ("PATCH", _) => "patch",
            ("DELETE", _) => "delete",
            (m, _) => panic!("unexpected method {m}"),
        };
        let allowed = rules.iter().any(|(rns, g, res, v, names)| {
            g == group
                && *res == resource
                && v == verb
                && rns.as_deref().is_none_or(|rns| Some(rns) == ns)
                && (names.is_empty() || name.is_some_and(|n| names.iter().any(|x| x == n)))
        });
        assert!(
            allowed,
            "deploy/controller.yaml does not allow {verb} {group}/{resource} {ns:?} {name:?} ({} {})",
            r.method, r.path
        );
    }
}

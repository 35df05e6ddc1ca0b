//! One snapshot of the container runtime per pass: edgehub's sandboxes and containers on this
//! node, with the facts the decisions need (exit codes, start times, image digests, pod IPs),
//! and the pod directories on disk.
//!
//! ListPodSandbox and ListContainers give states but not exit codes or start times, so each
//! container's status is asked once per state it reaches and remembered: an idle node asks the
//! runtime two list calls per pass, not one status call per container.

use crate::cri::{api, labels, CriError, CriRuntime};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// What the runtime says about one container, beyond the list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerFacts {
    pub exit_code: i32,
    /// The runtime's reason for an exit (`OOMKilled`, `Error`, `Completed`), may be empty.
    pub reason: String,
    pub started_at: i64,
    pub finished_at: i64,
    /// The image's digest reference (`repo@sha256:...`).
    pub image_ref: String,
}

/// The runtime's state of edgehub's objects on this node, at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub sandboxes: Vec<api::PodSandbox>,
    pub containers: Vec<api::Container>,
    /// By container id.
    pub facts: HashMap<String, ContainerFacts>,
    /// The pod-network address of each ready sandbox that has one, by sandbox id.
    pub sandbox_ips: HashMap<String, String>,
    /// Pod uids that have a directory under `<data_dir>/pods`.
    pub pod_dirs: HashSet<String>,
    /// `containerd`, `cri-o`: the prefix of a status's `containerID`.
    pub runtime_name: String,
    /// Label uid -> the pod its objects belong to (a replacement pod that adopted them).
    pub aliases: HashMap<String, String>,
}

/// What a snapshot holds for one pod.
#[derive(Debug, Clone, Copy)]
pub struct PodObserved<'a> {
    snap: &'a Snapshot,
    uid: &'a str,
}

/// A sandbox's attempt (how many sandboxes the pod had before it).
pub fn attempt_of_sandbox(s: &api::PodSandbox) -> u32 {
    s.metadata.as_ref().map(|m| m.attempt).unwrap_or(0)
}

/// Whether a sandbox is ready (its network and namespaces are up).
pub fn is_ready(s: &api::PodSandbox) -> bool {
    s.state == api::PodSandboxState::SandboxReady as i32
}

/// Whether container `c` is the pod's container `name` (its label, not the runtime's name,
/// which carries the attempt).
pub fn is_named(c: &api::Container, name: &str) -> bool {
    c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
}

/// A container's attempt (its restart count).
pub fn attempt_of(c: &api::Container) -> u32 {
    c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0)
}

impl Snapshot {
    pub fn pod<'a>(&'a self, uid: &'a str) -> PodObserved<'a> {
        PodObserved { snap: self, uid }
    }

    /// Binds the objects labelled with an adopted pod's uid to the pod that adopted them, so
    /// everything downstream sees one pod uid.
    pub fn apply_aliases(&mut self, aliases: HashMap<String, String>) {
        if !aliases.is_empty() {
            let relabel = |l: &mut HashMap<String, String>| {
                if let Some(to) = l.get(labels::POD_UID).and_then(|u| aliases.get(u)) {
                    let to = to.clone();
                    l.insert(labels::POD_UID.to_string(), to);
                }
            };
            for s in &mut self.sandboxes {
                relabel(&mut s.labels);
            }
            for c in &mut self.containers {
                relabel(&mut c.labels);
            }
        }
        self.aliases = aliases;
    }

    /// The pod a directory under `<data_dir>/pods` belongs to.
    pub fn dir_owner<'a>(&'a self, dir: &'a str) -> &'a str {
        self.aliases.get(dir).map(String::as_str).unwrap_or(dir)
    }

    /// A digest of the objects and their states: equal digests, nothing to react to.
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut items: Vec<(&str, i32)> = self
            .sandboxes
            .iter()
            .map(|s| (s.id.as_str(), s.state))
            .chain(self.containers.iter().map(|c| (c.id.as_str(), c.state)))
            .collect();
        items.sort_unstable();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        items.hash(&mut h);
        self.pod_dirs.len().hash(&mut h);
        h.finish()
    }

    /// A digest of what the desired pods are translated with from the snapshot: each
    /// sandbox's pod, state, attempt and address, and the adoptions.
    pub fn sandbox_key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut items: Vec<_> = self
            .sandboxes
            .iter()
            .map(|s| {
                (
                    s.id.as_str(),
                    s.labels.get(labels::POD_UID).map(String::as_str),
                    s.state,
                    attempt_of_sandbox(s),
                    self.sandbox_ips.get(&s.id).map(String::as_str),
                )
            })
            .collect();
        items.sort_unstable();
        let mut aliases: Vec<_> = self.aliases.iter().collect();
        aliases.sort_unstable();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        items.hash(&mut h);
        aliases.hash(&mut h);
        h.finish()
    }

    /// Pod uids of the sandboxes in the snapshot.
    pub fn sandbox_uids(&self) -> HashSet<&str> {
        self.sandboxes
            .iter()
            .filter_map(|s| s.labels.get(labels::POD_UID).map(String::as_str))
            .collect()
    }
}

impl<'a> PodObserved<'a> {
    /// All the pod's sandboxes, ready or not.
    pub fn sandboxes(&self) -> impl Iterator<Item = &'a api::PodSandbox> + 'a {
        let uid = self.uid;
        self.snap
            .sandboxes
            .iter()
            .filter(move |s| s.labels.get(labels::POD_UID).map(String::as_str) == Some(uid))
    }

    /// The ready sandbox with the highest attempt: the one the pod runs in.
    pub fn ready_sandbox(&self) -> Option<&'a api::PodSandbox> {
        self.sandboxes()
            .filter(|s| is_ready(s))
            .max_by_key(|s| attempt_of_sandbox(s))
    }

    /// The attempt number for the pod's next sandbox.
    pub fn next_sandbox_attempt(&self) -> u32 {
        self.sandboxes()
            .map(|s| attempt_of_sandbox(s) + 1)
            .max()
            .unwrap_or(0)
    }

    /// Containers in sandbox `sandbox_id`.
    pub fn containers_in(&self, sandbox_id: &'a str) -> impl Iterator<Item = &'a api::Container> {
        self.snap
            .containers
            .iter()
            .filter(move |c| c.pod_sandbox_id == sandbox_id)
    }

    /// Every container of the pod, in any of its sandboxes.
    pub fn containers(&self) -> impl Iterator<Item = &'a api::Container> + 'a {
        let uid = self.uid;
        self.snap
            .containers
            .iter()
            .filter(move |c| c.labels.get(labels::POD_UID).map(String::as_str) == Some(uid))
    }

    /// The newest attempt of container `name` in sandbox `sandbox_id`.
    pub fn latest(&self, sandbox_id: &'a str, name: &str) -> Option<&'a api::Container> {
        self.containers_in(sandbox_id)
            .filter(|c| is_named(c, name))
            .max_by_key(|c| attempt_of(c))
    }

    pub fn facts(&self, container_id: &str) -> Option<&'a ContainerFacts> {
        self.snap.facts.get(container_id)
    }

    pub fn sandbox_ip(&self, sandbox_id: &str) -> Option<&'a str> {
        self.snap.sandbox_ips.get(sandbox_id).map(String::as_str)
    }
}

/// The label selector of this node's edgehub objects.
pub fn managed(node: &str) -> HashMap<String, String> {
    HashMap::from([
        (labels::MANAGED_BY.to_string(), "edgehub".to_string()),
        (labels::NODE.to_string(), node.to_string()),
    ])
}

/// Checked again on what the runtime returns: a runtime that ignored the selector must not
/// make edgehub remove someone else's containers.
pub fn is_managed(l: &HashMap<String, String>, node: &str) -> bool {
    l.get(labels::MANAGED_BY).map(String::as_str) == Some("edgehub")
        && l.get(labels::NODE).map(String::as_str) == Some(node)
}

/// Takes snapshots, remembering what does not change (a container's facts in one state, a
/// sandbox's address) between them.
#[derive(Debug, Default)]
pub struct Observer {
    /// By container id: the state the facts were read in, and the facts.
    facts: HashMap<String, (i32, ContainerFacts)>,
    ips: HashMap<String, Option<String>>,
    runtime_name: Option<String>,
}

impl Observer {
    pub async fn observe<R: CriRuntime>(
        &mut self,
        cri: &R,
        node: &str,
        pods_dir: &Path,
    ) -> Result<Snapshot, CriError> {
        // Both lists asked at once: one round trip to the runtime instead of two, so an idle
        // node's relist (every second) wakes the process once for its answers.
        let (sandboxes, containers) = tokio::try_join!(
            cri.list_pod_sandbox(managed(node)),
            cri.list_containers(managed(node))
        )?;
        let sandboxes: Vec<api::PodSandbox> = sandboxes
            .into_iter()
            .filter(|s| is_managed(&s.labels, node))
            .collect();
        let containers: Vec<api::Container> = containers
            .into_iter()
            .filter(|c| is_managed(&c.labels, node))
            .collect();
        if self.runtime_name.is_none() {
            self.runtime_name = Some(cri.version().await?.runtime_name);
        }
        let mut facts = HashMap::with_capacity(containers.len());
        for c in &containers {
            let known = self.facts.get(&c.id).filter(|(st, _)| *st == c.state);
            let f = match known {
                Some((_, f)) => f.clone(),
                None => {
                    let f = match cri.container_status(&c.id).await {
                        Ok(Some(s)) => ContainerFacts {
                            exit_code: s.exit_code,
                            reason: s.reason,
                            started_at: s.started_at,
                            finished_at: s.finished_at,
                            image_ref: s.image_ref,
                        },
                        Ok(None) => ContainerFacts::default(),
                        Err(e) if e.is_not_found() => ContainerFacts::default(),
                        Err(e) => return Err(e),
                    };
                    self.facts.insert(c.id.clone(), (c.state, f.clone()));
                    f
                }
            };
            facts.insert(c.id.clone(), f);
        }
        self.facts.retain(|id, _| facts.contains_key(id));
        let mut sandbox_ips = HashMap::new();
        for s in sandboxes
            .iter()
            .filter(|s| s.state == api::PodSandboxState::SandboxReady as i32)
        {
            let ip = match self.ips.get(&s.id) {
                Some(ip) => ip.clone(),
                None => {
                    let ip = match cri.pod_sandbox_status(&s.id).await {
                        Ok(st) => st
                            .and_then(|s| s.network)
                            .map(|n| n.ip)
                            .filter(|ip| !ip.is_empty()),
                        Err(e) if e.is_not_found() => None,
                        Err(e) => return Err(e),
                    };
                    self.ips.insert(s.id.clone(), ip.clone());
                    ip
                }
            };
            if let Some(ip) = ip {
                sandbox_ips.insert(s.id.clone(), ip);
            }
        }
        self.ips
            .retain(|id, _| sandboxes.iter().any(|s| s.id == *id));
        Ok(Snapshot {
            sandboxes,
            containers,
            facts,
            sandbox_ips,
            pod_dirs: pod_dirs(pods_dir),
            runtime_name: self.runtime_name.clone().unwrap_or_default(),
            aliases: HashMap::new(),
        })
    }

    /// Forgets everything, after the runtime went away (its ids may be reused).
    pub fn forget(&mut self) {
        self.facts.clear();
        self.ips.clear();
        self.runtime_name = None;
    }
}

fn pod_dirs(dir: &Path) -> HashSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, uid: &str, attempt: u32, ready: bool) -> api::PodSandbox {
        api::PodSandbox {
            id: id.into(),
            labels: HashMap::from([(labels::POD_UID.to_string(), uid.to_string())]),
            metadata: Some(api::PodSandboxMetadata {
                attempt,
                ..Default::default()
            }),
            state: if ready {
                api::PodSandboxState::SandboxReady as i32
            } else {
                api::PodSandboxState::SandboxNotready as i32
            },
            ..Default::default()
        }
    }

    #[test]
    fn the_sandbox_key_follows_what_pods_are_translated_with_and_nothing_else() {
        let snap = Snapshot {
            sandboxes: vec![sandbox("s1", "a", 0, true), sandbox("s2", "b", 0, true)],
            ..Default::default()
        };
        let key = snap.sandbox_key();
        let mut other = snap.clone();
        other.sandboxes.reverse();
        assert_eq!(
            other.sandbox_key(),
            key,
            "the order of the list is not a change"
        );
        other.containers.push(api::Container {
            id: "c1".into(),
            pod_sandbox_id: "s1".into(),
            ..Default::default()
        });
        assert_eq!(
            other.sandbox_key(),
            key,
            "a container is not a sandbox change"
        );
        for changed in [
            {
                let mut s = snap.clone();
                s.sandboxes[0] = sandbox("s1", "a", 0, false);
                s
            },
            {
                let mut s = snap.clone();
                s.sandboxes.push(sandbox("s3", "a", 1, true));
                s
            },
            {
                let mut s = snap.clone();
                s.sandbox_ips.insert("s1".into(), "10.88.42.7".into());
                s
            },
            {
                let mut s = snap.clone();
                s.aliases.insert("old".into(), "a".into());
                s
            },
        ] {
            assert_ne!(changed.sandbox_key(), key, "{changed:?}");
        }
    }
}

use super::*;
use crate::object::Kind;
use crate::pod::observe::Snapshot;
use crate::pod::probes::{ProbeAction, ProbeState};
use crate::podspec::{Missing, PodContext};
use crate::sources::Sources;
use crate::store::StoredObject;
use serde_json::json;

const NODE: &str = "n1";

fn pod_json(name: &str, containers: &[&str]) -> serde_json::Value {
    json!({
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "1"},
        "spec": {"hostNetwork": true, "terminationGracePeriodSeconds": 7,
            "containers": containers.iter().map(|c| json!({"name": c, "image": "img:1"})).collect::<Vec<_>>()},
    })
}

fn desired(v: serde_json::Value, snap: &Snapshot) -> DesiredPod {
    let obj = StoredObject::from_raw(Kind::Pod, v.to_string()).unwrap();
    let ctx = PodContext {
        node_name: NODE.into(),
        host_ip: Some("10.0.0.1".into()),
        volume_dir: "/tmp/v".into(),
        log_dir: "/tmp/l".into(),
        attempt: snap.pod(&obj.index.uid).next_sandbox_attempt(),
        pod_ip: None,
        sources: Sources::default(),
    };
    let plan = crate::podspec::translate(&v, &ctx);
    DesiredPod {
        grace_secs: crate::pod::desired::grace_of(&v),
        plan: Some(plan),
        ctx: Some(ctx),
        status: serde_json::Value::Null,
        obj,
    }
}

fn sandbox(id: &str, uid: &str, ready: bool, attempt: u32) -> api::PodSandbox {
    api::PodSandbox {
        id: id.into(),
        metadata: Some(api::PodSandboxMetadata {
            attempt,
            ..Default::default()
        }),
        state: if ready {
            api::PodSandboxState::SandboxReady as i32
        } else {
            api::PodSandboxState::SandboxNotready as i32
        },
        labels: HashMap::from([(labels::POD_UID.to_string(), uid.to_string())]),
        annotations: HashMap::from([(labels::GRACE_PERIOD.to_string(), "9".to_string())]),
        ..Default::default()
    }
}

fn container(
    id: &str,
    sb: &str,
    uid: &str,
    name: &str,
    state: api::ContainerState,
    attempt: u32,
) -> api::Container {
    api::Container {
        id: id.into(),
        pod_sandbox_id: sb.into(),
        metadata: Some(api::ContainerMetadata {
            name: name.into(),
            attempt,
        }),
        state: state as i32,
        labels: HashMap::from([
            (labels::POD_UID.to_string(), uid.to_string()),
            (labels::CONTAINER_NAME.to_string(), name.to_string()),
        ]),
        ..Default::default()
    }
}

struct World {
    snap: Snapshot,
    desired: Vec<DesiredPod>,
    restarts: HashMap<(String, String), Restarts>,
    refused: HashMap<String, Restarts>,
    probes: HashMap<(String, String), ContainerProbes>,
    volumes: HashMap<String, u64>,
    held: HashSet<String>,
    ready: bool,
    now: Instant,
    awaiting: Vec<Awaiting>,
    ended: HashSet<String>,
}

impl World {
    fn new() -> World {
        World {
            snap: Snapshot::default(),
            desired: Vec::new(),
            restarts: HashMap::new(),
            refused: HashMap::new(),
            probes: HashMap::new(),
            volumes: HashMap::new(),
            held: HashSet::new(),
            ready: true,
            now: Instant::now(),
            awaiting: Vec::new(),
            ended: HashSet::new(),
        }
    }

    fn add(&mut self, v: serde_json::Value) {
        let d = desired(v, &self.snap);
        // Volumes already written, so a settled pod gets no RefreshVolumes.
        if let Some(Ok(p)) = &d.plan {
            self.volumes.insert(d.uid().to_string(), volumes_digest(p));
        }
        self.desired.push(d);
    }

    fn decide(&self) -> Vec<Action> {
        decide(&Inputs {
            desired: &self.desired,
            snapshot: &self.snap,
            memory: Memory {
                restarts: &self.restarts,
                refused: &self.refused,
                probes: &self.probes,
                volumes: &self.volumes,
            },
            held: &self.held,
            sources_ready: self.ready,
            policy: BackoffPolicy::CRASH_LOOP,
            now: self.now,
            awaiting: &self.awaiting,
            ended_upgrades: &self.ended,
        })
    }
}

fn names(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .map(|a| {
            let kind = format!("{a:?}");
            let kind = kind.split([' ', '{', '(']).next().unwrap_or("").to_string();
            format!("{kind}:{}", a.uid())
        })
        .collect()
}

mod containers;
mod pods;

//! The controller's `/metrics`, in Prometheus text format: counters of what it did, and one
//! set of gauges per opted-in DaemonSet saying where its rollout stands. Label values are
//! namespaces and names (DNS-1123), so they need no escaping.

use crate::api::metrics::family;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Where one DaemonSet stands after its last reconcile.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DaemonSetGauges {
    /// `ota` or `advanced_rolling_update`.
    pub strategy: &'static str,
    /// AdvancedRollingUpdate: old pods on Ready nodes, and on NotReady nodes.
    pub old_ready: u64,
    pub old_not_ready: u64,
    /// AdvancedRollingUpdate: Ready nodes running an available pod of the update revision.
    pub updated: u64,
    /// AdvancedRollingUpdate: the budget.
    pub max_unavailable: u64,
    /// OTA: pods whose `PodNeedUpgrade` is True.
    pub need_upgrade: u64,
}

#[derive(Debug, Default)]
pub struct Metrics {
    pub leader: AtomicBool,
    pub reconciles: AtomicU64,
    pub reconcile_errors: AtomicU64,
    /// Reconciles that deleted at least one pod: the rollout's waves.
    pub waves: AtomicU64,
    pub deleted_budget: AtomicU64,
    pub deleted_unavailable: AtomicU64,
    pub delete_errors: AtomicU64,
    pub conditions_true: AtomicU64,
    pub conditions_false: AtomicU64,
    pub condition_errors: AtomicU64,
    pub events: AtomicU64,
    pub event_errors: AtomicU64,
    /// Attested approval (`approve`): node CSRs approved, denied, and decisions that could
    /// not be made or written (retried).
    pub csr_approved: AtomicU64,
    pub csr_denied: AtomicU64,
    pub csr_errors: AtomicU64,
    daemonsets: Mutex<BTreeMap<(String, String), DaemonSetGauges>>,
}

/// Picks a DaemonSet's samples of one family: (extra labels, value), or none.
type Samples = dyn Fn(&DaemonSetGauges) -> Option<Vec<(&'static str, u64)>>;

fn aru(g: &DaemonSetGauges) -> bool {
    g.strategy == "advanced_rolling_update"
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// Adds one to a counter.
pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Metrics {
    /// Sets a DaemonSet's gauges, or removes them (`None`: not opted in, or gone).
    pub fn set_daemonset(&self, namespace: &str, name: &str, g: Option<DaemonSetGauges>) {
        let mut m = self.daemonsets.lock().unwrap_or_else(|p| p.into_inner());
        let key = (namespace.to_string(), name.to_string());
        match g {
            Some(g) => {
                m.insert(key, g);
            }
            None => {
                m.remove(&key);
            }
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let one = |v: u64| vec![(String::new(), v)];
        family(
            &mut out,
            "edgehub_controller_leader",
            "gauge",
            "1 while this replica holds the leader Lease and runs the controller.",
            &one(u64::from(self.leader.load(Ordering::Relaxed))),
        );
        family(
            &mut out,
            "edgehub_controller_reconciles_total",
            "counter",
            "DaemonSet reconciles, by result.",
            &[
                ("result=\"ok\"".into(), get(&self.reconciles)),
                ("result=\"error\"".into(), get(&self.reconcile_errors)),
            ],
        );
        family(
            &mut out,
            "edgehub_controller_waves_total",
            "counter",
            "AdvancedRollingUpdate reconciles that deleted at least one old pod.",
            &one(get(&self.waves)),
        );
        family(
            &mut out,
            "edgehub_controller_pods_deleted_total",
            "counter",
            "Old pods deleted: within the budget, or unavailable (free).",
            &[
                ("why=\"budget\"".into(), get(&self.deleted_budget)),
                ("why=\"unavailable\"".into(), get(&self.deleted_unavailable)),
            ],
        );
        family(
            &mut out,
            "edgehub_controller_pod_delete_errors_total",
            "counter",
            "Pod deletions the apiserver refused or did not answer.",
            &one(get(&self.delete_errors)),
        );
        family(
            &mut out,
            "edgehub_controller_conditions_written_total",
            "counter",
            "PodNeedUpgrade conditions written, by status.",
            &[
                ("status=\"True\"".into(), get(&self.conditions_true)),
                ("status=\"False\"".into(), get(&self.conditions_false)),
            ],
        );
        family(
            &mut out,
            "edgehub_controller_condition_errors_total",
            "counter",
            "PodNeedUpgrade writes that failed.",
            &one(get(&self.condition_errors)),
        );
        family(
            &mut out,
            "edgehub_controller_events_total",
            "counter",
            "Events posted, by result.",
            &[
                ("result=\"ok\"".into(), get(&self.events)),
                ("result=\"error\"".into(), get(&self.event_errors)),
            ],
        );
        family(
            &mut out,
            "edgehub_controller_csr_decisions_total",
            "counter",
            "Bootstrap node CSRs decided by attested approval, by decision; errors are retried.",
            &[
                ("decision=\"approved\"".into(), get(&self.csr_approved)),
                ("decision=\"denied\"".into(), get(&self.csr_denied)),
                ("decision=\"error\"".into(), get(&self.csr_errors)),
            ],
        );
        let ds = self.daemonsets.lock().unwrap_or_else(|p| p.into_inner());
        let per = |f: &Samples| {
            let mut samples = Vec::new();
            for ((ns, name), g) in ds.iter() {
                for (extra, v) in f(g).unwrap_or_default() {
                    samples.push((
                        format!(
                            "namespace=\"{ns}\",daemonset=\"{name}\",strategy=\"{}\"{extra}",
                            g.strategy
                        ),
                        v,
                    ));
                }
            }
            samples
        };
        family(
            &mut out,
            "edgehub_controller_old_pods",
            "gauge",
            "AdvancedRollingUpdate: pods not at the update revision, by node readiness.",
            &per(&|g| {
                aru(g).then(|| {
                    vec![
                        (",node=\"ready\"", g.old_ready),
                        (",node=\"not_ready\"", g.old_not_ready),
                    ]
                })
            }),
        );
        family(
            &mut out,
            "edgehub_controller_updated_nodes",
            "gauge",
            "AdvancedRollingUpdate: Ready nodes with an available pod of the update revision.",
            &per(&|g| aru(g).then(|| vec![("", g.updated)])),
        );
        family(
            &mut out,
            "edgehub_controller_max_unavailable",
            "gauge",
            "AdvancedRollingUpdate: the budget from apps.openyurt.io/max-unavailable.",
            &per(&|g| aru(g).then(|| vec![("", g.max_unavailable)])),
        );
        family(
            &mut out,
            "edgehub_controller_need_upgrade_pods",
            "gauge",
            "OTA: pods whose PodNeedUpgrade is True.",
            &per(&|g| (!aru(g)).then(|| vec![("", g.need_upgrade)])),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_per_daemonset_gauges() {
        let m = Metrics::default();
        inc(&m.waves);
        inc(&m.deleted_budget);
        inc(&m.deleted_budget);
        m.set_daemonset(
            "vehicle",
            "gateway",
            Some(DaemonSetGauges {
                strategy: "advanced_rolling_update",
                old_ready: 4,
                old_not_ready: 3,
                updated: 3,
                max_unavailable: 3,
                need_upgrade: 0,
            }),
        );
        m.set_daemonset(
            "vehicle",
            "telemetry",
            Some(DaemonSetGauges {
                strategy: "ota",
                need_upgrade: 1,
                ..Default::default()
            }),
        );
        let text = m.render();
        for line in [
            "edgehub_controller_leader 0",
            "edgehub_controller_waves_total 1",
            "edgehub_controller_pods_deleted_total{why=\"budget\"} 2",
            "edgehub_controller_old_pods{namespace=\"vehicle\",daemonset=\"gateway\",strategy=\"advanced_rolling_update\",node=\"not_ready\"} 3",
            "edgehub_controller_need_upgrade_pods{namespace=\"vehicle\",daemonset=\"telemetry\",strategy=\"ota\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        assert!(!text.contains("daemonset=\"telemetry\",strategy=\"ota\",node"));
        m.set_daemonset("vehicle", "gateway", None);
        assert!(!m.render().contains("gateway"));
    }
}

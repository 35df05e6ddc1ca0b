//! How a pod runs on the device after an upgrade committed: the runtime map's row
//! (`running_revision.images`), and the cached pod rewritten to it. The runtime translates a
//! pod through this, the engine writes it at commit, and the outbox reads which images a
//! report names: one definition for the three.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// How the pod runs on the device after an upgrade committed (the runtime map): with other
/// images, or with the target revision's spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RunningAs {
    Images(BTreeMap<String, String>),
    Spec(Value),
}

impl RunningAs {
    /// Applies this to the cached pod, with the revision's hash label.
    pub fn apply(&self, pod: &mut Value, hash: &str) {
        match self {
            RunningAs::Images(images) => apply_images(pod, images, hash),
            RunningAs::Spec(spec) => recreate_target(pod, spec, hash),
        }
    }
}

/// Labels the pod with the revision it now runs.
fn set_revision_hash(pod: &mut Value, hash: &str) {
    if let Some(labels) = pod
        .pointer_mut("/metadata/labels")
        .and_then(Value::as_object_mut)
    {
        labels.insert(
            crate::object::REVISION_HASH_LABEL.to_string(),
            Value::String(hash.to_string()),
        );
    }
}

/// Whether a volume or a volume mount is the service-account token volume the admission
/// plugin injects (`kube-api-access-<random>`).
fn names_token_volume(v: &Value) -> bool {
    v.get("name")
        .and_then(Value::as_str)
        .is_some_and(|n| n.starts_with("kube-api-access-"))
}

/// A pod's spec as a template would say it: without the service-account token volume the
/// admission plugin injected, or its mounts (which [`recreate_target`] adds back from the pod).
pub fn without_token_volume(spec: &Value) -> Value {
    let mut spec = spec.clone();
    if let Some(vols) = spec.get_mut("volumes").and_then(Value::as_array_mut) {
        vols.retain(|v| !names_token_volume(v));
    }
    for list in ["containers", "initContainers"] {
        for c in spec
            .get_mut(list)
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            if let Some(mounts) = c.get_mut("volumeMounts").and_then(Value::as_array_mut) {
                mounts.retain(|m| !names_token_volume(m));
            }
        }
    }
    spec
}

/// The pod as it runs after a recreate: the cached pod with the target template's spec. What
/// the template does not say and the pod got from elsewhere stays: the node binding, the
/// tolerations and affinity the DaemonSet controller added, and the service-account token
/// volume the admission plugin injected (with its mounts).
pub fn recreate_target(pod: &mut Value, spec: &Value, hash: &str) {
    let old = pod.get("spec").cloned().unwrap_or(Value::Null);
    let mut new = spec.clone();
    if let (Some(n), Some(o)) = (new.as_object_mut(), old.as_object()) {
        for keep in [
            "nodeName",
            "tolerations",
            "affinity",
            "serviceAccountName",
            "serviceAccount",
            "schedulerName",
            "priority",
            "enableServiceLinks",
            "preemptionPolicy",
        ] {
            if let (false, Some(v)) = (n.contains_key(keep), o.get(keep)) {
                n.insert(keep.to_string(), v.clone());
            }
        }
        let token_volumes: Vec<Value> = o
            .get("volumes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|v| names_token_volume(v))
            .cloned()
            .collect();
        let automount = n
            .get("automountServiceAccountToken")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        if automount && !token_volumes.is_empty() {
            let vols = n
                .entry("volumes")
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Some(vols) = vols.as_array_mut() {
                vols.extend(token_volumes.iter().cloned());
            }
            for list in ["containers", "initContainers"] {
                for c in n
                    .get_mut(list)
                    .and_then(Value::as_array_mut)
                    .into_iter()
                    .flatten()
                {
                    let name = c.get("name").cloned();
                    let mount = o
                        .get(list)
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .find(|oc| oc.get("name") == name.as_ref())
                        .and_then(|oc| oc.get("volumeMounts"))
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter(|m| names_token_volume(m))
                        .cloned()
                        .collect::<Vec<_>>();
                    if let Some(cm) = c.as_object_mut() {
                        let mounts = cm
                            .entry("volumeMounts")
                            .or_insert_with(|| Value::Array(Vec::new()));
                        if let Some(mounts) = mounts.as_array_mut() {
                            mounts.extend(mount);
                        }
                    }
                }
            }
        }
    }
    pod["spec"] = new;
    set_revision_hash(pod, hash);
}

/// The pod as it runs after the upgrade: the cached pod with the changed containers' images
/// and the target revision's hash label. The runtime and the engine translate this for the
/// CRI; nothing else of the pod changes in place.
pub fn apply_images(pod: &mut Value, images: &BTreeMap<String, String>, hash: &str) {
    for list in ["containers", "initContainers"] {
        if let Some(Value::Array(cs)) = pod.pointer_mut(&format!("/spec/{list}")) {
            for c in cs.iter_mut() {
                let name = c.get("name").and_then(Value::as_str).unwrap_or("");
                if let Some(img) = images.get(name) {
                    c["image"] = Value::String(img.clone());
                }
            }
        }
    }
    set_revision_hash(pod, hash);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_recreated_pod_keeps_its_binding_and_token_volume() {
        let mut pod = json!({"metadata": {"labels": {"controller-revision-hash": "a"}},
            "spec": {"nodeName": "n1", "tolerations": [{"operator": "Exists"}],
                "volumes": [{"name": "kube-api-access-x", "projected": {"sources": []}}],
                "containers": [{"name": "app", "image": "app:1", "env": [{"name": "E", "value": "1"}],
                    "volumeMounts": [{"name": "kube-api-access-x", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}]}});
        let spec = json!({"containers": [{"name": "app", "image": "app:1", "env": [{"name": "E", "value": "2"}]}]});
        RunningAs::Spec(spec).apply(&mut pod, "b");
        assert_eq!(pod["spec"]["containers"][0]["env"][0]["value"], "2");
        assert_eq!(pod["spec"]["nodeName"], "n1");
        assert_eq!(pod["spec"]["tolerations"][0]["operator"], "Exists");
        assert_eq!(pod["spec"]["volumes"][0]["name"], "kube-api-access-x");
        assert_eq!(
            pod["spec"]["containers"][0]["volumeMounts"][0]["name"],
            "kube-api-access-x"
        );
        assert_eq!(pod["metadata"]["labels"]["controller-revision-hash"], "b");
        let back: RunningAs = serde_json::from_str(
            &serde_json::to_string(&RunningAs::Images(BTreeMap::new())).unwrap(),
        )
        .unwrap();
        assert_eq!(back, RunningAs::Images(BTreeMap::new()));
    }

    #[test]
    fn the_pod_after_the_upgrade_has_the_new_images_and_hash() {
        let mut pod = json!({"metadata": {"labels": {"controller-revision-hash": "a"}},
            "spec": {"containers": [{"name": "app", "image": "app:1"}, {"name": "side", "image": "side:1"}]}});
        let images = BTreeMap::from([("app".to_string(), "app:2".to_string())]);
        apply_images(&mut pod, &images, "b");
        assert_eq!(pod["spec"]["containers"][0]["image"], "app:2");
        assert_eq!(pod["spec"]["containers"][1]["image"], "side:1");
        assert_eq!(pod["metadata"]["labels"]["controller-revision-hash"], "b");
    }
}

//! Pre-pulls: a new revision's images fetched while the link is up (`POST .../imagepull`,
//! and the engine's own when a revision arrives), and which registry an image comes from.

use super::*;

impl<R: CriRuntime + 'static> Engine<R> {
    /// While online, asks for a pre-pull of every new update revision a pod needs, once.
    pub(super) fn request_prepulls(&self) -> Result<(), StoreError> {
        if !self.config.prepull || !self.online() {
            return Ok(());
        }
        let mut decider = Decider::new(&self.store);
        for pod in self.store.list_index(Kind::Pod)? {
            let need = decider.decide(&pod)?;
            let Some(target) = need.target().filter(|_| need.needed()) else {
                continue;
            };
            if self.store.pull_requested(&pod.uid, target)? {
                continue;
            }
            let req = crate::store::NewRequest {
                kind: RequestKind::ImagePull,
                pod_uid: &pod.uid,
                namespace: &pod.namespace,
                name: &pod.name,
                from_hash: pod.revision_hash.as_deref(),
                to_hash: target,
            };
            if let crate::store::Recorded::New(r) = self.store.record_request(&req)? {
                tracing::info!(pod = %r.name, namespace = %r.namespace, revision = %r.to_hash,
                    "pre-pulling a new revision's images");
            }
        }
        Ok(())
    }

    /// `POST .../imagepull`: pulls the target revision's images now.
    pub(super) async fn prepull(self: Arc<Self>, req: RequestRecord) {
        let images = match target_images(&self.store, &req.pod_uid, &req.to_hash) {
            Ok(Some(i)) => i,
            Ok(None) => {
                let _ = self.store.transition(
                    req.id,
                    "Requested",
                    "Failed",
                    Some("the pod or its target revision is not cached"),
                    None,
                    &Effects::default(),
                );
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the pod for a pre-pull");
                return;
            }
        };
        let mut failed = Vec::new();
        for img in images.values() {
            if let Ok(Some(_)) = self.cri.image_status(img).await {
                continue;
            }
            if let Err(e) = self.cri.pull_image(img, None).await {
                failed.push(format!("{img}: {e}"));
            }
        }
        let (to, error) = if failed.is_empty() {
            ("Done", None)
        } else {
            ("Failed", Some(failed.join("; ")))
        };
        if let Err(e) = self.store.transition(
            req.id,
            "Requested",
            to,
            error.as_deref(),
            None,
            &Effects::default(),
        ) {
            tracing::warn!(error = %e, "cannot record a pre-pull");
        }
    }
}

/// The registry an image reference pulls from, as host and port: the first path component
/// when it names a host (has a dot or a port, or is `localhost`), else Docker Hub.
pub fn registry_of(image: &str) -> (String, u16) {
    let first = image.split('/').next().unwrap_or("");
    let is_host =
        image.contains('/') && (first.contains('.') || first.contains(':') || first == "localhost");
    if !is_host {
        return ("registry-1.docker.io".into(), 443);
    }
    match first.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || first.starts_with('[') => match p.parse() {
            Ok(port) => (
                h.trim_start_matches('[').trim_end_matches(']').to_string(),
                port,
            ),
            Err(_) => (first.to_string(), 443),
        },
        _ => (
            first
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            443,
        ),
    }
}

/// The images of the target revision's containers, by container name.
pub fn target_images(
    store: &Store,
    pod_uid: &str,
    to_hash: &str,
) -> Result<Option<BTreeMap<String, String>>, StoreError> {
    let Some(pod) = store.get_by_uid(Kind::Pod, pod_uid)? else {
        return Ok(None);
    };
    let Some(owner) = pod.index.owner_uid.as_deref() else {
        return Ok(None);
    };
    let mut decider = Decider::new(store);
    let Some(ds) = decider.daemonset(owner)? else {
        return Ok(None);
    };
    let Some(rev) = ds.revisions.iter().find(|r| r.hash == to_hash) else {
        return Ok(None);
    };
    let mut out = BTreeMap::new();
    for list in ["containers", "initContainers"] {
        for c in rev
            .template
            .pointer(&format!("/spec/{list}"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let (Some(n), Some(i)) = (
                c.get("name").and_then(Value::as_str),
                c.get("image").and_then(Value::as_str),
            ) {
                out.insert(n.to_string(), i.to_string());
            }
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    #[test]
    fn registries_of_image_references() {
        for (image, host, port) in [
            ("127.0.0.1:5000/busybox:1.0", "127.0.0.1", 5000),
            ("busybox:1.0", "registry-1.docker.io", 443),
            ("library/busybox", "registry-1.docker.io", 443),
            ("ghcr.io/org/app@sha256:abc", "ghcr.io", 443),
            ("localhost/app:1", "localhost", 443),
            ("registry.local:8443/a/b:c", "registry.local", 8443),
        ] {
            assert_eq!(
                super::registry_of(image),
                (host.to_string(), port),
                "{image}"
            );
        }
    }
}

//! What a pod references: ConfigMaps, Secrets, the downward API, pull secrets; waiting for them.

use super::*;

#[test]
fn the_recorded_pod_waits_for_its_configmap_before_anything_is_cached() {
    let m = missing(translate(&fixture_pod("telemetry-sv74m"), &ctx()).unwrap_err());
    assert_eq!(m.reason, "ConfigMapUnavailable");
    assert!(
        m.message
            .contains("\"vehicle/telemetry-cfg\" is not cached yet"),
        "{m}"
    );

    // The ConfigMaps but no token yet: the projected volume cannot be written.
    let mut c = ctx();
    c.sources = recorded_sources();
    c.sources.tokens.clear();
    let m = missing(translate(&fixture_pod("telemetry-sv74m"), &c).unwrap_err());
    assert_eq!(m.reason, "ServiceAccountTokenUnavailable");
    assert!(m.message.contains("\"default\""), "{m}");

    // The apiserver said the ConfigMap does not exist.
    let mut c = ctx();
    c.sources = recorded_sources();
    c.sources.configmaps.insert("telemetry-cfg".into(), None);
    let m = missing(translate(&fixture_pod("telemetry-sv74m"), &c).unwrap_err());
    assert_eq!(m.message, "configmap \"vehicle/telemetry-cfg\" not found");
}

#[test]
fn the_recorded_pod_runs_as_recorded_with_its_sources() {
    let mut c = ctx();
    c.sources = recorded_sources();
    let plan = translate(&fixture_pod("telemetry-sv74m"), &c).unwrap();
    let files = |name: &str| -> Vec<(String, String, u32)> {
        match plan.volumes.iter().find(|v| v.name() == name).unwrap() {
            VolumePlan::Files { files, .. } => files
                .iter()
                .map(|f| {
                    (
                        f.path.clone(),
                        String::from_utf8(f.data.clone()).unwrap(),
                        f.mode,
                    )
                })
                .collect(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        files("cfg"),
        vec![("app.conf".into(), "level=info\n".into(), 0o644)]
    );
    let kube_api = files("kube-api-access-7f6wp");
    let paths: Vec<_> = kube_api
        .iter()
        .map(|(p, d, _)| (p.as_str(), d.as_str()))
        .collect();
    assert_eq!(
        paths,
        vec![
            ("token", "tok-1"),
            ("ca.crt", "CA PEM"),
            ("namespace", "vehicle"),
            ("service-ca.crt", "SERVICE CA PEM")
        ]
    );
    let app = &plan.containers[0].config;
    let m = app
        .mounts
        .iter()
        .find(|m| m.container_path == "/var/run/secrets/kubernetes.io/serviceaccount")
        .unwrap();
    assert!(m.readonly);
    assert_eq!(
        m.host_path,
        "/var/lib/edgehub/pods/u/volumes/projected/kube-api-access-7f6wp"
    );
    assert_eq!(
        app.mounts
            .iter()
            .find(|m| m.container_path == "/etc/app")
            .unwrap()
            .host_path,
        "/var/lib/edgehub/pods/u/volumes/configmap/cfg"
    );
}

#[test]
fn env_from_configmaps_and_secrets() {
    let mut pod = runnable("telemetry-sv74m");
    pod["spec"]["containers"][0]["envFrom"] = json!([
        {"configMapRef": {"name": "env-cm"}, "prefix": "CM_"},
        {"secretRef": {"name": "env-sec"}},
        {"configMapRef": {"name": "absent", "optional": true}},
    ]);
    pod["spec"]["containers"][0]["env"] = json!([
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "env-cm", "key": "mode"}}},
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "env-sec", "key": "password"}}},
        {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "env-sec", "key": "nope", "optional": true}}},
        {"name": "user", "value": "explicit wins"},
    ]);
    let mut c = ctx();
    c.sources.configmaps.insert(
        "env-cm".into(),
        Some(data(&[("mode", "edge"), ("1bad", "x")])),
    );
    c.sources.secrets.insert(
        "env-sec".into(),
        Some(data(&[("password", "s3cret"), ("user", "from-secret")])),
    );
    c.sources.configmaps.insert("absent".into(), None);
    let plan = translate(&pod, &c).unwrap();
    let env: Vec<(String, String)> = plan.containers[0]
        .config
        .envs
        .iter()
        .map(|kv| (kv.key.clone(), kv.value.clone()))
        .collect();
    let get = |k: &str| env.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str());
    assert_eq!(get("CM_mode"), Some("edge"));
    assert_eq!(
        get("CM_1bad"),
        Some("x"),
        "the prefix makes it a valid name"
    );
    assert_eq!(get("MODE"), Some("edge"));
    assert_eq!(get("PASSWORD"), Some("s3cret"));
    assert_eq!(get("OPT"), None, "optional missing key is left out");
    assert_eq!(get("user"), Some("explicit wins"));
    assert_eq!(env.iter().filter(|(k, _)| k == "user").count(), 1);

    // A required key that is absent, and a Secret never fetched.
    let mut p2 = pod.clone();
    p2["spec"]["containers"][0]["env"] =
        json!([{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "env-cm", "key": "nope"}}}]);
    let m = missing(translate(&p2, &c).unwrap_err());
    assert_eq!(
        m.message,
        "configmap \"vehicle/env-cm\" has no key \"nope\""
    );
    c.sources.secrets.clear();
    let m = missing(translate(&pod, &c).unwrap_err());
    assert_eq!(m.reason, "SecretUnavailable");
}

#[test]
fn secret_and_downward_api_volumes() {
    let mut pod = runnable("telemetry-sv74m");
    pod["metadata"]["labels"] = json!({"b": "2", "a": "x\"y"});
    pod["spec"]["volumes"] = json!([
        {"name": "creds", "secret": {"secretName": "db", "defaultMode": 256,
            "items": [{"key": "password", "path": "auth/pw", "mode": 384}, {"key": "user", "path": "user"}]}},
        {"name": "info", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "a", "fieldRef": {"fieldPath": "metadata.labels['a']"}},
            {"path": "mem", "resourceFieldRef": {"containerName": "app", "resource": "limits.memory", "divisor": "1Mi"}},
        ]}},
    ]);
    pod["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "creds", "mountPath": "/creds"}, {"name": "info", "mountPath": "/info"}]);
    pod["spec"]["containers"][0]["resources"] = json!({"limits": {"memory": "64Mi"}});
    let mut c = ctx();
    c.sources.secrets.insert(
        "db".into(),
        Some(data(&[("password", "pw"), ("user", "u"), ("other", "o")])),
    );
    let plan = translate(&pod, &c).unwrap();
    let files = |i: usize| match &plan.volumes[i] {
        VolumePlan::Files { files, .. } => files.clone(),
        other => panic!("{other:?}"),
    };
    let creds = files(0);
    assert_eq!(creds.len(), 2, "only the listed items");
    assert_eq!((creds[0].path.as_str(), creds[0].mode), ("auth/pw", 0o600));
    assert_eq!((creds[1].path.as_str(), creds[1].mode), ("user", 0o400));
    let info = files(1);
    assert_eq!(
        String::from_utf8(info[0].data.clone()).unwrap(),
        "a=\"x\\\"y\"\nb=\"2\""
    );
    assert_eq!(info[1].data, b"x\"y");
    assert_eq!(info[2].data, b"64");
    assert!(plan.containers[0].config.mounts.iter().all(|m| m.readonly));

    // Paths that would leave the volume are refused, whatever the cache says.
    for bad in ["../escape", "/abs", "a/../../b", ""] {
        let mut p = pod.clone();
        p["spec"]["volumes"][0]["secret"]["items"][0]["path"] = json!(bad);
        let f = unsupported_field(translate(&p, &c).unwrap_err());
        assert_eq!(f, "spec.volumes[0].secret.items[0].path", "{bad}");
    }
    // An optional Secret that does not exist is an empty volume.
    let mut p = pod.clone();
    p["spec"]["volumes"][0]["secret"]["optional"] = json!(true);
    c.sources.secrets.insert("db".into(), None);
    let plan = translate(&p, &c).unwrap();
    assert!(matches!(&plan.volumes[0], VolumePlan::Files { files, .. } if files.is_empty()));
}

#[test]
fn image_pull_secrets_give_registry_credentials() {
    let mut pod = runnable("telemetry-sv74m");
    pod["spec"]["imagePullSecrets"] = json!([{"name": "absent"}, {"name": "reg"}]);
    let image = pod["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_string();
    let host = crate::sources::registry_of(&image).to_string();
    let cfg = json!({"auths": {host.clone(): {"auth": "dXNlcjpwYXNz"}}}).to_string();
    let mut c = ctx();
    c.sources
        .secrets
        .insert("reg".into(), Some(data(&[(".dockerconfigjson", &cfg)])));
    let plan = translate(&pod, &c).unwrap();
    let auth = plan.containers[0].auth.clone().unwrap();
    assert_eq!(
        (auth.username.as_str(), auth.password.as_str()),
        ("user", "pass")
    );
    assert_eq!(auth.server, host);
    // Without the Secret the pull is anonymous, as with the kubelet.
    let plan = translate(&pod, &ctx()).unwrap();
    assert!(plan.containers[0].auth.is_none());
}

use super::fetch::{token_due, token_request, tokens_to_renew};
use super::*;
use crate::object::ObjectIndex;
use crate::store::StoredObject;
use serde_json::json;

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/apiserver/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn recorded_pod(name: &str) -> Value {
    fixture("pods_list_node")["response"]["body"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["metadata"]["name"] == name)
        .unwrap()
        .clone()
}

#[test]
fn the_recorded_pod_references_its_configmaps_and_token() {
    let refs = references(&recorded_pod("telemetry-sv74m"));
    assert_eq!(
        refs,
        vec![
            SourceRef::ConfigMap {
                name: "kube-root-ca.crt".into()
            },
            SourceRef::ConfigMap {
                name: "openshift-service-ca.crt".into()
            },
            SourceRef::ConfigMap {
                name: "telemetry-cfg".into()
            },
            SourceRef::Token {
                service_account: "default".into(),
                audience: String::new(),
                expiration_secs: 3607
            },
        ]
    );
}

#[test]
fn every_kind_of_reference_is_found_once() {
    let pod = json!({"spec": {
        "serviceAccountName": "sa",
        "imagePullSecrets": [{"name": "reg"}, {"name": ""}],
        "volumes": [
            {"name": "a", "secret": {"secretName": "s1"}},
            {"name": "b", "projected": {"sources": [
                {"secret": {"name": "s2"}},
                {"serviceAccountToken": {"audience": "vault", "expirationSeconds": 60, "path": "t"}}
            ]}}
        ],
        "initContainers": [{"envFrom": [{"configMapRef": {"name": "c1"}}]}],
        "containers": [{
            "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s1", "key": "k"}}},
                    {"name": "Y", "valueFrom": {"configMapKeyRef": {"name": "c2", "key": "k"}}}],
            "envFrom": [{"secretRef": {"name": "s3"}}]
        }]
    }});
    let refs = references(&pod);
    let names: Vec<String> = refs
        .iter()
        .map(|r| match r {
            SourceRef::ConfigMap { name } => format!("cm/{name}"),
            SourceRef::Secret { name } => format!("secret/{name}"),
            SourceRef::Token {
                service_account,
                audience,
                expiration_secs,
            } => format!("token/{service_account}/{audience}/{expiration_secs}"),
        })
        .collect();
    assert_eq!(
        names,
        [
            "cm/c1",
            "cm/c2",
            "secret/reg",
            "secret/s1",
            "secret/s2",
            "secret/s3",
            // Below the apiserver's minimum lifetime: asked for at the minimum.
            "token/sa/vault/600"
        ]
    );
}

#[test]
fn configmap_and_secret_data_decode() {
    let cm = fixture("configmap_get_as_node")["response"]["body"].to_string();
    let d = decode_data("configmaps", &cm).unwrap();
    assert_eq!(d["app.conf"], b"level=info\n");

    let cm = json!({"data": {"t": "x"}, "binaryData": {"b": "AAEC"}}).to_string();
    let d = decode_data("configmaps", &cm).unwrap();
    assert_eq!(
        (d["t"].as_slice(), d["b"].as_slice()),
        (&b"x"[..], &[0u8, 1, 2][..])
    );

    let sec = json!({"data": {"password": "czNjcmV0"}}).to_string();
    assert_eq!(decode_data("secrets", &sec).unwrap()["password"], b"s3cret");
    for bad in ["{", r#"{"data": {"k": 1}}"#] {
        assert!(decode_data("configmaps", bad).is_err(), "{bad}");
    }
    assert!(decode_data("secrets", r#"{"data": {"k": "not base64!"}}"#).is_err());
}

#[test]
fn registry_credentials_match_the_image_registry() {
    assert_eq!(registry_of("busybox"), "docker.io");
    assert_eq!(registry_of("library/busybox:1"), "docker.io");
    assert_eq!(registry_of("127.0.0.1:5000/busybox:1.0"), "127.0.0.1:5000");
    assert_eq!(
        registry_of("registry.example/a/b@sha256:00"),
        "registry.example"
    );
    assert_eq!(registry_of("localhost/x"), "localhost");

    let data = |j: Value| -> Data {
        Data::from([(".dockerconfigjson".to_string(), j.to_string().into_bytes())])
    };
    let hub =
        data(json!({"auths": {"https://index.docker.io/v1/": {"username": "u", "password": "p"}}}));
    let local = data(json!({"auths": {"127.0.0.1:5000": {"auth": "YWRtaW46c2VjcmV0"}}}));
    let a = auth_for("busybox:1", &[&local, &hub]).unwrap();
    assert_eq!(
        (a.username.as_str(), a.password.as_str(), a.server.as_str()),
        ("u", "p", "docker.io")
    );
    let a = auth_for("127.0.0.1:5000/busybox:1.0", &[&hub, &local]).unwrap();
    assert_eq!(
        (a.username.as_str(), a.password.as_str()),
        ("admin", "secret")
    );
    assert_eq!(auth_for("quay.io/x", &[&hub, &local]), None);
    let garbage = Data::from([(".dockerconfigjson".to_string(), b"nope".to_vec())]);
    assert_eq!(auth_for("busybox", &[&garbage]), None);
}

#[test]
fn tokens_renew_after_eighty_percent_of_their_life() {
    let (issued, expires) = (1_000_000, 1_000_000 + 3_600_000);
    assert!(!token_due(issued + 2_879_999, issued, expires));
    assert!(token_due(issued + 2_880_000, issued, expires));
    assert!(token_due(expires + 1, issued, expires));
    assert!(token_due(0, 10, 5), "a nonsense record is renewed");
}

#[test]
fn tokens_are_renewed_together_once_one_is_due() {
    let life = 3_600_000;
    let at = |issued: i64| Some((issued, issued + life));
    // Nothing due: nothing requested, however old the others are.
    assert_eq!(
        tokens_to_renew(2_879_999, &[at(0), at(1_000_000)]),
        [false, false]
    );
    // One due: it goes, with every token past 40 % of its life, not the younger ones.
    let now = 2_880_000;
    assert_eq!(
        tokens_to_renew(now, &[at(0), at(now - 1_440_000), at(now - 1_439_999)]),
        [true, true, false]
    );
    // A pod without a token starts a round too.
    assert_eq!(
        tokens_to_renew(now, &[None, at(now - 1_440_000), at(now)]),
        [true, true, false]
    );
    assert!(tokens_to_renew(now, &[]).is_empty());
}

#[test]
fn groups_of_tokens_merge_at_the_first_renewal_of_either() {
    // Two groups issued at any offset share one renewal time after at most one round each,
    // and afterwards each token is renewed at 80 % of its life, as the kubelet renews it.
    let life = 3_600_000;
    for offset in [1, 600_000, 1_000_000, 1_440_000, 2_000_000, 2_879_999] {
        let mut issued = [0i64, offset];
        let mut rounds = Vec::new();
        let mut now = offset;
        while now < 10 * life {
            now += 1_000; // the fetcher's pass
            let cached: Vec<_> = issued.iter().map(|&i| Some((i, i + life))).collect();
            let pick = tokens_to_renew(now, &cached);
            if pick.iter().any(|&p| p) {
                rounds.push((now, pick.clone()));
                for (i, p) in issued.iter_mut().zip(&pick) {
                    if *p {
                        *i = now;
                    }
                }
            }
        }
        assert!(rounds.len() >= 3, "offset {offset}: {rounds:?}");
        assert_eq!(issued[0], issued[1], "offset {offset}: merged");
        let together = rounds
            .iter()
            .position(|(_, p)| p.iter().all(|&x| x))
            .unwrap();
        assert!(together <= 1, "offset {offset}: merged at round {together}");
        for w in rounds[together..].windows(2) {
            assert_eq!(w[1].0 - w[0].0, life * 8 / 10, "offset {offset}");
        }
    }
}

#[test]
fn the_token_request_is_the_recorded_one() {
    // The recording asked for the replacement pod's token; the list shows its sibling.
    let recorded = fixture("serviceaccount_token_for_pod_as_node")["request"]["body"].clone();
    let mut raw = recorded_pod("telemetry-sv74m");
    raw["metadata"]["name"] = recorded["spec"]["boundObjectRef"]["name"].clone();
    raw["metadata"]["uid"] = recorded["spec"]["boundObjectRef"]["uid"].clone();
    let pod = StoredObject {
        index: ObjectIndex::from_raw(crate::object::Kind::Pod, &raw.to_string()).unwrap(),
        raw: raw.to_string(),
    };
    let (audience, exp) =
        token_params(&raw["spec"]["volumes"][2]["projected"]["sources"][0]["serviceAccountToken"]);
    assert_eq!(token_request(&pod.index, &audience, exp), recorded);
    let with_audience = token_request(&pod.index, "vault", 600);
    assert_eq!(with_audience["spec"]["audiences"], json!(["vault"]));
}

#[test]
fn references_are_parsed_again_only_when_the_pod_changed() {
    use super::fetch::References;
    use std::collections::HashSet;
    let obj = |v: &Value| StoredObject::from_raw(crate::object::Kind::Pod, v.to_string()).unwrap();
    let telemetry = recorded_pod("telemetry-sv74m");
    let gateway = recorded_pod("gateway-v9hb2");
    let mut known = References::default();
    let mut seen = HashSet::new();
    let first = known.of(vec![obj(&telemetry), obj(&gateway)], &mut seen);
    assert_eq!(known.parsed, 2);
    assert_eq!(first[0].1, references(&telemetry));

    // The same JSON again: nothing parsed, the same answer.
    let mut seen = HashSet::new();
    let again = known.of(vec![obj(&telemetry), obj(&gateway)], &mut seen);
    assert_eq!(known.parsed, 2);
    assert_eq!(again, first);

    // One pod changed (the same resourceVersion, as a test's cache may have it): that one.
    let mut edited = gateway.clone();
    edited["spec"]["volumes"] = json!([{"name": "s", "secret": {"secretName": "new"}}]);
    let mut seen = HashSet::new();
    let changed = known.of(vec![obj(&telemetry), obj(&edited)], &mut seen);
    assert_eq!(known.parsed, 3);
    assert_eq!(changed[1].1, vec![SourceRef::Secret { name: "new".into() }]);

    // A pod that left the cache is forgotten; coming back, it is parsed again.
    let mut seen = HashSet::new();
    known.of(vec![obj(&telemetry)], &mut seen);
    known.retain(&seen);
    let mut seen = HashSet::new();
    known.of(vec![obj(&telemetry), obj(&edited)], &mut seen);
    assert_eq!(known.parsed, 4);
}

//! `deploy/controller.yaml` fits the binary: the Deployment runs `edgehub controller` with
//! the Lease identity and namespace from the downward API, its probes hit the paths the
//! controller serves on the port it listens on, and the service account is the one bound.
//! The two TLS-bootstrap setups (deploy/bootstrap.yaml, the kubeadm-style default, and
//! deploy/bootstrap-attested.yaml, the recommended one) bind what the recorded kubeadm cluster
//! binds, the attested one without auto-approval of first certificates, and its instructions
//! name the fleet CA the controller may read.
//! (That its RBAC covers every request is checked in tests/controller.rs, against what the
//! controller actually sent.)

use serde_json::Value;

fn text(file: &str) -> String {
    std::fs::read_to_string(format!("{}/deploy/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn docs_of(file: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(&text(file))
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn docs() -> Vec<Value> {
    docs_of("controller.yaml")
}

fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

#[test]
fn the_deployment_runs_the_controller_as_the_bound_service_account() {
    let docs = docs();
    let sa = find(&docs, "ServiceAccount")[0];
    let (sa_name, sa_ns) = (&sa["metadata"]["name"], &sa["metadata"]["namespace"]);
    for binding in find(&docs, "ClusterRoleBinding")
        .into_iter()
        .chain(find(&docs, "RoleBinding"))
    {
        let subject = &binding["subjects"][0];
        assert_eq!(
            (&subject["kind"], &subject["name"], &subject["namespace"]),
            (&Value::from("ServiceAccount"), sa_name, sa_ns)
        );
        let role_kind = binding["roleRef"]["kind"].as_str().unwrap();
        let role_name = &binding["roleRef"]["name"];
        assert!(
            find(&docs, role_kind)
                .iter()
                .any(|r| &r["metadata"]["name"] == role_name),
            "{binding}"
        );
    }
    let deploy = find(&docs, "Deployment")[0];
    assert_eq!(&deploy["metadata"]["namespace"], sa_ns);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(&pod["serviceAccountName"], sa_name);
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "controller");
    let addr = args
        .iter()
        .find_map(|a| a.strip_prefix("--metrics-addr="))
        .unwrap();
    let port: u64 = addr.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(c["ports"][0]["containerPort"], port);
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    let env: Vec<(&str, &str)> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?,
                e.pointer("/valueFrom/fieldRef/fieldPath")?.as_str()?,
            ))
        })
        .collect();
    assert!(env.contains(&("POD_NAME", "metadata.name")));
    assert!(env.contains(&("POD_NAMESPACE", "metadata.namespace")));
    // The Lease Role lives where the controller looks for the Lease: its own namespace.
    let role = find(&docs, "Role")[0];
    assert_eq!(&role["metadata"]["namespace"], sa_ns);
    let lease = args
        .iter()
        .find_map(|a| a.strip_prefix("--lease-name="))
        .unwrap();
    assert!(role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["resourceNames"][0] == lease));
}

/// The recorded kubeadm bindings (fixtures `bootstrap_rbac_*`): (name, subject group, role).
fn recorded_binding(fixture: &str) -> (String, String, String) {
    let b = &edgehub_testsupport::fixture(fixture)["response"]["body"];
    binding(b)
}

fn binding(b: &Value) -> (String, String, String) {
    assert_eq!(b["subjects"].as_array().unwrap().len(), 1, "{b}");
    assert_eq!(b["subjects"][0]["kind"], "Group", "{b}");
    assert_eq!(b["roleRef"]["kind"], "ClusterRole", "{b}");
    (
        b["metadata"]["name"].as_str().unwrap().into(),
        b["subjects"][0]["name"].as_str().unwrap().into(),
        b["roleRef"]["name"].as_str().unwrap().into(),
    )
}

fn bindings(file: &str) -> Vec<(String, String, String)> {
    docs_of(file)
        .iter()
        .map(|d| {
            assert_eq!(d["kind"], "ClusterRoleBinding", "{file}: only bindings");
            binding(d)
        })
        .collect()
}

#[test]
fn the_default_bootstrap_setup_is_kubeadms_and_the_attested_one_drops_its_auto_approval() {
    let create = recorded_binding("bootstrap_rbac_node_bootstrapper");
    let autoapprove = recorded_binding("bootstrap_rbac_nodeclient");
    let rotation = recorded_binding("bootstrap_rbac_selfnodeclient");
    assert_eq!(
        bindings("bootstrap.yaml"),
        vec![create.clone(), autoapprove.clone(), rotation.clone()]
    );
    let attested = bindings("bootstrap-attested.yaml");
    assert_eq!(attested, vec![create, rotation]);
    // Nothing in the attested setup lets a bootstrap token's CSR be auto-approved.
    assert!(!attested
        .iter()
        .any(|(_, _, role)| role.ends_with(":nodeclient")));
    // ... and its instructions remove the binding a kubeadm cluster already has.
    assert!(text("bootstrap-attested.yaml").contains(&format!(
        "kubectl delete clusterrolebinding {}",
        autoapprove.0
    )));
}

/// (namespace or None, apiGroup, resource, verbs, resourceNames) of one rule.
type Rule = (Option<String>, String, String, Vec<String>, Vec<String>);

fn rules() -> Vec<Rule> {
    let strs = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for d in docs() {
        let ns = match d["kind"].as_str() {
            Some("ClusterRole") => None,
            Some("Role") => Some(d["metadata"]["namespace"].as_str().unwrap().to_string()),
            _ => continue,
        };
        for r in d["rules"].as_array().unwrap() {
            for g in strs(&r["apiGroups"]) {
                for res in strs(&r["resources"]) {
                    out.push((
                        ns.clone(),
                        g.clone(),
                        res,
                        strs(&r["verbs"]),
                        strs(&r["resourceNames"]),
                    ));
                }
            }
        }
    }
    out
}

#[test]
fn the_controller_may_approve_for_the_kubelet_client_signer_and_read_the_fleet_ca() {
    let rules = rules();
    let has = |ns: Option<&str>, group: &str, res: &str, verb: &str, names: &[&str]| {
        rules.iter().any(|(rns, g, r, verbs, rnames)| {
            rns.as_deref() == ns
                && g == group
                && r == res
                && verbs.iter().any(|v| v == verb)
                && rnames == names
        })
    };
    let g = "certificates.k8s.io";
    for verb in ["get", "list", "watch"] {
        assert!(
            has(None, g, "certificatesigningrequests", verb, &[]),
            "{verb}"
        );
    }
    assert!(has(
        None,
        g,
        "certificatesigningrequests/approval",
        "update",
        &[]
    ));
    assert!(has(
        None,
        g,
        "signers",
        "approve",
        &["kubernetes.io/kube-apiserver-client-kubelet"]
    ));
    // The flag in the attested setup's instructions names a ConfigMap the controller may
    // read, in the namespace it runs in, and the create command makes that ConfigMap with
    // the key the controller reads.
    let instructions = text("bootstrap-attested.yaml");
    let flag = instructions
        .split("--attest-fleet-ca=")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap();
    let parts: Vec<&str> = flag.split('/').collect();
    let ["configmap", namespace, name] = parts.as_slice() else {
        panic!("{flag}: the documented setup uses configmap/<namespace>/<name>");
    };
    let (namespace, name) = (namespace.to_string(), name.to_string());
    let docs = docs();
    let sa = &find(&docs, "ServiceAccount")[0]["metadata"]["namespace"];
    assert_eq!(sa, &Value::from(namespace.clone()));
    assert!(has(Some(&namespace), "", "configmaps", "get", &[&name]));
    assert!(instructions.contains(&format!(
        "kubectl -n {namespace} create configmap {name} --from-file=ca.crt="
    )));
}

//! The fake's TLS-bootstrap side, as the `bootstrap_*` and `csr_*` fixtures show it:
//! bootstrap tokens (`Bearer <id>.<secret>` → `system:bootstrap:<id>`), SelfSubjectReview,
//! client certificates checked per request as the apiserver's x509 authenticator does (an
//! expired one is a plain 401, not a failed handshake), and the CertificateSigningRequest API:
//! create (RBAC, NodeRestriction's CN check, the 600 s minimum), the `/approval` subresource,
//! an approver that stands in for kube-controller-manager's csrapproving (pluggable: a test
//! can leave every CSR pending for an external approver), and the kubelet-client signer with
//! the server's CA (5 minutes backdated, a `Failed` condition for usages it refuses).

use super::{
    commit, forbidden, json_response, lock, not_found, now_rfc3339, parse_body, status, Body,
    ResourceType, Route, State,
};
use crate::certs::{parse_csr, ParsedCsr};
use base64::Engine;
use hyper::{Method, Response};
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The CSR resource (the last of [`super::RESOURCES`]).
pub const CSR: &ResourceType = &super::RESOURCES[super::RESOURCES.len() - 1];

/// The signer of kubelet client certificates.
pub const KUBELET_CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
/// The signer of kubelet serving certificates: never auto-approved by the built-in approver.
pub const KUBELET_SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";

/// A bootstrap token, as a `bootstrap.kubernetes.io/token` Secret in kube-system holds it.
#[derive(Debug, Clone)]
pub struct BootstrapToken {
    /// `[a-z0-9]{6}`.
    pub id: String,
    /// `[a-z0-9]{16}`.
    pub secret: String,
    /// After this the token is a plain 401 (fixture `bootstrap_token_expired_unauthorized`).
    pub expiration: Option<SystemTime>,
    /// The Secret's `auth-extra-groups`.
    pub extra_groups: Vec<String>,
}

impl BootstrapToken {
    /// A token as the recording's: `auth-extra-groups: system:bootstrappers:edgehub`, a day.
    pub fn new(id: &str, secret: &str) -> BootstrapToken {
        BootstrapToken {
            id: id.into(),
            secret: secret.into(),
            expiration: Some(SystemTime::now() + Duration::from_secs(86_400)),
            extra_groups: vec!["system:bootstrappers:edgehub".into()],
        }
    }

    /// What a client sends: `<id>.<secret>`.
    pub fn bearer(&self) -> String {
        format!("{}.{}", self.id, self.secret)
    }
}

/// A CSR as the approver sees it.
#[derive(Debug, Clone)]
pub struct CsrRequest {
    pub name: String,
    pub username: String,
    pub groups: Vec<String>,
    pub signer_name: String,
    pub usages: Vec<String>,
    pub common_name: Option<String>,
    pub organizations: Vec<String>,
    /// The whole stored object (annotations, spec.request, ...).
    pub object: Value,
}

/// What an approver decides about a CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Approval {
    Approve {
        reason: String,
        message: String,
    },
    Deny {
        reason: String,
        message: String,
    },
    /// Neither: the CSR stays pending (for an external approver, or for ever).
    Pending,
}

/// The pluggable approver: called once per created CSR.
pub type Approver = Arc<dyn Fn(&CsrRequest) -> Approval + Send + Sync>;

/// The validity the signer gives, in place of the real 5-minute backdate and the requested
/// `expirationSeconds` (whose minimum, 600 s, is too long for a test): test-only.
#[derive(Debug, Clone, Copy)]
pub struct TestOnlyCertWindow {
    pub backdate: Duration,
    pub valid_for: Duration,
}

/// A client certificate the fake knows, with what its authenticator checks per request.
#[derive(Debug, Clone)]
pub(super) struct CertIdentity {
    pub user: String,
    pub groups: Vec<String>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// `X509SHA256=<hex>`, the credential-id the apiserver puts in `extra`.
    pub credential_id: String,
}

/// Who a request authenticated as.
#[derive(Debug, Clone)]
pub(super) struct Caller {
    pub user: String,
    /// The static token file's uid column (bootstrap tokens and certificates have none).
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub credential_id: Option<String>,
}

pub(super) struct CsrState {
    tokens: HashMap<String, BootstrapToken>,
    approver: Option<Approver>,
    /// Users besides `admin` that may use the `/approval` subresource.
    approvers: HashSet<String>,
    /// ClusterRoleBinding `kubeadm:node-autoapprove-bootstrap` is in place.
    bootstrap_autoapprove: bool,
    /// ClusterRoleBinding `kubeadm:node-autoapprove-certificate-rotation` is in place.
    rotation_autoapprove: bool,
    window: Option<TestOnlyCertWindow>,
    /// Test only: the issued certificate's window is moved this far into the future in its
    /// bytes, while the authenticator judges the real one.
    not_before_ahead: Option<Duration>,
    /// Delay of the approver and of the signer after the write they follow.
    controller_delay: Duration,
    name_seq: u64,
}

impl Default for CsrState {
    fn default() -> Self {
        CsrState {
            tokens: HashMap::new(),
            approver: None,
            approvers: HashSet::new(),
            bootstrap_autoapprove: true,
            rotation_autoapprove: true,
            window: None,
            not_before_ahead: None,
            controller_delay: Duration::from_millis(5),
            name_seq: 0,
        }
    }
}

impl CsrState {
    pub fn add_token(&mut self, t: BootstrapToken) {
        self.tokens.insert(t.id.clone(), t);
    }

    pub fn remove_token(&mut self, id: &str) {
        self.tokens.remove(id);
    }

    pub fn set_approver(&mut self, a: Option<Approver>) {
        self.approver = a;
    }

    pub fn allow_approver(&mut self, user: &str) {
        self.approvers.insert(user.into());
    }

    pub fn set_bindings(&mut self, bootstrap: bool, rotation: bool) {
        self.bootstrap_autoapprove = bootstrap;
        self.rotation_autoapprove = rotation;
    }

    pub fn set_window(&mut self, w: Option<TestOnlyCertWindow>) {
        self.window = w;
    }

    pub fn set_not_before_ahead(&mut self, d: Option<Duration>) {
        self.not_before_ahead = d;
    }
}

/// The bootstrap-token authenticator: `<id>.<secret>` of a known, unexpired token.
pub(super) fn bootstrap_caller(state: &State, bearer: &str) -> Option<Caller> {
    let (id, secret) = bearer.split_once('.')?;
    let ok = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    };
    if !ok(id, 6) || !ok(secret, 16) {
        return None;
    }
    let csr = lock(&state.csr);
    let t = csr.tokens.get(id)?;
    if t.secret != secret || t.expiration.is_some_and(|e| e <= SystemTime::now()) {
        return None;
    }
    let mut groups = vec!["system:bootstrappers".to_string()];
    groups.extend(t.extra_groups.iter().cloned());
    groups.push("system:authenticated".into());
    Some(Caller {
        user: format!("system:bootstrap:{id}"),
        groups,
        uid: None,
        credential_id: None,
    })
}

/// The x509 authenticator: a certificate the fake issued, inside its validity window.
pub(super) fn cert_caller(id: &CertIdentity) -> Option<Caller> {
    let now = SystemTime::now();
    if now < id.not_before || now > id.not_after {
        return None;
    }
    Some(Caller {
        user: id.user.clone(),
        groups: id.groups.clone(),
        uid: None,
        credential_id: Some(id.credential_id.clone()),
    })
}

/// A static token's user and its groups.
pub(super) fn token_caller(user: &str) -> Caller {
    let mut groups = Vec::new();
    if user.starts_with("system:node:") {
        groups.push("system:nodes".to_string());
    } else if user == "admin" {
        groups.push("system:masters".to_string());
    }
    groups.push("system:authenticated".into());
    Caller {
        user: user.into(),
        uid: Some(static_uid(user)),
        groups,
        credential_id: None,
    }
}

/// The uid the recorded cluster's token file gives a static-token user (`node-edge-1` for
/// `system:node:edge-1`, else the user name).
pub(super) fn static_uid(user: &str) -> String {
    match user.strip_prefix("system:node:") {
        Some(node) => format!("node-{node}"),
        None => user.to_string(),
    }
}

pub(super) fn credential_id(der: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, der);
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("X509SHA256={hex}")
}

/// `POST /apis/authentication.k8s.io/v1/selfsubjectreviews` (fixtures `bootstrap_token_whoami`,
/// `csr_issued_cert_whoami`).
pub(super) fn self_subject_review(caller: &Caller) -> Response<Body> {
    let mut info = Map::new();
    info.insert("username".into(), caller.user.clone().into());
    if let Some(uid) = &caller.uid {
        info.insert("uid".into(), uid.clone().into());
    }
    info.insert("groups".into(), json!(caller.groups));
    if let Some(id) = &caller.credential_id {
        info.insert(
            "extra".into(),
            json!({"authentication.kubernetes.io/credential-id": [id]}),
        );
    }
    json_response(
        201,
        &json!({
            "kind": "SelfSubjectReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": now_rfc3339()},
            "status": {"userInfo": Value::Object(info)},
        }),
    )
}

fn is_bootstrapper(c: &Caller) -> bool {
    c.groups.iter().any(|g| g == "system:bootstrappers")
}

fn is_node(c: &Caller) -> bool {
    c.groups.iter().any(|g| g == "system:nodes") && c.user.starts_with("system:node:")
}

fn is_admin(c: &Caller) -> bool {
    c.groups.iter().any(|g| g == "system:masters")
}

/// RBAC for a bootstrap token outside the CSR API: `system:node-bootstrapper` covers CSRs
/// only (fixture `bootstrap_token_node_create_forbidden`).
pub(super) fn bootstrap_forbidden(
    caller: &Caller,
    verb: &str,
    route: &Route,
) -> Option<Response<Body>> {
    (is_bootstrapper(caller) && route.rt.plural != CSR.plural)
        .then(|| forbidden(&caller.user, verb, route, ""))
}

/// The CSR API: create and `/approval` here; get, list, watch and delete by the generic code
/// once RBAC allows them (`system:node-bootstrapper`, the `system:node` role, admin).
pub(super) fn handle(
    state: &Arc<State>,
    caller: &Caller,
    verb: &'static str,
    method: &Method,
    route: &Route,
    body: &[u8],
) -> Option<Response<Body>> {
    let reader = is_bootstrapper(caller) || is_node(caller) || is_admin(caller);
    match (method, route.name.as_deref(), route.sub.as_deref()) {
        (&Method::PUT, Some(name), Some("approval")) => {
            if !(is_admin(caller) || lock(&state.csr).approvers.contains(&caller.user)) {
                return Some(forbidden(&caller.user, "update", route, ""));
            }
            Some(approve_put(state, name, body))
        }
        (&Method::POST, None, None) if reader => Some(create(state, caller, body)),
        (&Method::GET, _, None) if reader => None,
        (&Method::DELETE, Some(_), None) if is_admin(caller) => None,
        _ => Some(forbidden(&caller.user, verb, route, "")),
    }
}

fn invalid(name: &str, field: &str, msg: &str) -> Response<Body> {
    status(
        422,
        "Invalid",
        &format!(
            "{}.{} \"{name}\" is invalid: {field}: {msg}",
            CSR.kind, CSR.group
        ),
        Some(json!({"name": name, "group": CSR.group, "kind": CSR.kind,
            "causes": [{"reason": "FieldValueInvalid", "message": msg, "field": field}]})),
    )
}

fn generate_name(state: &State, prefix: &str) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut csr = lock(&state.csr);
    csr.name_seq += 1;
    let seed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut n = seed ^ csr.name_seq.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let suffix: String = (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
            n /= ALPHABET.len() as u64;
            c
        })
        .collect();
    format!("{prefix}{suffix}")
}

fn decode_request(spec: &Value) -> Result<(String, ParsedCsr), String> {
    let b64 = spec.get("request").and_then(Value::as_str).unwrap_or("");
    let der_or_pem = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("illegal base64 data: {e}"))?;
    let pem = String::from_utf8(der_or_pem)
        .map_err(|_| "PEM block type must be CERTIFICATE REQUEST".to_string())?;
    if !pem.contains("-----BEGIN CERTIFICATE REQUEST-----") {
        return Err("PEM block type must be CERTIFICATE REQUEST".into());
    }
    let parsed = parse_csr(&pem)?;
    Ok((pem, parsed))
}

fn create(state: &Arc<State>, caller: &Caller, body: &[u8]) -> Response<Body> {
    let obj = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let meta = obj.get("metadata").cloned().unwrap_or(json!({}));
    let spec = obj.get("spec").cloned().unwrap_or(json!({}));
    let given_name = meta.get("name").and_then(Value::as_str).unwrap_or("");
    let generate = meta
        .get("generateName")
        .and_then(Value::as_str)
        .unwrap_or("");
    let signer = spec.get("signerName").and_then(Value::as_str).unwrap_or("");
    let parsed = decode_request(&spec);
    // NodeRestriction (mutating admission, before the name is generated): a node may only ask
    // for its own name from the node signers (fixture `csr_as_node_for_other_node`).
    if let (true, Ok((_, p))) = (is_node(caller), &parsed) {
        let want = caller.user.clone();
        if (signer == KUBELET_CLIENT_SIGNER || signer == KUBELET_SERVING_SIGNER)
            && p.common_name.as_deref() != Some(want.as_str())
        {
            let shown = if given_name.is_empty() {
                generate
            } else {
                given_name
            };
            return status(
                403,
                "Forbidden",
                &format!(
                    "{}.{} \"{shown}\" is forbidden: can only create a node CSR with CN={want}",
                    CSR.plural, CSR.group
                ),
                Some(json!({"name": shown, "group": CSR.group, "kind": CSR.plural})),
            );
        }
    }
    let name = if given_name.is_empty() {
        if generate.is_empty() {
            return invalid(
                "",
                "metadata.name",
                "Required value: name or generateName is required",
            );
        }
        generate_name(state, generate)
    } else {
        given_name.to_string()
    };
    if let Err(e) = &parsed {
        return invalid(
            &name,
            "spec.request",
            &format!("Invalid value: []byte{{...}}: {e}"),
        );
    }
    if signer.is_empty() {
        return invalid(&name, "spec.signerName", "Required value");
    }
    let usages: Vec<String> = spec
        .get("usages")
        .and_then(Value::as_array)
        .map(|u| {
            u.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    if usages.is_empty() {
        return invalid(&name, "spec.usages", "Required value");
    }
    let expiration = spec.get("expirationSeconds").and_then(Value::as_i64);
    if let Some(e) = expiration.filter(|&e| e < 600) {
        return invalid(
            &name,
            "spec.expirationSeconds",
            &format!(
                "Invalid value: {e}: may not specify a duration less than 600 seconds (10 minutes)"
            ),
        );
    }
    // The apiserver's field order: request, signerName, expirationSeconds, usages, then what
    // it fills in from the requester.
    let mut s = Map::new();
    s.insert("request".into(), spec["request"].clone());
    s.insert("signerName".into(), signer.into());
    if let Some(e) = expiration {
        s.insert("expirationSeconds".into(), e.into());
    }
    s.insert("usages".into(), json!(usages));
    s.insert("username".into(), caller.user.clone().into());
    if let Some(uid) = &caller.uid {
        s.insert("uid".into(), uid.clone().into());
    }
    s.insert("groups".into(), json!(caller.groups));
    if let Some(id) = &caller.credential_id {
        s.insert(
            "extra".into(),
            json!({"authentication.kubernetes.io/credential-id": [id]}),
        );
    }
    let mut m = Map::new();
    m.insert("name".into(), name.clone().into());
    if !generate.is_empty() {
        m.insert("generateName".into(), generate.into());
    }
    m.insert("uid".into(), state.new_uid().into());
    if let Some(a) = meta.get("annotations").filter(|a| a.is_object()) {
        m.insert("annotations".into(), a.clone());
    }
    if let Some(l) = meta.get("labels").filter(|a| a.is_object()) {
        m.insert("labels".into(), l.clone());
    }
    let mut out = Map::new();
    out.insert("kind".into(), CSR.kind.into());
    out.insert("apiVersion".into(), "certificates.k8s.io/v1".into());
    out.insert("metadata".into(), Value::Object(m));
    out.insert("spec".into(), Value::Object(s));
    out.insert("status".into(), json!({}));
    let key = (CSR.plural.to_string(), String::new(), name.clone());
    let stored = {
        let mut db = lock(&state.db);
        if db.objects.contains_key(&key) {
            return status(
                409,
                "AlreadyExists",
                &format!("{}.{} \"{name}\" already exists", CSR.plural, CSR.group),
                Some(json!({"name": name, "group": CSR.group, "kind": CSR.plural})),
            );
        }
        commit(state, &mut db, CSR, key, Value::Object(out), None)
    };
    let st = state.clone();
    tokio::spawn(async move { run_approver(st, name).await });
    json_response(201, &stored)
}

fn condition(kind: &str, reason: &str, message: &str) -> Value {
    let now = now_rfc3339();
    json!({"type": kind, "status": "True", "reason": reason, "message": message,
           "lastUpdateTime": now, "lastTransitionTime": now})
}

fn has_condition(obj: &Value, kind: &str) -> bool {
    obj.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|c| c.iter().any(|c| c["type"] == kind))
}

/// Appends a condition to a stored CSR (a MODIFIED event); `None` when it is gone.
fn add_condition(state: &State, name: &str, cond: Value) -> Option<Value> {
    let key = (CSR.plural.to_string(), String::new(), name.to_string());
    let mut db = lock(&state.db);
    let cur = db.objects.get(&key)?.clone();
    let mut next = cur.clone();
    if !next["status"].is_object() {
        next["status"] = json!({});
    }
    match next["status"]["conditions"].as_array_mut() {
        Some(list) => list.push(cond),
        None => next["status"]["conditions"] = json!([cond]),
    }
    Some(commit(state, &mut db, CSR, key, next, Some(cur)))
}

fn request_of(obj: &Value) -> Option<CsrRequest> {
    let spec = obj.get("spec")?;
    let parsed = decode_request(spec).ok().map(|(_, p)| p);
    let strs = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    Some(CsrRequest {
        name: obj.pointer("/metadata/name")?.as_str()?.to_string(),
        username: spec["username"].as_str().unwrap_or("").into(),
        groups: strs(&spec["groups"]),
        signer_name: spec["signerName"].as_str().unwrap_or("").into(),
        usages: strs(&spec["usages"]),
        common_name: parsed.as_ref().and_then(|p| p.common_name.clone()),
        organizations: parsed.map(|p| p.organizations).unwrap_or_default(),
        object: obj.clone(),
    })
}

/// `ValidateKubeletClientCSR` (k8s.io/kubernetes pkg/apis/certificates): what both the
/// approver's recognizers and the kubelet-client signer check.
pub fn validate_kubelet_client(
    common_name: Option<&str>,
    organizations: &[String],
    has_sans: bool,
    usages: &[String],
) -> Result<(), String> {
    if organizations != ["system:nodes"] {
        return Err("subject organization is not system:nodes".into());
    }
    if !common_name.is_some_and(|cn| cn.starts_with("system:node:")) {
        return Err("subject common name does not begin with system:node:".into());
    }
    if has_sans {
        return Err("subjectAltNames are not allowed".into());
    }
    let set: std::collections::BTreeSet<&str> = usages.iter().map(String::as_str).collect();
    let no_rsa: std::collections::BTreeSet<&str> =
        ["client auth", "digital signature"].into_iter().collect();
    let rsa: std::collections::BTreeSet<&str> =
        ["client auth", "digital signature", "key encipherment"]
            .into_iter()
            .collect();
    if set != no_rsa && set != rsa {
        return Err("usages did not match [client auth digital signature key encipherment]".into());
    }
    Ok(())
}

/// `ValidateKubeletServingCSR` (k8s.io/kubernetes pkg/apis/certificates): what the
/// kubelet-serving signer checks before it signs.
pub fn validate_kubelet_serving(csr: &ParsedCsr, usages: &[String]) -> Result<(), String> {
    if csr.organizations != ["system:nodes"] {
        return Err("subject organization is not system:nodes".into());
    }
    if csr.dns_names.is_empty() && csr.ip_addresses.is_empty() {
        return Err("DNS or IP subjectAltName is required".into());
    }
    if csr.other_sans {
        return Err("Email subjectAltNames are not allowed".into());
    }
    let set: std::collections::BTreeSet<&str> = usages.iter().map(String::as_str).collect();
    let no_rsa: std::collections::BTreeSet<&str> =
        ["digital signature", "server auth"].into_iter().collect();
    let rsa: std::collections::BTreeSet<&str> =
        ["digital signature", "key encipherment", "server auth"]
            .into_iter()
            .collect();
    if set != no_rsa && set != rsa {
        return Err("usages did not match [digital signature key encipherment server auth]".into());
    }
    if !csr
        .common_name
        .as_deref()
        .is_some_and(|cn| cn.starts_with("system:node:"))
    {
        return Err("subject common name does not begin with system:node:".into());
    }
    Ok(())
}

/// kube-controller-manager's csrapproving with kubeadm's bindings: a kubelet client CSR is
/// approved for its own node (`selfnodeclient`, a node renewing) or for a bootstrapper
/// (`nodeclient`); anything else is left alone.
pub fn csrapproving(req: &CsrRequest, bootstrap_bound: bool, rotation_bound: bool) -> Approval {
    if req.signer_name != KUBELET_CLIENT_SIGNER {
        return Approval::Pending;
    }
    let has_sans = req
        .object
        .get("spec")
        .and_then(|s| decode_request(s).ok())
        .is_some_and(|(_, p)| p.has_sans);
    if validate_kubelet_client(
        req.common_name.as_deref(),
        &req.organizations,
        has_sans,
        &req.usages,
    )
    .is_err()
    {
        return Approval::Pending;
    }
    let approve = |message: &str| Approval::Approve {
        reason: "AutoApproved".into(),
        message: message.into(),
    };
    let in_group = |g: &str| req.groups.iter().any(|x| x == g);
    if req.common_name.as_deref() == Some(req.username.as_str())
        && in_group("system:nodes")
        && rotation_bound
    {
        return approve(
            "Auto approving self kubelet client certificate after SubjectAccessReview.",
        );
    }
    if in_group("system:bootstrappers") && bootstrap_bound {
        return approve("Auto approving kubelet client certificate after SubjectAccessReview.");
    }
    Approval::Pending
}

async fn run_approver(state: Arc<State>, name: String) {
    let delay = lock(&state.csr).controller_delay;
    tokio::time::sleep(delay).await;
    let Some(obj) = state_get(&state, &name) else {
        return;
    };
    let Some(req) = request_of(&obj) else {
        return;
    };
    let (custom, b, r) = {
        let c = lock(&state.csr);
        (
            c.approver.clone(),
            c.bootstrap_autoapprove,
            c.rotation_autoapprove,
        )
    };
    let decision = match custom {
        Some(f) => f(&req),
        None => csrapproving(&req, b, r),
    };
    match decision {
        Approval::Pending => {}
        Approval::Deny { reason, message } => {
            add_condition(&state, &name, condition("Denied", &reason, &message));
        }
        Approval::Approve { reason, message } => {
            if add_condition(&state, &name, condition("Approved", &reason, &message)).is_some() {
                run_signer(state, name).await;
            }
        }
    }
}

fn state_get(state: &State, name: &str) -> Option<Value> {
    lock(&state.db)
        .objects
        .get(&(CSR.plural.to_string(), String::new(), name.to_string()))
        .cloned()
}

/// The kubelet-client signer: signs an approved CSR with the server's CA, or marks it Failed.
async fn run_signer(state: Arc<State>, name: String) {
    let delay = lock(&state.csr).controller_delay;
    tokio::time::sleep(delay).await;
    let Some(obj) = state_get(&state, &name) else {
        return;
    };
    if !has_condition(&obj, "Approved")
        || has_condition(&obj, "Denied")
        || has_condition(&obj, "Failed")
        || obj.pointer("/status/certificate").is_some()
    {
        return;
    }
    let spec = &obj["spec"];
    let serving = match spec["signerName"].as_str() {
        Some(KUBELET_CLIENT_SIGNER) => false,
        Some(KUBELET_SERVING_SIGNER) => true,
        _ => return,
    };
    let Ok((_, parsed)) = decode_request(spec) else {
        return;
    };
    let usages: Vec<String> = spec["usages"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let valid = if serving {
        validate_kubelet_serving(&parsed, &usages)
    } else {
        validate_kubelet_client(
            parsed.common_name.as_deref(),
            &parsed.organizations,
            parsed.has_sans,
            &usages,
        )
    };
    if let Err(msg) = valid {
        add_condition(
            &state,
            &name,
            condition("Failed", "SignerValidationFailure", &msg),
        );
        return;
    }
    // --cluster-signing-duration=8760h caps what a CSR asks for.
    let asked = spec["expirationSeconds"]
        .as_u64()
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(8760 * 3600))
        .min(Duration::from_secs(8760 * 3600));
    let now = SystemTime::now();
    let window = lock(&state.csr).window;
    let (not_before, not_after) = match window {
        Some(w) => (now - w.backdate, now + w.valid_for),
        None => {
            let backdate = Duration::from_secs(300);
            // Below 8 h the signer keeps the backdate on top of the lifetime.
            if asked >= Duration::from_secs(8 * 3600) {
                (now - backdate, now - backdate + asked)
            } else {
                (now - backdate, now + asked)
            }
        }
    };
    let key_enc = usages.iter().any(|u| u == "key encipherment");
    let ahead = lock(&state.csr).not_before_ahead.unwrap_or_default();
    let signed = if serving {
        state
            .pki
            .sign_serving_csr(&parsed, key_enc, not_before + ahead, not_after + ahead)
    } else {
        state
            .pki
            .sign_csr(&parsed, key_enc, not_before + ahead, not_after + ahead)
    };
    let Ok(issued) = signed else {
        return;
    };
    if !serving {
        // A client certificate authenticates its subject from now on.
        let user = parsed.common_name.clone().unwrap_or_default();
        let mut groups = parsed.organizations.clone();
        groups.push("system:authenticated".into());
        lock(&state.certs).insert(
            issued.der.clone(),
            CertIdentity {
                user,
                groups,
                not_before,
                not_after,
                credential_id: credential_id(&issued.der),
            },
        );
    }
    let key = (CSR.plural.to_string(), String::new(), name.clone());
    let mut db = lock(&state.db);
    let Some(cur) = db.objects.get(&key).cloned() else {
        return;
    };
    let mut next = cur.clone();
    next["status"]["certificate"] = base64::engine::general_purpose::STANDARD
        .encode(issued.cert_pem.as_bytes())
        .into();
    commit(&state, &mut db, CSR, key, next, Some(cur));
}

/// `PUT .../certificatesigningrequests/<name>/approval`: the conditions of the body replace
/// the stored ones, with the timestamps the apiserver fills in (fixtures `csr_denied`,
/// `csr_wrong_usages_admin_approved`); an approval sets the signer going.
fn approve_put(state: &Arc<State>, name: &str, body: &[u8]) -> Response<Body> {
    let obj = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let key = (CSR.plural.to_string(), String::new(), name.to_string());
    let mut conds: Vec<Value> = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let now = now_rfc3339();
    for c in conds.iter_mut() {
        for f in ["lastUpdateTime", "lastTransitionTime"] {
            if c.get(f).is_none_or(Value::is_null) {
                c[f] = now.clone().into();
            }
        }
    }
    let types: Vec<&str> = conds.iter().filter_map(|c| c["type"].as_str()).collect();
    if types.contains(&"Approved") && types.contains(&"Denied") {
        let i = types.iter().position(|t| *t == "Denied").unwrap_or(0);
        return invalid(
            name,
            &format!("status.conditions[{i}].type"),
            "Invalid value: \"Denied\": Approved and Denied conditions are mutually exclusive",
        );
    }
    let approved = {
        let mut db = lock(&state.db);
        let Some(cur) = db.objects.get(&key).cloned() else {
            return not_found(CSR, name);
        };
        let want = obj
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !want.is_empty()
            && Some(want)
                != cur
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
        {
            return status(
                409,
                "Conflict",
                &format!("Operation cannot be fulfilled on {}.{} \"{name}\": the object has been modified; please apply your changes to the latest version and try again", CSR.plural, CSR.group),
                Some(json!({"name": name, "group": CSR.group, "kind": CSR.plural})),
            );
        }
        if has_condition(&cur, "Approved") && types.contains(&"Denied") {
            return invalid(
                name,
                "status.conditions",
                "Forbidden: updates may not remove a condition of type \"Approved\"",
            );
        }
        let mut next = cur.clone();
        if !next["status"].is_object() {
            next["status"] = json!({});
        }
        next["status"]["conditions"] = Value::Array(conds);
        let out = commit(state, &mut db, CSR, key, next, Some(cur));
        (has_condition(&out, "Approved"), out)
    };
    if approved.0 {
        let st = state.clone();
        let n = name.to_string();
        tokio::spawn(async move { run_signer(st, n).await });
    }
    json_response(200, &approved.1)
}

/// A bookmark's object for a CSR watch: `spec.request` is null (fixture
/// `csr_watch_timeout_bookmark`).
pub(super) fn bookmark_fields(m: &mut Map<String, Value>) {
    m.insert("spec".into(), json!({"request": null, "signerName": ""}));
    m.insert("status".into(), json!({}));
}

/// The apiserver's `tls.RequestClientCert`: a client certificate is asked for and taken as
/// sent (its handshake signature still checked); the x509 authenticator judges it per request,
/// so an expired or foreign one gets a 401 answer rather than a failed handshake.
#[derive(Debug)]
pub(super) struct RequestClientCert(pub Arc<dyn rustls::server::danger::ClientCertVerifier>);

impl rustls::server::danger::ClientCertVerifier for RequestClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        Ok(rustls::server::danger::ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

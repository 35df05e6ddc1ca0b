//! Liveness and readiness probes, as the kubelet runs them: `exec` (CRI ExecSync), `httpGet`
//! and `tcpSocket`, with initialDelaySeconds, periodSeconds, timeoutSeconds and the success and
//! failure thresholds.
//!
//! [`ProbeState::record`] is the pure part (thresholds, verdicts); [`run`] does the I/O. The
//! runtime owns one [`ContainerProbes`] per container, and [`track`] replaces it when the
//! container is replaced, so a new container starts over: not ready, with a fresh initial
//! delay.

use super::desired::DesiredPod;
use super::observe::Snapshot;
use crate::cri::{api, CriRuntime};
pub use crate::podspec::{ProbeAction, ProbeSpec};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// Which probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProbeKind {
    Liveness,
    Readiness,
}

/// The probes of one running container; replaced when the container is.
#[derive(Debug, Clone)]
pub struct ContainerProbes {
    /// The container these states belong to.
    pub id: String,
    pub liveness: Option<(ProbeSpec, ProbeState)>,
    pub readiness: Option<(ProbeSpec, ProbeState)>,
}

impl ContainerProbes {
    fn slot(&mut self, kind: ProbeKind) -> Option<&mut (ProbeSpec, ProbeState)> {
        match kind {
            ProbeKind::Liveness => self.liveness.as_mut(),
            ProbeKind::Readiness => self.readiness.as_mut(),
        }
    }

    /// The probes due at `now`.
    pub fn due(&self, now: Instant) -> Vec<(ProbeKind, &ProbeSpec)> {
        [
            (ProbeKind::Readiness, &self.readiness),
            (ProbeKind::Liveness, &self.liveness),
        ]
        .into_iter()
        .filter_map(|(k, p)| p.as_ref().map(|(sp, st)| (k, sp, st)))
        .filter(|(_, sp, st)| st.due_at(sp) <= now)
        .map(|(k, sp, _)| (k, sp))
        .collect()
    }

    /// When the next probe is due.
    pub fn next_due(&self) -> Option<Instant> {
        [&self.liveness, &self.readiness]
            .into_iter()
            .flatten()
            .map(|(sp, st)| st.due_at(sp))
            .min()
    }

    /// Why the liveness probe failed, once its failure threshold is reached.
    pub fn liveness_failed(&self) -> Option<String> {
        let (_, st) = self.liveness.as_ref()?;
        (st.verdict == Some(false)).then(|| st.last_error.clone().unwrap_or_default())
    }

    /// Passing its readiness probe (true when it has none).
    pub fn ready(&self) -> bool {
        match &self.readiness {
            None => true,
            Some((_, st)) => st.verdict == Some(true),
        }
    }

    /// Records a result; returns the verdict when it changed.
    pub fn record(
        &mut self,
        kind: ProbeKind,
        at: Instant,
        outcome: Result<(), String>,
    ) -> Option<bool> {
        let (sp, st) = self.slot(kind)?;
        let sp = sp.clone();
        st.record(at, outcome, &sp)
    }
}

/// Keeps one [`ContainerProbes`] per running, probed container of the desired pods: new
/// containers get fresh states (counting their initial delay from `now`), replaced or stopped
/// ones lose theirs.
pub fn track(
    probes: &mut HashMap<(String, String), ContainerProbes>,
    desired: &[DesiredPod],
    snapshot: &Snapshot,
    now: Instant,
) {
    let mut live = HashSet::new();
    for pod in desired {
        let Some(Ok(plan)) = &pod.plan else {
            continue;
        };
        let obs = snapshot.pod(pod.uid());
        let Some(sb) = obs.ready_sandbox() else {
            continue;
        };
        for cp in &plan.containers {
            if cp.liveness.is_none() && cp.readiness.is_none() {
                continue;
            }
            let Some(c) = obs
                .latest(&sb.id, &cp.name)
                .filter(|c| c.state == api::ContainerState::ContainerRunning as i32)
            else {
                continue;
            };
            let key = (pod.uid().to_string(), cp.name.clone());
            live.insert(key.clone());
            let fresh = probes.get(&key).is_none_or(|p| p.id != c.id);
            if fresh {
                probes.insert(
                    key,
                    ContainerProbes {
                        id: c.id.clone(),
                        liveness: cp.liveness.clone().map(|s| (s, ProbeState::new(now))),
                        readiness: cp.readiness.clone().map(|s| (s, ProbeState::new(now))),
                    },
                );
            }
        }
    }
    probes.retain(|k, _| live.contains(k));
}

/// One probe's history for one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeState {
    /// When the container started: the initial delay counts from here.
    pub started: Instant,
    pub last_run: Option<Instant>,
    pub successes: u32,
    pub failures: u32,
    /// The verdict: `None` until the thresholds decide (readiness starts not ready; liveness
    /// starts alive).
    pub verdict: Option<bool>,
    /// The last failure's message, for the Event.
    pub last_error: Option<String>,
}

impl ProbeState {
    pub fn new(started: Instant) -> ProbeState {
        ProbeState {
            started,
            last_run: None,
            successes: 0,
            failures: 0,
            verdict: None,
            last_error: None,
        }
    }

    /// When the probe should run next.
    pub fn due_at(&self, spec: &ProbeSpec) -> Instant {
        match self.last_run {
            None => self.started + spec.initial_delay,
            Some(t) => t + spec.period,
        }
    }

    /// Records one result and returns the verdict when it changed.
    pub fn record(
        &mut self,
        now: Instant,
        outcome: Result<(), String>,
        spec: &ProbeSpec,
    ) -> Option<bool> {
        self.last_run = Some(now);
        match outcome {
            Ok(()) => {
                self.successes = self.successes.saturating_add(1);
                self.failures = 0;
                self.last_error = None;
            }
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                self.successes = 0;
                self.last_error = Some(e);
            }
        }
        let next = if self.successes >= spec.success_threshold.max(1) {
            Some(true)
        } else if self.failures >= spec.failure_threshold.max(1) {
            Some(false)
        } else {
            self.verdict
        };
        if next != self.verdict {
            self.verdict = next;
            next
        } else {
            None
        }
    }
}

/// Runs one probe against a container. `pod_ip` is where httpGet and tcpSocket go when the
/// probe names no host (host-network pods: the node's address).
pub async fn run<R: CriRuntime>(
    cri: &R,
    container_id: &str,
    pod_ip: &str,
    spec: &ProbeSpec,
) -> Result<(), String> {
    match &spec.action {
        ProbeAction::Exec(cmd) => {
            let r = cri
                .exec_sync(container_id, cmd.clone(), spec.timeout)
                .await
                .map_err(|e| format!("exec {cmd:?}: {e}"))?;
            if r.exit_code == 0 {
                Ok(())
            } else {
                let out = String::from_utf8_lossy(&r.stdout);
                let err = String::from_utf8_lossy(&r.stderr);
                Err(format!(
                    "exec {cmd:?} exited {}: {}",
                    r.exit_code,
                    format!("{out}{err}").trim()
                ))
            }
        }
        ProbeAction::TcpSocket { host, port } => {
            let addr = format!("{}:{port}", host.as_deref().unwrap_or(pod_ip));
            match tokio::time::timeout(spec.timeout, tokio::net::TcpStream::connect(&addr)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("dial tcp {addr}: {e}")),
                Err(_) => Err(format!("dial tcp {addr}: timeout")),
            }
        }
        ProbeAction::HttpGet {
            https,
            host,
            port,
            path,
            headers,
        } => {
            let host = host.as_deref().unwrap_or(pod_ip);
            let scheme = if *https { "https" } else { "http" };
            tokio::time::timeout(spec.timeout, http_get(*https, host, *port, path, headers))
                .await
                .unwrap_or_else(|_| {
                    Err(format!(
                        "Get \"{scheme}://{host}:{port}{path}\": timeout after {:?}",
                        spec.timeout
                    ))
                })
        }
    }
}

/// Accepts any server certificate. The kubelet's HTTPS probes do not verify either: they
/// check a pod's own endpoint, which usually has a self-signed certificate. Signatures are
/// still checked, so the handshake is a real one.
#[derive(Debug)]
struct AnyCertificate(std::sync::Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn probe_tls() -> Result<tokio_rustls::TlsConnector, rustls::Error> {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg)))
}

/// Sends one GET over an established connection; 2xx and 3xx are success, as the kubelet's
/// HTTP prober counts them.
async fn get_over<S>(
    io: S,
    authority: &str,
    path: &str,
    headers: &[(String, String)],
) -> Result<u16, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::Empty;
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    let driver = tokio::spawn(conn);
    let mut req = hyper::Request::get(if path.is_empty() { "/" } else { path })
        .header(hyper::header::HOST, authority)
        .header(hyper::header::USER_AGENT, "kube-probe/edgehub")
        .header(hyper::header::ACCEPT, "*/*");
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = req
        .body(Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string());
    driver.abort();
    Ok(resp?.status().as_u16())
}

async fn http_get(
    https: bool,
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> Result<(), String> {
    let scheme = if https { "https" } else { "http" };
    let url = format!("{scheme}://{host}:{port}{path}");
    let fail = |e: &dyn std::fmt::Display| format!("Get \"{url}\": {e}");
    let authority = format!("{host}:{port}");
    let stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| fail(&e))?;
    let code = if https {
        let name =
            rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| fail(&e))?;
        let tls = probe_tls()
            .map_err(|e| fail(&e))?
            .connect(name, stream)
            .await
            .map_err(|e| fail(&e))?;
        get_over(tls, &authority, path, headers).await
    } else {
        get_over(stream, &authority, path, headers).await
    }
    .map_err(|e| fail(&e))?;
    if (200..400).contains(&code) {
        Ok(())
    } else {
        Err(format!("HTTP probe failed with statuscode: {code}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn spec(success: u32, failure: u32) -> ProbeSpec {
        ProbeSpec {
            action: ProbeAction::Exec(vec!["true".into()]),
            initial_delay: Duration::from_secs(5),
            period: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            success_threshold: success,
            failure_threshold: failure,
        }
    }

    #[test]
    fn thresholds_decide_and_only_changes_are_reported() {
        let t0 = Instant::now();
        let sp = spec(2, 3);
        let mut st = ProbeState::new(t0);
        assert_eq!(st.due_at(&sp), t0 + Duration::from_secs(5));
        assert_eq!(st.record(t0, Ok(()), &sp), None, "one success of two");
        assert_eq!(st.due_at(&sp), t0 + Duration::from_secs(2));
        assert_eq!(st.record(t0, Ok(()), &sp), Some(true));
        assert_eq!(st.record(t0, Ok(()), &sp), None, "still true: no change");
        assert_eq!(st.record(t0, Err("x".into()), &sp), None);
        assert_eq!(st.record(t0, Err("y".into()), &sp), None);
        assert_eq!(st.verdict, Some(true), "two failures of three");
        assert_eq!(st.record(t0, Err("z".into()), &sp), Some(false));
        assert_eq!(st.last_error.as_deref(), Some("z"));
        assert_eq!(
            st.record(t0, Ok(()), &sp),
            None,
            "one success is not enough"
        );
        assert_eq!(st.record(t0, Ok(()), &sp), Some(true));
    }

    #[test]
    fn zero_thresholds_count_as_one() {
        let mut st = ProbeState::new(Instant::now());
        let sp = spec(0, 0);
        assert_eq!(st.record(Instant::now(), Err("e".into()), &sp), Some(false));
        assert_eq!(st.record(Instant::now(), Ok(()), &sp), Some(true));
    }

    #[tokio::test]
    async fn tcp_and_http_probes_against_real_sockets() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let cri = crate::cri::fake::FakeCri::default();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 2048];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    let req = String::from_utf8_lossy(&buf[..n]).to_string();
                    let code = if req.starts_with("GET /healthz ") && req.contains("x-probe: yes") {
                        "200 OK"
                    } else if req.starts_with("GET /moved ") {
                        "302 Found"
                    } else {
                        "503 Service Unavailable"
                    };
                    let _ = s
                        .write_all(
                            format!("HTTP/1.1 {code}\r\ncontent-length: 0\r\n\r\n").as_bytes(),
                        )
                        .await;
                });
            }
        });
        let mk = |action| ProbeSpec {
            action,
            ..spec(1, 1)
        };
        let http = |path: &str, headers: Vec<(String, String)>| {
            mk(ProbeAction::HttpGet {
                https: false,
                host: None,
                port,
                path: path.into(),
                headers,
            })
        };
        let hdr = vec![("x-probe".to_string(), "yes".to_string())];
        assert_eq!(
            run(&cri, "c", "127.0.0.1", &http("/healthz", hdr)).await,
            Ok(())
        );
        assert_eq!(
            run(&cri, "c", "127.0.0.1", &http("/moved", vec![])).await,
            Ok(())
        );
        let e = run(&cri, "c", "127.0.0.1", &http("/healthz", vec![]))
            .await
            .unwrap_err();
        assert_eq!(e, "HTTP probe failed with statuscode: 503");
        let tcp = mk(ProbeAction::TcpSocket { host: None, port });
        assert_eq!(run(&cri, "c", "127.0.0.1", &tcp).await, Ok(()));

        // Nothing listening: a failure that says where it dialled.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = free.local_addr().unwrap().port();
        drop(free);
        let e = run(
            &cri,
            "c",
            "127.0.0.1",
            &mk(ProbeAction::TcpSocket {
                host: None,
                port: dead,
            }),
        )
        .await
        .unwrap_err();
        assert!(e.starts_with(&format!("dial tcp 127.0.0.1:{dead}")), "{e}");
    }
}

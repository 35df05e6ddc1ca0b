//! `metrics.k8s.io/v1beta1` as metrics-server serves it through the aggregator: it scrapes
//! each Node's kubelet at `/metrics/resource` (over the apiserver's kubelet client here),
//! takes CPU as the rate of the cumulative counters between two scrapes (the window is the
//! time between their timestamps) and memory as the working set. NodeMetrics and PodMetrics
//! carry the object's name, namespace and labels, `timestamp`, `window` and `usage`
//! (`cpu` in nanocores, `memory` in bytes, as Kubernetes quantities).

use super::discovery::METRICS_GROUP_VERSION;
use super::kubelet::{kubelet_addr, KubeletAddr};
use super::*;

/// One reading of a cumulative CPU counter and a memory gauge.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Point {
    pub cpu_secs: f64,
    pub cpu_ms: i64,
    pub memory: f64,
}

/// One scrape of a kubelet's `/metrics/resource`.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Scrape {
    pub node: Option<Point>,
    /// (namespace, pod, container) -> point.
    pub containers: BTreeMap<(String, String, String), Point>,
}

fn labels(s: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for pair in s.split("\",") {
        if let Some((k, v)) = pair.split_once("=\"") {
            out.insert(
                k.trim().to_string(),
                v.trim_end_matches('"')
                    .replace("\\\"", "\"")
                    .replace("\\\\", "\\"),
            );
        }
    }
    out
}

/// Parses the Prometheus text metrics-server reads.
pub(super) fn parse_scrape(text: &str) -> Scrape {
    let mut s = Scrape::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, rest) = match line.find('{') {
            Some(i) => match line[i..].find("} ") {
                Some(j) => (&line[..i + j + 1], &line[i + j + 2..]),
                None => continue,
            },
            None => match line.split_once(' ') {
                Some(x) => x,
                None => continue,
            },
        };
        let mut nums = rest.split_whitespace();
        let (Some(Ok(v)), Some(Ok(ts))) = (
            nums.next().map(str::parse::<f64>),
            nums.next().map(str::parse::<i64>),
        ) else {
            continue;
        };
        let (name, lbl) = match series.split_once('{') {
            Some((n, l)) => (n, labels(l.trim_end_matches('}'))),
            None => (series, HashMap::new()),
        };
        let point = match name {
            "node_cpu_usage_seconds_total" | "node_memory_working_set_bytes" => {
                s.node.get_or_insert_with(Point::default)
            }
            "container_cpu_usage_seconds_total" | "container_memory_working_set_bytes" => {
                let key = |k: &str| lbl.get(k).cloned().unwrap_or_default();
                s.containers
                    .entry((key("namespace"), key("pod"), key("container")))
                    .or_default()
            }
            _ => continue,
        };
        if name.ends_with("_cpu_usage_seconds_total") {
            point.cpu_secs = v;
            point.cpu_ms = ts;
        } else {
            point.memory = v;
        }
    }
    s
}

/// CPU usage in nanocores between two readings, and the window in ms; None when the later
/// one is not later (metrics-server skips such a point).
pub(super) fn rate(prev: &Point, now: &Point) -> Option<(u64, i64)> {
    let window = now.cpu_ms - prev.cpu_ms;
    if window <= 0 || now.cpu_secs < prev.cpu_secs {
        return None;
    }
    let nanocores = (now.cpu_secs - prev.cpu_secs) * 1e9 / (window as f64 / 1000.0);
    Some((nanocores.round() as u64, window))
}

/// A CPU quantity from nanocores in canonical form: `329087452n`, `12u`, `250m`, `2`.
pub(super) fn cpu_quantity(nanocores: u64) -> String {
    if nanocores == 0 {
        return "0".into();
    }
    let mut v = nanocores;
    for suffix in ["n", "u", "m"] {
        if !v.is_multiple_of(1000) {
            return format!("{v}{suffix}");
        }
        v /= 1000;
    }
    v.to_string()
}

/// A memory quantity from bytes as a BinarySI quantity: `2748180Ki`, or plain bytes.
pub(super) fn memory_quantity(bytes: u64) -> String {
    if bytes == 0 {
        return "0".into();
    }
    let mut v = bytes;
    let mut suffix = "";
    for s in ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"] {
        if !v.is_multiple_of(1024) {
            break;
        }
        v /= 1024;
        suffix = s;
    }
    format!("{v}{suffix}")
}

/// A duration as Go's `time.Duration.String` for whole milliseconds: `1.002s`, `15s`, `500ms`.
pub(super) fn go_duration(ms: i64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = ms / 1000;
    let frac = ms % 1000;
    let (m, s) = (secs / 60, secs % 60);
    let body = if frac == 0 {
        format!("{s}")
    } else {
        format!("{s}.{}", format!("{frac:03}").trim_end_matches('0'))
    };
    if m == 0 {
        format!("{body}s")
    } else {
        format!("{m}m{body}s")
    }
}

/// metrics-server's resolution, shortened for tests: an answer comes from the two latest
/// scrapes until they are this old, and a new scrape is taken at least this long after the
/// one before it (a shorter window shows a counter that has not moved yet).
const RESOLUTION: Duration = Duration::from_millis(1100);

/// The two latest scrapes per node and when the later was taken, as metrics-server keeps
/// them.
#[derive(Default)]
pub(super) struct Scrapes {
    pairs: HashMap<String, (Scrape, Scrape, std::time::Instant)>,
}

async fn scrape_once(state: &State, to: &KubeletAddr) -> Option<Scrape> {
    let req = Request::builder()
        .uri("/metrics/resource")
        .header("host", to.host_port())
        .body(http_body_util::Empty::<Bytes>::new())
        .ok()?;
    let resp = state.kubelet.send(to, req).await.ok()?;
    if resp.status() != StatusCode::OK {
        return None;
    }
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some(parse_scrape(&String::from_utf8_lossy(&body)))
}

/// The two latest scrapes of `node`: the stored ones while fresh, else the later of them
/// and a new one, else (the first time) two new ones a resolution apart.
async fn two_scrapes(state: &State, node: &str, to: &KubeletAddr) -> Option<(Scrape, Scrape)> {
    let stored = lock(&state.metrics).pairs.get(node).cloned();
    if let Some((a, b, at)) = &stored {
        if at.elapsed() < RESOLUTION {
            return Some((a.clone(), b.clone()));
        }
    }
    let first = match stored {
        Some((_, b, _)) => b,
        None => {
            let first = scrape_once(state, to).await?;
            tokio::time::sleep(RESOLUTION).await;
            first
        }
    };
    let now = scrape_once(state, to).await?;
    lock(&state.metrics).pairs.insert(
        node.to_string(),
        (first.clone(), now.clone(), std::time::Instant::now()),
    );
    Some((first, now))
}

fn meta(obj: &Value, now: &str) -> Value {
    let mut m = Map::new();
    for k in ["name", "namespace"] {
        if let Some(v) = obj["metadata"].get(k) {
            m.insert(k.into(), v.clone());
        }
    }
    m.insert("creationTimestamp".into(), now.into());
    if let Some(l) = obj["metadata"].get("labels") {
        m.insert("labels".into(), l.clone());
    }
    Value::Object(m)
}

fn usage(nanocores: u64, memory: f64) -> Value {
    json!({"cpu": cpu_quantity(nanocores), "memory": memory_quantity(memory.max(0.0) as u64)})
}

fn timestamp(ms: i64) -> String {
    rfc3339(ms / 1000)
}

/// The metrics of every Node whose kubelet answers: (NodeMetrics items, PodMetrics items).
async fn collect(state: &State, only_node: Option<&str>) -> (Vec<Value>, Vec<Value>) {
    let nodes: Vec<Value> = lock(&state.db)
        .objects
        .iter()
        .filter(|((p, _, n), _)| p == "nodes" && only_node.is_none_or(|o| o == n))
        .map(|(_, v)| v.clone())
        .collect();
    let now = now_rfc3339();
    let (mut node_items, mut pod_items) = (Vec::new(), Vec::new());
    for node in nodes {
        let name = node["metadata"]["name"].as_str().unwrap_or("").to_string();
        let Some(to) = kubelet_addr(&node) else {
            continue;
        };
        let Some((prev, cur)) = two_scrapes(state, &name, &to).await else {
            continue;
        };
        if let (Some(a), Some(b)) = (prev.node, cur.node) {
            if let Some((cpu, window)) = rate(&a, &b) {
                let mut item = json!({"metadata": meta(&node, &now), "timestamp": timestamp(b.cpu_ms),
                    "window": go_duration(window), "usage": usage(cpu, b.memory)});
                item["kind"] = "NodeMetrics".into();
                item["apiVersion"] = METRICS_GROUP_VERSION.into();
                node_items.push(item);
            }
        }
        // Per pod: its containers' rates; a pod the apiserver does not know is left out.
        let mut pods: BTreeMap<(String, String), Vec<Value>> = BTreeMap::new();
        let mut windows: BTreeMap<(String, String), (i64, i64)> = BTreeMap::new();
        for ((ns, pod, c), b) in &cur.containers {
            let Some(a) = prev.containers.get(&(ns.clone(), pod.clone(), c.clone())) else {
                continue;
            };
            let Some((cpu, window)) = rate(a, b) else {
                continue;
            };
            pods.entry((ns.clone(), pod.clone()))
                .or_default()
                .push(json!({"name": c, "usage": usage(cpu, b.memory)}));
            windows.insert((ns.clone(), pod.clone()), (b.cpu_ms, window));
        }
        for ((ns, pod), containers) in pods {
            let Some(obj) = lock(&state.db)
                .objects
                .get(&("pods".to_string(), ns.clone(), pod.clone()))
                .cloned()
            else {
                continue;
            };
            let (ts, window) = windows.get(&(ns, pod)).copied().unwrap_or_default();
            pod_items.push(
                json!({"kind": "PodMetrics", "apiVersion": METRICS_GROUP_VERSION,
                "metadata": meta(&obj, &now), "timestamp": timestamp(ts),
                "window": go_duration(window), "containers": containers}),
            );
        }
    }
    (node_items, pod_items)
}

const NODE_METRICS: ResourceType = ResourceType {
    group: "metrics.k8s.io",
    version: "v1beta1",
    plural: "nodes",
    kind: "NodeMetrics",
    namespaced: false,
};

const POD_METRICS: ResourceType = ResourceType {
    group: "metrics.k8s.io",
    version: "v1beta1",
    plural: "pods",
    kind: "PodMetrics",
    namespaced: true,
};

fn list(kind: &str, items: Vec<Value>) -> Response<Body> {
    json_response(
        200,
        &json!({"kind": kind, "apiVersion": METRICS_GROUP_VERSION, "metadata": {}, "items": items}),
    )
}

/// Serves `/apis/metrics.k8s.io/v1beta1/...`, if `path` is under it.
pub(super) async fn serve(
    state: &State,
    caller: &csr::Caller,
    method: &Method,
    path: &str,
) -> Option<Response<Body>> {
    let rest = path.strip_prefix("/apis/metrics.k8s.io/v1beta1/")?;
    let segs: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    let (rt, ns, name): (&'static ResourceType, Option<&str>, Option<&str>) = match segs.as_slice()
    {
        ["nodes"] => (&NODE_METRICS, None, None),
        ["nodes", n] => (&NODE_METRICS, None, Some(*n)),
        ["pods"] => (&POD_METRICS, None, None),
        ["namespaces", ns, "pods"] => (&POD_METRICS, Some(*ns), None),
        ["namespaces", ns, "pods", n] => (&POD_METRICS, Some(*ns), Some(*n)),
        _ => {
            return Some(status(
                404,
                "NotFound",
                "the server could not find the requested resource",
                None,
            ))
        }
    };
    let route = Route {
        rt,
        namespace: ns.map(str::to_string),
        name: name.map(str::to_string),
        sub: None,
    };
    let verb = if name.is_some() { "get" } else { "list" };
    if method != Method::GET {
        return Some(status(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
            None,
        ));
    }
    let admin = caller.groups.iter().any(|g| g == "system:masters")
        || (node_of(&caller.user).is_none() && lock(&state.proxy_users).contains(&caller.user));
    if !admin {
        return Some(forbidden(&caller.user, verb, &route, ""));
    }
    let only_node = if rt.plural == "nodes" { name } else { None };
    let (nodes, pods) = collect(state, only_node).await;
    Some(match (rt.plural, name) {
        ("nodes", None) => list("NodeMetricsList", nodes),
        ("nodes", Some(n)) => match nodes.into_iter().find(|i| i["metadata"]["name"] == n) {
            Some(i) => json_response(200, &i),
            None => not_found(rt, n),
        },
        (_, None) => list(
            "PodMetricsList",
            pods.into_iter()
                .filter(|p| ns.is_none_or(|ns| p["metadata"]["namespace"] == ns))
                .collect(),
        ),
        (_, Some(n)) => match pods.into_iter().find(|p| {
            p["metadata"]["name"] == n && ns.is_none_or(|ns| p["metadata"]["namespace"] == ns)
        }) {
            Some(i) => json_response(200, &i),
            None => not_found(rt, n),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_as_kubernetes_prints_them() {
        assert_eq!(cpu_quantity(329_087_452), "329087452n");
        assert_eq!(cpu_quantity(12_000), "12u");
        assert_eq!(cpu_quantity(250_000_000), "250m");
        assert_eq!(cpu_quantity(2_000_000_000), "2");
        assert_eq!(cpu_quantity(0), "0");
        assert_eq!(memory_quantity(2_814_136_320), "2748180Ki");
        assert_eq!(memory_quantity(1 << 30), "1Gi");
        assert_eq!(memory_quantity(1000), "1000");
        assert_eq!(go_duration(20_064), "20.064s");
        assert_eq!(go_duration(15_000), "15s");
        assert_eq!(go_duration(1_100), "1.1s");
        assert_eq!(go_duration(61_500), "1m1.5s");
    }

    #[test]
    fn a_scrape_and_a_rate() {
        let a = parse_scrape(
            "# TYPE x counter\ncontainer_cpu_usage_seconds_total{container=\"app\",namespace=\"ns\",pod=\"p\"} 1.5 1000\n\
             container_memory_working_set_bytes{container=\"app\",namespace=\"ns\",pod=\"p\"} 4096 1000\n\
             node_cpu_usage_seconds_total 10 1000\nnode_memory_working_set_bytes 1048576 1000\nscrape_error 0\n",
        );
        let b = parse_scrape(
            "container_cpu_usage_seconds_total{container=\"app\",namespace=\"ns\",pod=\"p\"} 1.75 2000\n\
             node_cpu_usage_seconds_total 11 3000\n",
        );
        let key = ("ns".to_string(), "p".to_string(), "app".to_string());
        assert_eq!(a.containers[&key].memory, 4096.0);
        assert_eq!(
            rate(&a.containers[&key], &b.containers[&key]),
            Some((250_000_000, 1000))
        );
        assert_eq!(
            rate(&a.node.unwrap(), &b.node.unwrap()),
            Some((500_000_000, 2000))
        );
        assert_eq!(rate(&b.node.unwrap(), &a.node.unwrap()), None);
    }
}

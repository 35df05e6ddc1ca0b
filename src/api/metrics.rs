//! Request counters for `/metrics`, in Prometheus text format. Route names are a closed set, so
//! label cardinality stays small.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
}

impl Metrics {
    pub fn count(&self, route: &'static str, code: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((route, code)).or_insert(0) += 1;
    }

    /// Appends the request counters.
    pub fn render_requests(&self, out: &mut String) {
        let m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        out.push_str(
            "# HELP edgehub_api_requests_total Local API requests by route and status code.\n",
        );
        out.push_str("# TYPE edgehub_api_requests_total counter\n");
        for ((route, code), n) in m.iter() {
            let _ = writeln!(
                out,
                "edgehub_api_requests_total{{route=\"{route}\",code=\"{code}\"}} {n}"
            );
        }
    }
}

/// Appends one gauge or counter family.
pub fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, u64)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, v) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {v}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    }
}

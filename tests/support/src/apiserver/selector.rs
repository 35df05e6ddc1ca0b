//! Label and field selectors, as the apiserver parses and applies them.

use super::*;

/// A parsed selector: conjunction of requirements.
#[derive(Debug, Clone, Default)]
pub(super) struct Selector(pub(super) Vec<Req>);

#[derive(Debug, Clone)]
pub(super) enum Req {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

pub(super) fn split_top(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0);
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

pub(super) fn parse_selector(s: &str) -> Result<Selector, String> {
    let mut reqs = Vec::new();
    for part in split_top(s) {
        let set = |p: &str, op: &str| -> Option<(String, Vec<String>)> {
            let (k, rest) = p.split_once(op)?;
            let vals = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
            Some((
                k.trim().to_string(),
                vals.split(',').map(|v| v.trim().to_string()).collect(),
            ))
        };
        let r = if let Some((k, v)) = part.split_once("!=") {
            Req::Ne(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once("==") {
            Req::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once('=') {
            Req::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, vs)) = set(&part, " notin ") {
            Req::NotIn(k, vs)
        } else if let Some((k, vs)) = set(&part, " in ") {
            Req::In(k, vs)
        } else if let Some(k) = part.strip_prefix('!') {
            Req::NotExists(k.trim().into())
        } else if part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._/".contains(c))
        {
            Req::Exists(part)
        } else {
            return Err(format!("unable to parse requirement: {part:?}"));
        };
        reqs.push(r);
    }
    Ok(Selector(reqs))
}

impl Selector {
    pub(super) fn matches(&self, get: impl Fn(&str) -> Option<String>) -> bool {
        self.0.iter().all(|r| match r {
            Req::Eq(k, v) => get(k).as_deref() == Some(v.as_str()),
            Req::Ne(k, v) => get(k).as_deref() != Some(v.as_str()),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Req::NotIn(k, vs) => get(k).is_none_or(|x| !vs.contains(&x)),
        })
    }
}

pub(super) const FIELDS: &[(&str, &str)] = &[
    ("metadata.name", "/metadata/name"),
    ("metadata.namespace", "/metadata/namespace"),
    ("spec.nodeName", "/spec/nodeName"),
    // CertificateSigningRequests' own selectable field (kubectl get csr --field-selector
    // spec.signerName=...), as the attested approver watches them.
    ("spec.signerName", "/spec/signerName"),
];

pub(super) struct Filter {
    pub(super) namespace: Option<String>,
    pub(super) fields: Selector,
    pub(super) labels: Selector,
}

impl Filter {
    pub(super) fn from_query(
        namespace: Option<String>,
        rt: &ResourceType,
        q: &BTreeMap<String, String>,
    ) -> Result<Filter, Reject> {
        let bad = |m: String| Box::new(status(400, "BadRequest", &m, None));
        let fields = parse_selector(q.get("fieldSelector").map(String::as_str).unwrap_or(""))
            .map_err(bad)?;
        for r in &fields.0 {
            let (Req::Eq(k, _) | Req::Ne(k, _)) = r else {
                return Err(bad("field selectors support only =, == and !=".into()));
            };
            if !FIELDS.iter().any(|(f, _)| f == k)
                || (k == "spec.nodeName" && rt.plural != "pods")
                || (k == "spec.signerName" && rt.plural != "certificatesigningrequests")
            {
                return Err(bad(format!("field label not supported: {k}")));
            }
        }
        let labels = parse_selector(q.get("labelSelector").map(String::as_str).unwrap_or(""))
            .map_err(bad)?;
        Ok(Filter {
            namespace,
            fields,
            labels,
        })
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace {
            if obj.pointer("/metadata/namespace").and_then(Value::as_str) != Some(ns) {
                return false;
            }
        }
        self.fields.matches(|k| {
            let p = FIELDS.iter().find(|(f, _)| *f == k)?.1;
            Some(
                obj.pointer(p)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            )
        }) && self.labels.matches(|k| {
            obj.pointer("/metadata/labels")
                .and_then(|l| l.get(k))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
    }
}

pub(super) fn strip_type(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Value::Object(m) = &mut o {
        // shift_remove keeps the apiserver's field order (remove would swap fields).
        m.shift_remove("kind");
        m.shift_remove("apiVersion");
    }
    o
}

//! Checks shared by the config and by the commands that take the same values.

/// Checks a `tracing` filter before it is used. `EnvFilter` reads any bare word as a target
/// to enable, so a mistyped level (`warning`, `verbose`), a level with a space (`"info "`) or
/// an empty filter parses, matches nothing edgehub logs, and silences every line, errors
/// included. A directive here is a level (`info`, `warn`, ...), or `TARGET=LEVEL`.
pub fn check_log_filter(filter: &str) -> Result<(), String> {
    use std::str::FromStr;
    use tracing_subscriber::filter::LevelFilter;
    const HINT: &str = "use a level (error, warn, info, debug, trace, off) or TARGET=LEVEL directives, e.g. \"info,edgehub::sync=debug\"";
    if filter.trim().is_empty() {
        return Err(format!(
            "the log filter is empty, which would silence every line, errors included; {HINT}"
        ));
    }
    let level = |l: &str| !l.is_empty() && LevelFilter::from_str(l).is_ok();
    for d in filter.split(',') {
        if d.is_empty() {
            return Err(format!("{filter:?} has an empty directive; {HINT}"));
        }
        if d.trim() != d {
            return Err(format!(
                "{filter:?}: directive {d:?} has spaces around it, and would match nothing; {HINT}"
            ));
        }
        match d.rsplit_once('=') {
            Some((target, l)) => {
                if target.is_empty() || !level(l) {
                    return Err(format!(
                        "{filter:?}: directive {d:?} is not TARGET=LEVEL; {HINT}"
                    ));
                }
            }
            None if level(d) => {}
            None => {
                return Err(format!(
                    "{filter:?}: {d:?} is not a log level (it would be read as a target and \
                     silence everything else, errors included); {HINT}"
                ))
            }
        }
    }
    log_filter_unchecked(filter).map(|_| ())
}

/// The filter for `tracing_subscriber`, after [`check_log_filter`]. It is a `Targets`
/// filter, not an `EnvFilter`: the syntax accepted above (levels and `TARGET=LEVEL`) is
/// exactly what `Targets` reads, and `EnvFilter` brings a regex engine (regex-automata,
/// for span and field filters nobody can write here) that cost the aarch64 binary more than
/// the headroom left under its 6 MB budget.
pub fn log_filter(filter: &str) -> Result<tracing_subscriber::filter::Targets, String> {
    check_log_filter(filter)?;
    log_filter_unchecked(filter)
}

fn log_filter_unchecked(filter: &str) -> Result<tracing_subscriber::filter::Targets, String> {
    filter
        .parse()
        .map_err(|e| format!("{filter:?} is not a valid log filter: {e}"))
}

/// A label key: optional DNS-subdomain prefix, then a name of at most 63 characters.
pub(super) fn check_label_key(k: &str) -> Result<(), String> {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    if let Some(p) = prefix {
        crate::names::check_subdomain(p).map_err(|r| format!("prefix {r}"))?;
    }
    check_label_value(name)?;
    if name.is_empty() {
        return Err("name must not be empty".into());
    }
    Ok(())
}

/// A label value: at most 63 characters of alphanumerics, '-', '_' and '.', alphanumeric at
/// both ends.
pub(super) fn check_label_value(v: &str) -> Result<(), String> {
    if v.len() > 63 {
        return Err(format!("must be at most 63 characters (got {})", v.len()));
    }
    if !v
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err("only letters, digits, '-', '_' and '.' are allowed".into());
    }
    let alnum = |c: Option<char>| c.is_none_or(|c| c.is_ascii_alphanumeric());
    if !(alnum(v.chars().next()) && alnum(v.chars().last())) {
        return Err("must start and end with a letter or digit".into());
    }
    Ok(())
}

/// What NodeRestriction lets a node set on itself: labels outside the kubernetes.io and k8s.io
/// namespaces, plus the kubelet's own ones. `node-role.kubernetes.io/*` is refused here, before
/// any request, with the reason.
pub fn check_node_label(k: &str, v: &str) -> Result<(), String> {
    check_label_key(k)?;
    check_label_value(v)?;
    let prefix = k.rsplit_once('/').map(|(p, _)| p).unwrap_or("");
    if prefix == "node-role.kubernetes.io" {
        return Err("NodeRestriction forbids a node to set node-role.kubernetes.io/* labels on itself; an administrator sets roles with kubectl label".into());
    }
    let restricted = prefix == "kubernetes.io"
        || prefix.ends_with(".kubernetes.io")
        || prefix == "k8s.io"
        || prefix.ends_with(".k8s.io");
    let allowed_prefix = ["kubelet.kubernetes.io", "node.kubernetes.io"]
        .iter()
        .any(|a| prefix == *a || prefix.ends_with(&format!(".{a}")));
    const WELL_KNOWN: &[&str] = &[
        "kubernetes.io/hostname",
        "kubernetes.io/arch",
        "kubernetes.io/os",
        "beta.kubernetes.io/arch",
        "beta.kubernetes.io/os",
        "beta.kubernetes.io/instance-type",
        "failure-domain.beta.kubernetes.io/region",
        "failure-domain.beta.kubernetes.io/zone",
        "topology.kubernetes.io/region",
        "topology.kubernetes.io/zone",
    ];
    if restricted && !allowed_prefix && !WELL_KNOWN.contains(&k) {
        return Err(format!(
            "NodeRestriction forbids a node to set labels in {prefix} other than the kubelet's well-known ones"
        ));
    }
    Ok(())
}

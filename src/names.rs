//! Kubernetes name rules (DNS-1123), shared by config validation and the local API.

/// A DNS-1123 label: at most 63 characters of `[a-z0-9-]`, starting and ending alphanumeric.
/// Namespaces are labels.
pub fn check_label(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > 63 {
        return Err(format!("must be at most 63 characters (got {})", s.len()));
    }
    check_chars(s, false)
}

/// A DNS-1123 subdomain: at most 253 characters of dot-separated labels. Pod and node names
/// are subdomains.
pub fn check_subdomain(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > 253 {
        return Err(format!("must be at most 253 characters (got {})", s.len()));
    }
    check_chars(s, true)
}

/// A pod uid, which names the pod's directory under the data dir (its volumes, Secrets,
/// tokens and logs) and is removed with it: the apiserver makes uids (UUIDs), but the cache
/// takes what it is sent, and `..` or `a/b` would put a pod's files, and its cleanup's
/// `remove_dir_all`, outside its directory. At most 128 characters of letters, digits,
/// '-', '_' and '.', not starting with '.'.
pub fn check_uid(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > 128 {
        return Err(format!("must be at most 128 characters (got {})", s.len()));
    }
    if let Some((i, c)) = s
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || "-_.".contains(*c)))
    {
        return Err(format!(
            "invalid character {c:?} at {i}: only letters, digits, '-', '_' and '.' are allowed"
        ));
    }
    if s.starts_with('.') {
        return Err("must not start with '.'".into());
    }
    Ok(())
}

fn check_chars(s: &str, dots: bool) -> Result<(), String> {
    let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    for (i, c) in s.chars().enumerate() {
        if !(ok(c) || c == '-' || (dots && c == '.')) {
            return Err(format!(
                "invalid character {c:?} at {i}: only lowercase letters, digits, '-'{} are allowed",
                if dots { " and '.'" } else { "" }
            ));
        }
    }
    let parts: Vec<&str> = if dots {
        s.split('.').collect()
    } else {
        vec![s]
    };
    for p in parts {
        let first = p.chars().next();
        let last = p.chars().last();
        if !(first.is_some_and(ok) && last.is_some_and(ok)) {
            return Err("must start and end with a lowercase letter or digit".into());
        }
    }
    Ok(())
}

/// The name of a container attempt's log file in its pod's log dir: `<container>_<attempt>.log`.
/// The name must be a DNS-1123 label (as the apiserver validates container names), so the
/// file stays in that directory and [`parse_file_name`] reads it back.
pub fn log_file_name(container: &str, attempt: u32) -> Result<String, String> {
    check_label(container)
        .map_err(|r| format!("container name {container:?} cannot name a log file: {r}"))?;
    Ok(format!("{container}_{attempt}.log"))
}

/// `<container>_<attempt>.log` → (container, attempt). Container names are DNS-1123 labels,
/// so the last `_` separates them.
pub fn parse_file_name(name: &str) -> Option<(&str, u32)> {
    let stem = name.strip_suffix(".log")?;
    let (container, attempt) = stem.rsplit_once('_')?;
    if container.is_empty() || attempt.is_empty() || !attempt.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((container, attempt.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        for good in ["a", "vehicle", "kube-system", "a1", &"a".repeat(63)] {
            assert!(check_label(good).is_ok(), "{good}");
        }
        for bad in ["", "A", "-a", "a-", "a.b", "a_b", &"a".repeat(64), "ä"] {
            assert!(check_label(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn uids() {
        for good in [
            "b6a7f3c2-0d5e-4f8a-9c1b-2e3d4f5a6b7c",
            "logs-123",
            "A_b.c",
            &"a".repeat(128),
        ] {
            assert!(check_uid(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            "/",
            ".hidden",
            "a b",
            "a\0b",
            "ä",
            &"a".repeat(129),
        ] {
            assert!(check_uid(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn subdomains() {
        for good in ["edge-1", "a.b.c", "telemetry-sv74m", &"a".repeat(253)] {
            assert!(check_subdomain(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "a..b",
            ".a",
            "a.",
            "Edge",
            "a/b",
            &"a".repeat(254),
            "a.-b",
        ] {
            assert!(check_subdomain(bad).is_err(), "{bad}");
        }
    }
}

//! Image references as containerd's CRI names them: `busybox:1.0` is
//! `docker.io/library/busybox:1.0`, a reference with a digest is `name@digest` (a tag beside
//! a digest is dropped, as `reference.ParseDockerRef` does), and no tag means `latest`.

/// A parsed, normalized image reference.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Reference {
    /// The repository with its registry: `docker.io/library/busybox`.
    pub name: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`.
    pub digest: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an image reference: {reference:?}: {reason}")]
pub struct RefError {
    pub reference: String,
    pub reason: &'static str,
}

/// Whether `d` is `sha256:` and 64 lowercase hex digits.
pub fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference, RefError> {
        let err = |reason| RefError {
            reference: s.to_string(),
            reason,
        };
        if s.is_empty() || s.len() > 1024 || s.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err(err("empty, too long or with spaces"));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if !is_sha256_digest(d) {
                    return Err(err("the digest is not sha256:<64 hex digits>"));
                }
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (repo, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => {
                let at = last_slash + i;
                (&rest[..at], Some(rest[at + 1..].to_string()))
            }
            None => (rest, None),
        };
        if let Some(t) = &tag {
            let ok = !t.is_empty()
                && t.len() <= 128
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !ok {
                return Err(err("the tag has characters a tag may not have"));
            }
        }
        if repo.is_empty() || repo.starts_with('/') || repo.ends_with('/') || repo.contains("//") {
            return Err(err(
                "the repository is empty or has an empty path component",
            ));
        }
        let first = repo.split('/').next().unwrap_or("");
        let has_host = repo.contains('/')
            && (first.contains('.') || first.contains(':') || first == "localhost");
        let path = if has_host {
            &repo[first.len() + 1..]
        } else {
            repo
        };
        if path.bytes().any(|b| b.is_ascii_uppercase())
            || !path.bytes().all(|b| {
                b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'/' | b'.' | b'_' | b'-')
            })
        {
            return Err(err(
                "the repository path must be lowercase letters, digits and ._-/",
            ));
        }
        let name = if has_host {
            repo.to_string()
        } else if repo.contains('/') {
            format!("docker.io/{repo}")
        } else {
            format!("docker.io/library/{repo}")
        };
        let tag = match (&digest, tag) {
            (Some(_), _) => None,
            (None, Some(t)) => Some(t),
            (None, None) => Some("latest".to_string()),
        };
        Ok(Reference { name, tag, digest })
    }

    /// The name containerd's CRI keeps the image under: `name@digest` or `name:tag`.
    pub fn canonical(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => format!("{}@{d}", self.name),
            (None, Some(t)) => format!("{}:{t}", self.name),
            (None, None) => format!("{}:latest", self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn references_normalize_as_the_cri_names_them() {
        for (input, canonical) in [
            ("busybox", "docker.io/library/busybox:latest"),
            ("busybox:1.0", "docker.io/library/busybox:1.0"),
            ("org/app:2", "docker.io/org/app:2"),
            ("127.0.0.1:5000/busybox:2.0", "127.0.0.1:5000/busybox:2.0"),
            ("localhost/app", "localhost/app:latest"),
            ("registry.local:8443/a/b", "registry.local:8443/a/b:latest"),
            ("ghcr.io/o/app:1.2-rc_3", "ghcr.io/o/app:1.2-rc_3"),
        ] {
            assert_eq!(
                Reference::parse(input).unwrap().canonical(),
                canonical,
                "{input}"
            );
        }
        let pinned = Reference::parse(&format!("127.0.0.1:5000/app:2.0@{D}")).unwrap();
        assert_eq!(pinned.canonical(), format!("127.0.0.1:5000/app@{D}"));
        assert_eq!(pinned.digest.as_deref(), Some(D));
        assert_eq!(
            Reference::parse(&format!("app@{D}")).unwrap().canonical(),
            format!("docker.io/library/app@{D}")
        );
    }

    #[test]
    fn bad_references_are_refused() {
        for bad in [
            "",
            "Busybox:1",
            "app@sha256:123",
            "app@md5:0123",
            "a b",
            "app:",
            "app:ta*g",
            "/app",
            "a//b",
            "app:t@g",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(is_sha256_digest(D));
        assert!(!is_sha256_digest(&D.to_uppercase()));
    }
}

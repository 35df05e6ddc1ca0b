//! Which images an archive may put on the node, pure: only what a cached DaemonSet revision
//! names, byte for byte where the template pins a digest.

use super::reference::Reference;

/// What the archive offers for one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// The names the archive gives it, normalized (`docker.io/library/app:1`).
    pub names: Vec<Reference>,
    /// Its digests: the archive's top-level entry (an index or a manifest) and the manifest
    /// chosen for the device.
    pub digests: Vec<String>,
}

/// An image a cached revision names, and which revision that is (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub reference: Reference,
    pub revision: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Name the image with these (canonical) names.
    Accept(Vec<String>),
    Refuse(String),
}

fn describe(offer: &Offer) -> String {
    let names: Vec<String> = offer.names.iter().map(Reference::canonical).collect();
    let digest = offer.digests.last().map(String::as_str).unwrap_or("?");
    if names.is_empty() {
        format!("the archive's image {digest} (it carries no name)")
    } else {
        format!("image {} ({digest})", names.join(", "))
    }
}

/// The verdict on `offer`: the names of every cached revision's image it is (by digest where
/// the template pins one, by name and tag otherwise). Anything else is refused unless `force`,
/// which names it with the archive's own names.
pub fn decide(offer: &Offer, wanted: &[Wanted], force: bool) -> Verdict {
    let mut names: Vec<String> = Vec::new();
    let mut pinned_elsewhere: Vec<&Wanted> = Vec::new();
    for w in wanted {
        let r = &w.reference;
        match &r.digest {
            Some(d) if offer.digests.iter().any(|x| x == d) => names.push(r.canonical()),
            Some(_) if offer.names.iter().any(|n| n.name == r.name) => pinned_elsewhere.push(w),
            Some(_) => {}
            None if offer.names.iter().any(|n| n == r) => names.push(r.canonical()),
            None => {}
        }
    }
    names.sort();
    names.dedup();
    if !names.is_empty() {
        return Verdict::Accept(names);
    }
    if force {
        let mut own: Vec<String> = offer.names.iter().map(Reference::canonical).collect();
        own.sort();
        own.dedup();
        if own.is_empty() {
            return Verdict::Refuse(format!(
                "{} cannot be loaded even with the override: the archive gives it no name \
                 (name it when you make the archive, e.g. skopeo copy ... oci-archive:FILE:REPO:TAG)",
                describe(offer)
            ));
        }
        return Verdict::Accept(own);
    }
    if let Some(w) = pinned_elsewhere.first() {
        return Verdict::Refuse(format!(
            "{} is not the one revision {} pins: it names {}; the archive's manifest must be \
             that digest byte for byte (a docker-archive never is: use an OCI archive)",
            describe(offer),
            w.revision,
            w.reference.canonical()
        ));
    }
    Verdict::Refuse(format!(
        "{} is not named by any cached DaemonSet revision of this node; load it with the \
         override (--force, force=true) to import it anyway",
        describe(offer)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn r(s: &str) -> Reference {
        Reference::parse(s).unwrap()
    }
    fn w(s: &str) -> Wanted {
        Wanted {
            reference: r(s),
            revision: "default/app-abc".into(),
        }
    }
    fn offer(names: &[&str], digests: &[&str]) -> Offer {
        Offer {
            names: names.iter().map(|n| r(n)).collect(),
            digests: digests.iter().map(|d| d.to_string()).collect(),
        }
    }

    #[test]
    fn a_tag_a_revision_names_is_accepted_under_that_name() {
        let v = decide(
            &offer(&["reg.local/app:2"], &[A]),
            &[w("reg.local/app:2"), w("busybox:1")],
            false,
        );
        assert_eq!(v, Verdict::Accept(vec!["reg.local/app:2".into()]));
        let short = decide(
            &offer(&["docker.io/library/busybox:1"], &[A]),
            &[w("busybox:1")],
            false,
        );
        assert_eq!(
            short,
            Verdict::Accept(vec!["docker.io/library/busybox:1".into()])
        );
    }

    #[test]
    fn a_pinned_template_takes_only_its_digest() {
        let pinned = w(&format!("reg.local/app:2@{A}"));
        // By digest, whatever the archive calls it (even nothing).
        assert_eq!(
            decide(&offer(&[], &[B, A]), std::slice::from_ref(&pinned), false),
            Verdict::Accept(vec![format!("reg.local/app@{A}")])
        );
        // Same name, another manifest: refused, saying which digest was pinned.
        let Verdict::Refuse(why) = decide(
            &offer(&["reg.local/app:2"], &[B]),
            std::slice::from_ref(&pinned),
            false,
        ) else {
            panic!("accepted a manifest the template does not pin");
        };
        assert!(
            why.contains(A) && why.contains(B) && why.contains("default/app-abc"),
            "{why}"
        );
    }

    #[test]
    fn anything_else_is_refused_naming_it_unless_forced() {
        let o = offer(&["reg.local/other:9"], &[A]);
        let Verdict::Refuse(why) = decide(&o, &[w("reg.local/app:2")], false) else {
            panic!("accepted an image no revision names");
        };
        assert!(why.contains("reg.local/other:9"), "{why}");
        assert_eq!(
            decide(&o, &[], true),
            Verdict::Accept(vec!["reg.local/other:9".into()])
        );
        assert!(matches!(
            decide(&offer(&[], &[A]), &[], true),
            Verdict::Refuse(_)
        ));
        // The tag must match too.
        assert!(matches!(
            decide(
                &offer(&["reg.local/app:3"], &[A]),
                &[w("reg.local/app:2")],
                false
            ),
            Verdict::Refuse(_)
        ));
    }
}

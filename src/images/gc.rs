//! Image garbage collection, pure: which images on the node may go, and which go now.
//!
//! Two occasions:
//! - **after an upgrade commits**, every image goes that no container uses and that only an
//!   older revision of a cached DaemonSet names: neither its current (update) revision nor
//!   its previous one (kept for a rollback, unless `keep_previous` is off). An image no cached
//!   revision names at all stays: it may be an OTA payload side-loaded ahead of the rollout
//!   that will name it, or another agent's;
//! - **under disk pressure**, as the kubelet's image manager: when the image filesystem is
//!   fuller than `high_percent`, unused images go, oldest first, until it is down to
//!   `low_percent`: first the ones only older revisions name, then the ones nothing names,
//!   then the previous revisions'. The current revisions' (a pre-pulled or side-loaded target),
//!   an active upgrade's (its target and its rollback) and the pinned ones never go, so a full
//!   flash cannot take the image a rollback needs.
//!
//! On both occasions, what a cached pod runs or is about to run (its own revision's images,
//! whether or not a container exists) and the runtime's sandbox image never go.
//!
//! The I/O (the CRI's `ListImages`, `ListContainers`, `ImageFsInfo`, `RemoveImage`, the cached
//! revisions) is in the images module.

use super::reference::Reference;
use std::collections::HashSet;

/// The `[images]` settings of garbage collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcPolicy {
    /// Keep the previous revision's images after an upgrade commits, for a rollback.
    pub keep_previous: bool,
    /// Image filesystem use, in percent, above which unused images are removed (the kubelet's
    /// `imageGCHighThresholdPercent`) and the Node reports `DiskPressure`.
    pub high_percent: u8,
    /// Use, in percent, that removal under pressure goes down to (`imageGCLowThresholdPercent`).
    pub low_percent: u8,
}

impl Default for GcPolicy {
    fn default() -> GcPolicy {
        GcPolicy {
            keep_previous: true,
            high_percent: 85,
            low_percent: 80,
        }
    }
}

/// An image on the node, as the CRI lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeImage {
    /// The image id (`sha256:` of its config).
    pub id: String,
    /// Its `repoTags` and `repoDigests`.
    pub names: Vec<String>,
    pub size: u64,
    /// Pinned by the runtime (the sandbox image): never removed.
    pub pinned: bool,
    /// When edgehub first saw it (the kubelet's `firstDetected`): the age removal goes by.
    pub first_seen_ms: i64,
}

/// Why an image a revision or an upgrade names is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// An older revision of a DaemonSet than its previous one: garbage once unused.
    Old,
    /// The previous revision of a DaemonSet: kept after a commit (if configured), removable
    /// under pressure once nothing else is.
    Previous,
    /// The current (update) revision of a DaemonSet.
    Current,
    /// The target or the rollback image of an upgrade that has not ended.
    Upgrade,
    /// What a cached pod runs, or is about to (its spec as the device runs it, and its own
    /// revision's template), whatever containers exist: the runtime removes a pod's old
    /// containers before it creates the new ones, and its image must be there between the
    /// two, however old its revision.
    Pod,
    /// The runtime's sandbox (pause) image: every pod start needs it, and containerd 1.6
    /// does not pin it.
    Sandbox,
}

/// An image reference a revision or an upgrade names, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub reference: Reference,
    pub role: Role,
    /// `namespace/revision-name`, or the upgrade's pod, for listings and logs.
    pub by: String,
}

/// What may become of one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// A container uses it.
    InUse,
    /// The runtime pins it.
    Pinned,
    /// Named with this role (the strongest that names it) by these.
    Named { role: Role, by: Vec<String> },
    /// Nothing uses or names it.
    Unnamed,
}

impl Fate {
    /// Whether removal after a commit takes it.
    pub fn removable_after_commit(&self, policy: &GcPolicy) -> bool {
        match self {
            Fate::Named {
                role: Role::Old, ..
            } => true,
            Fate::Named {
                role: Role::Previous,
                ..
            } => !policy.keep_previous,
            _ => false,
        }
    }

    /// Whether removal under pressure may take it.
    pub fn removable_under_pressure(&self) -> bool {
        self.pressure_tier().is_some()
    }

    /// The order removal under pressure takes images in (lower first); `None`: never.
    fn pressure_tier(&self) -> Option<u8> {
        match self {
            Fate::Named {
                role: Role::Old, ..
            } => Some(0),
            Fate::Unnamed => Some(1),
            Fate::Named {
                role: Role::Previous,
                ..
            } => Some(2),
            _ => None,
        }
    }
}

/// Whether the CRI image `names` (its tags and digests) are what `r` names: by digest when `r`
/// pins one, by name and tag otherwise.
pub fn names_match(names: &[String], r: &Reference) -> bool {
    names
        .iter()
        .filter_map(|n| Reference::parse(n).ok())
        .any(|n| match &r.digest {
            Some(d) => n.name == r.name && n.digest.as_ref() == Some(d),
            None => n.name == r.name && n.digest.is_none() && n.tag == r.tag,
        })
}

/// The fate of `image`, given the image ids containers use and what is named.
pub fn fate(image: &NodeImage, in_use: &HashSet<String>, named: &[Named]) -> Fate {
    if in_use.contains(&image.id) {
        return Fate::InUse;
    }
    if image.pinned {
        return Fate::Pinned;
    }
    let mut role = None;
    let mut by = Vec::new();
    for n in named
        .iter()
        .filter(|n| names_match(&image.names, &n.reference))
    {
        role = role.max(Some(n.role));
        by.push(n.by.clone());
    }
    by.sort();
    by.dedup();
    match role {
        Some(role) => Fate::Named { role, by },
        None => Fate::Unnamed,
    }
}

/// An image to remove, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removal {
    pub id: String,
    pub names: Vec<String>,
    pub size: u64,
    pub why: &'static str,
}

fn removal(i: &NodeImage, why: &'static str) -> Removal {
    Removal {
        id: i.id.clone(),
        names: i.names.clone(),
        size: i.size,
        why,
    }
}

/// What goes after an upgrade commits.
pub fn after_commit(
    images: &[NodeImage],
    in_use: &HashSet<String>,
    named: &[Named],
    policy: &GcPolicy,
) -> Vec<Removal> {
    images
        .iter()
        .filter(|i| fate(i, in_use, named).removable_after_commit(policy))
        .map(|i| removal(i, "no container uses it and only older revisions name it"))
        .collect()
}

/// The image filesystem's use, as `ImageFsInfo` and the filesystem report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsUse {
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

impl FsUse {
    /// Use in percent, rounded up (so 85.1 % is over an 85 % threshold); 0 for an unknown
    /// capacity.
    pub fn percent(&self) -> u8 {
        if self.capacity_bytes == 0 {
            return 0;
        }
        let p = (u128::from(self.used_bytes) * 100).div_ceil(u128::from(self.capacity_bytes));
        p.min(100) as u8
    }
}

/// Whether the image filesystem is under pressure: fuller than the high threshold.
pub fn under_pressure(fs: &FsUse, policy: &GcPolicy) -> bool {
    fs.percent() > policy.high_percent
}

/// What goes under pressure: nothing unless the filesystem is over the high threshold, then
/// unused images in tier order (older revisions', unnamed, previous revisions'), oldest first,
/// until the
/// bytes freed bring it to the low threshold or nothing removable is left.
pub fn under_pressure_removals(
    images: &[NodeImage],
    in_use: &HashSet<String>,
    named: &[Named],
    fs: &FsUse,
    policy: &GcPolicy,
) -> Vec<Removal> {
    if !under_pressure(fs, policy) {
        return Vec::new();
    }
    let target = u128::from(fs.capacity_bytes) * u128::from(policy.low_percent) / 100;
    let mut used = u128::from(fs.used_bytes);
    let mut candidates: Vec<(u8, &NodeImage)> = images
        .iter()
        .filter_map(|i| fate(i, in_use, named).pressure_tier().map(|t| (t, i)))
        .collect();
    candidates.sort_by(|(ta, a), (tb, b)| {
        (ta, a.first_seen_ms, &a.id).cmp(&(tb, b.first_seen_ms, &b.id))
    });
    let mut out = Vec::new();
    for (tier, i) in candidates {
        if used <= target {
            break;
        }
        used = used.saturating_sub(u128::from(i.size));
        out.push(removal(
            i,
            match tier {
                0 => "disk pressure: only older revisions name it",
                1 => "disk pressure: no container uses it and no cached revision names it",
                _ => "disk pressure: only a previous revision names it",
            },
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(id: &str, name: &str, size: u64, seen: i64) -> NodeImage {
        NodeImage {
            id: id.into(),
            names: vec![name.into()],
            size,
            pinned: false,
            first_seen_ms: seen,
        }
    }

    fn named(r: &str, role: Role) -> Named {
        Named {
            reference: Reference::parse(r).unwrap(),
            role,
            by: format!("ns/{r}"),
        }
    }

    fn ids(r: &[Removal]) -> Vec<&str> {
        r.iter().map(|r| r.id.as_str()).collect()
    }

    #[test]
    fn after_a_commit_only_older_revisions_unused_images_go() {
        let images = vec![
            img("a", "docker.io/library/app:1", 10, 1),
            img("b", "docker.io/library/app:2", 10, 2),
            img("c", "docker.io/library/app:3", 10, 3),
            img("d", "docker.io/library/app:4", 10, 4),
            img("e", "docker.io/library/other:1", 10, 5),
            NodeImage {
                pinned: true,
                ..img("p", "registry.k8s.io/pause:3.9", 1, 0)
            },
        ];
        let named = vec![
            named("app:4", Role::Current),
            named("app:3", Role::Previous),
            named("app:2", Role::Old),
            named("app:1", Role::Old),
        ];
        let in_use = HashSet::from(["e".to_string()]);
        let p = GcPolicy::default();
        assert_eq!(ids(&after_commit(&images, &in_use, &named, &p)), ["a", "b"]);
        // An image nothing names (a side-load ahead of its rollout) stays after a commit.
        let side = vec![img("s", "docker.io/library/next:5", 10, 6)];
        assert!(after_commit(&side, &in_use, &named, &p).is_empty());
        let no_keep = GcPolicy {
            keep_previous: false,
            ..p
        };
        assert_eq!(
            ids(&after_commit(&images, &in_use, &named, &no_keep)),
            ["a", "b", "c"]
        );
    }

    /// Issue 31: with no container left (the runtime removed a pod's old containers and has
    /// not created the new ones), a pod two revisions behind still has its image, and the
    /// sandbox image, pinned or not, stays.
    #[test]
    fn what_a_cached_pod_runs_and_the_sandbox_image_never_go() {
        let images = vec![
            img("old", "docker.io/library/app:1", 10, 1),
            img("prev", "docker.io/library/app:2", 10, 2),
            img("pause", "registry.k8s.io/pause:3.9", 1, 0),
        ];
        let named = vec![
            named("app:3", Role::Current),
            named("app:2", Role::Previous),
            named("app:1", Role::Old),
            Named {
                by: "vehicle/app-x1".into(),
                ..named("app:1", Role::Pod)
            },
            named("registry.k8s.io/pause:3.9", Role::Sandbox),
        ];
        let none = HashSet::new();
        let p = GcPolicy {
            keep_previous: false,
            ..GcPolicy::default()
        };
        assert_eq!(ids(&after_commit(&images, &none, &named, &p)), ["prev"]);
        let full = FsUse {
            used_bytes: 100,
            capacity_bytes: 100,
        };
        let all = GcPolicy {
            low_percent: 0,
            ..p
        };
        assert_eq!(
            ids(&under_pressure_removals(
                &images, &none, &named, &full, &all
            )),
            ["prev"]
        );
        assert_eq!(
            fate(&images[0], &none, &named),
            Fate::Named {
                role: Role::Pod,
                by: vec!["ns/app:1".into(), "vehicle/app-x1".into()]
            }
        );
    }

    #[test]
    fn a_pinned_digest_matches_by_digest_and_a_tag_by_tag() {
        let d = format!("sha256:{}", "a".repeat(64));
        let by_digest = vec![format!("docker.io/library/app@{d}")];
        let r = Reference::parse(&format!("app@{d}")).unwrap();
        assert!(names_match(&by_digest, &r));
        assert!(!names_match(&["docker.io/library/app:1".into()], &r));
        let t = Reference::parse("app:1").unwrap();
        assert!(names_match(&["docker.io/library/app:1".into()], &t));
        assert!(!names_match(&["docker.io/library/app:2".into()], &t));
        assert!(!names_match(&by_digest, &t));
        // Unparsable names in the CRI's answer are skipped, not a match and not a panic.
        assert!(!names_match(&["".into(), "a b".into()], &t));
    }

    #[test]
    fn the_strongest_role_wins_and_every_namer_is_listed() {
        let i = img("a", "docker.io/library/app:1", 1, 0);
        let n = vec![
            named("app:1", Role::Previous),
            Named {
                by: "ns/other".into(),
                ..named("app:1", Role::Current)
            },
        ];
        assert_eq!(
            fate(&i, &HashSet::new(), &n),
            Fate::Named {
                role: Role::Current,
                by: vec!["ns/app:1".into(), "ns/other".into()]
            }
        );
    }

    #[test]
    fn pressure_removes_older_then_unnamed_then_previous_oldest_first_down_to_low() {
        let images = vec![
            img("new-unnamed", "docker.io/library/x:2", 100, 50),
            img("old-unnamed", "docker.io/library/x:1", 100, 10),
            img("older-rev", "docker.io/library/app:0", 100, 70),
            img("prev", "docker.io/library/app:1", 100, 5),
            img("cur", "docker.io/library/app:2", 100, 60),
            img("up", "docker.io/library/app:3", 100, 1),
        ];
        let named = vec![
            named("app:0", Role::Old),
            named("app:1", Role::Previous),
            named("app:2", Role::Current),
            named("app:3", Role::Upgrade),
        ];
        let p = GcPolicy::default();
        let none = HashSet::new();
        // 90 % of 1000: 100 bytes to go to reach 80 %: the older revision's image, though it
        // is the youngest.
        let fs = FsUse {
            used_bytes: 900,
            capacity_bytes: 1000,
        };
        assert!(under_pressure(&fs, &p));
        assert_eq!(
            ids(&under_pressure_removals(&images, &none, &named, &fs, &p)),
            ["older-rev"]
        );
        // 99 %: 200 bytes bring it to 79 %: then the oldest unnamed one, and the previous
        // revision's stays.
        let full = FsUse {
            used_bytes: 990,
            capacity_bytes: 1000,
        };
        assert_eq!(
            ids(&under_pressure_removals(&images, &none, &named, &full, &p)),
            ["older-rev", "old-unnamed"]
        );
        // Down to 50 %: all it may take, and never the current or the upgrade's images.
        let low = GcPolicy {
            low_percent: 50,
            ..p
        };
        assert_eq!(
            ids(&under_pressure_removals(
                &images, &none, &named, &full, &low
            )),
            ["older-rev", "old-unnamed", "new-unnamed", "prev"]
        );
        // At the threshold: no pressure, nothing goes.
        let at = FsUse {
            used_bytes: 850,
            capacity_bytes: 1000,
        };
        assert!(!under_pressure(&at, &p));
        assert!(under_pressure_removals(&images, &none, &named, &at, &p).is_empty());
    }

    #[test]
    fn percent_rounds_up_and_survives_an_unknown_capacity() {
        let f = |u, c| FsUse {
            used_bytes: u,
            capacity_bytes: c,
        };
        assert_eq!(f(851, 1000).percent(), 86);
        assert_eq!(f(850, 1000).percent(), 85);
        assert_eq!(f(5, 0).percent(), 0);
        assert_eq!(f(u64::MAX, 1).percent(), 100);
    }
}

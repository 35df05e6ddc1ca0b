//! Leader election through a `coordination.k8s.io/v1` Lease: the pure rules, as client-go's
//! leaderelection applies them.
//!
//! A Lease held by another identity is taken over only after it has gone unrenewed for its
//! `leaseDurationSeconds`, measured on this process's own monotonic clock from the moment it
//! last saw the Lease change (its resourceVersion). The `renewTime` written by the holder is
//! never compared with the local clock, so clock skew between replicas cannot make two leaders.
//! A Lease released on shutdown (no holder) can be taken at once.

/// The Lease as the elector reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseState {
    /// `spec.holderIdentity`; empty or absent means released.
    pub holder: Option<String>,
    /// `spec.leaseDurationSeconds`.
    pub duration_secs: i64,
    /// `metadata.resourceVersion`: it changes with every renewal.
    pub resource_version: String,
}

/// What the elector last saw, and when (monotonic milliseconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub resource_version: String,
    pub at_ms: u64,
}

/// The next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// No Lease exists: create it with this identity as holder.
    Create,
    /// Write this identity as holder (a renewal, or a takeover of a released or expired
    /// Lease), with the read resourceVersion, so a concurrent writer gets 409.
    Write,
    /// Another identity holds a Lease that is still valid.
    Wait,
}

/// Decides the next step for `me`, and updates `observed`.
pub fn step(
    lease: Option<&LeaseState>,
    me: &str,
    observed: &mut Option<Observed>,
    now_ms: u64,
) -> Step {
    let Some(lease) = lease else {
        *observed = None;
        return Step::Create;
    };
    if observed
        .as_ref()
        .is_none_or(|o| o.resource_version != lease.resource_version)
    {
        *observed = Some(Observed {
            resource_version: lease.resource_version.clone(),
            at_ms: now_ms,
        });
    }
    let holder = lease.holder.as_deref().filter(|h| !h.is_empty());
    match holder {
        None => Step::Write,
        Some(h) if h == me => Step::Write,
        Some(_) => {
            let seen = observed.as_ref().map_or(now_ms, |o| o.at_ms);
            let valid_ms = u64::try_from(lease.duration_secs.max(0))
                .unwrap_or(0)
                .saturating_mul(1000);
            if now_ms.saturating_sub(seen) >= valid_ms {
                Step::Write
            } else {
                Step::Wait
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, rv: &str) -> LeaseState {
        LeaseState {
            holder: holder.map(str::to_string),
            duration_secs: 15,
            resource_version: rv.into(),
        }
    }

    #[test]
    fn no_lease_is_created_and_a_released_or_own_lease_is_written() {
        let mut o = None;
        assert_eq!(step(None, "a", &mut o, 0), Step::Create);
        assert_eq!(step(Some(&lease(None, "1")), "a", &mut o, 0), Step::Write);
        assert_eq!(
            step(Some(&lease(Some(""), "2")), "a", &mut o, 0),
            Step::Write
        );
        assert_eq!(
            step(Some(&lease(Some("a"), "3")), "a", &mut o, 0),
            Step::Write
        );
    }

    #[test]
    fn another_holder_is_waited_out_on_the_local_clock() {
        let mut o = None;
        let held = lease(Some("b"), "7");
        assert_eq!(step(Some(&held), "a", &mut o, 1_000), Step::Wait);
        assert_eq!(step(Some(&held), "a", &mut o, 15_999), Step::Wait);
        assert_eq!(step(Some(&held), "a", &mut o, 16_000), Step::Write);
        // A renewal (new resourceVersion) restarts the wait, whatever renewTime says.
        let renewed = lease(Some("b"), "8");
        assert_eq!(step(Some(&renewed), "a", &mut o, 16_000), Step::Wait);
        assert_eq!(step(Some(&renewed), "a", &mut o, 30_999), Step::Wait);
        assert_eq!(step(Some(&renewed), "a", &mut o, 31_000), Step::Write);
    }
}

//! Transactions, pure: what state a transaction is in, what its members may do, and its commit
//! deadline's count across reboots. The store keeps the facts ([`crate::store::TxnRecord`]);
//! the engine and the API ask these functions what they mean.

use crate::store::{Decision, TxnRecord};
use std::time::Duration;

/// A transaction's state, derived from its decision and its members' states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnState {
    /// Some member is not Verified yet, and nothing is decided.
    Installing,
    /// Every member is Verified: the manager may commit.
    Verified,
    Committing,
    /// Every member is Done.
    Committed,
    RollingBack,
    /// Every member ended RolledBack.
    RolledBack,
    /// Every member ended, and one of them Failed (even its rollback did not finish).
    Failed,
}

impl TxnState {
    pub fn as_str(self) -> &'static str {
        match self {
            TxnState::Installing => "Installing",
            TxnState::Verified => "Verified",
            TxnState::Committing => "Committing",
            TxnState::Committed => "Committed",
            TxnState::RollingBack => "RollingBack",
            TxnState::RolledBack => "RolledBack",
            TxnState::Failed => "Failed",
        }
    }

    pub fn is_final(self) -> bool {
        matches!(
            self,
            TxnState::Committed | TxnState::RolledBack | TxnState::Failed
        )
    }
}

fn terminal(state: &str) -> bool {
    matches!(state, "Done" | "RolledBack" | "Failed")
}

/// The state of a transaction with `decision` whose members are in `states`.
pub fn state_of(decision: Option<Decision>, states: &[&str]) -> TxnState {
    let all_ended = states.iter().all(|s| terminal(s));
    if all_ended && states.contains(&"Failed") {
        return TxnState::Failed;
    }
    match decision {
        Some(Decision::Commit) if states.iter().all(|s| *s == "Done") => TxnState::Committed,
        Some(Decision::Commit) => TxnState::Committing,
        Some(Decision::Rollback) if all_ended => TxnState::RolledBack,
        Some(Decision::Rollback) => TxnState::RollingBack,
        // A member that ended before the decision was written (the write that ends it writes
        // the decision too; only an older row can say this).
        None if states.iter().any(|s| terminal(s)) => TxnState::RollingBack,
        None if !states.is_empty() && states.iter().all(|s| *s == "Verified") => TxnState::Verified,
        None => TxnState::Installing,
    }
}

/// The state of a stored transaction.
pub fn state(t: &TxnRecord) -> TxnState {
    let states: Vec<&str> = t.members.iter().map(|m| m.state.as_str()).collect();
    state_of(t.decision, &states)
}

/// What a transaction says to one of its members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The manager committed: a Verified member commits.
    Commit,
    /// Roll back, for this reason.
    Rollback(String),
}

/// A member's view of its transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gate {
    /// The members before it are Verified (or further): it may start.
    pub turn: bool,
    pub verdict: Option<Verdict>,
    /// The member before it that it waits for, for `waiting`.
    pub after: Option<String>,
}

/// The gate of member `request_id` of `t`: members install one after another, each once the
/// one before it is Verified.
pub fn gate(t: &TxnRecord, request_id: i64) -> Gate {
    let verdict = match t.decision {
        Some(Decision::Commit) => Some(Verdict::Commit),
        Some(Decision::Rollback) => Some(Verdict::Rollback(
            t.reason
                .clone()
                .unwrap_or_else(|| "rolled back by the OTA manager".into()),
        )),
        None => None,
    };
    let before = t.members.iter().take_while(|m| m.id != request_id);
    let waiting_for = before
        .filter(|m| !matches!(m.state.as_str(), "Verified" | "Committed" | "Done"))
        .map(|m| format!("{}/{}", m.namespace, m.name))
        .next();
    Gate {
        turn: waiting_for.is_none(),
        verdict,
        after: waiting_for,
    }
}

/// `1800000` ms as `30m`, `90000` as `1m30s`: how a deadline is said back.
pub fn human(ms: i64) -> String {
    let secs = ms.max(0) / 1000;
    let (h, m, s) = (secs / 3600, secs % 3600 / 60, secs % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 || out.is_empty() {
        out.push_str(&format!("{s}s"));
    }
    out
}

/// A duration as the CLI takes it: `90s`, `30m`, `2h`, `1h30m`, or bare seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration (90s, 30m, 2h, 1h30m, or seconds)");
    if s.is_empty() || s.len() > 32 {
        return Err(bad());
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse::<u64>().map(Duration::from_secs).map_err(|_| bad());
    }
    let mut total: u64 = 0;
    let mut num = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let unit = match c {
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => return Err(bad()),
        };
        let n: u64 = num.parse().map_err(|_| bad())?;
        num.clear();
        total = n
            .checked_mul(unit)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
    }
    if !num.is_empty() {
        return Err(bad());
    }
    Ok(Duration::from_secs(total))
}

/// The reason a transaction nobody committed rolls back with.
pub fn deadline_reason(timeout_ms: i64) -> String {
    format!("not committed within {}", human(timeout_ms))
}

/// How often the deadline's count is written while it runs: what a power cut may lose of it.
pub fn checkpoint_ms(timeout_ms: i64) -> i64 {
    (timeout_ms / 30).clamp(1_000, 60_000)
}

/// The commit deadline's count: time spent Verified, kept across reboots. The boot clock
/// restarts at zero in a new boot, so the count is brought up to a point on it (`since`) and
/// carried over from there; the time the device was off (or edgehub was not running to see the
/// new boot) does not count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clock {
    /// Counted up to `since`.
    pub elapsed_ms: i64,
    /// The boot and the point on its clock the count was last brought up to; `None`: stopped.
    pub since: Option<(String, i64)>,
}

/// What to write of the count, if anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClockWrite {
    pub elapsed_ms: i64,
    pub since: Option<(String, i64)>,
}

impl Clock {
    pub fn of(t: &TxnRecord) -> Clock {
        Clock {
            elapsed_ms: t.elapsed_ms,
            since: t.clock_boot.clone().zip(t.clock_ms),
        }
    }

    /// The count now, on boot `boot` at `now_ms` of its clock.
    pub fn live(&self, boot: &str, now_ms: i64) -> i64 {
        match &self.since {
            Some((b, at)) if b == boot => self.elapsed_ms + (now_ms - at).max(0),
            _ => self.elapsed_ms,
        }
    }

    /// One look at the count: `running` says whether it counts now (the transaction is
    /// Verified and undecided). Returns the count now, and what to write: when it starts or
    /// stops, in a new boot, and every [`checkpoint_ms`] while it runs.
    pub fn tick(
        &self,
        running: bool,
        boot: &str,
        now_ms: i64,
        timeout_ms: i64,
    ) -> (i64, Option<ClockWrite>) {
        let live = self.live(boot, now_ms);
        let here = Some((boot.to_string(), now_ms));
        let write = match (&self.since, running) {
            (None, false) => None,
            (None, true) => Some(ClockWrite {
                elapsed_ms: live,
                since: here,
            }),
            (Some(_), false) => Some(ClockWrite {
                elapsed_ms: live,
                since: None,
            }),
            (Some((b, _)), true) if b != boot => Some(ClockWrite {
                elapsed_ms: live,
                since: here,
            }),
            (Some(_), true) if live - self.elapsed_ms >= checkpoint_ms(timeout_ms) => {
                Some(ClockWrite {
                    elapsed_ms: live,
                    since: here,
                })
            }
            (Some(_), true) => None,
        };
        (live, write)
    }
}

#[cfg(test)]
#[path = "txn_tests.rs"]
mod tests;

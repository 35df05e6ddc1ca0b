//! Who holds a connection to the node API (issue 31). Anyone who reaches the port can open
//! connections, so a connection is *pending* from its accept until a request on it is
//! authenticated and authorized, and only then *admitted*:
//!
//! - pending connections have a budget of their own (`node_api_max_unauthenticated_connections`)
//!   and a short handshake deadline. When the budget is full a new connection is not
//!   refused: one pending connection is closed to make room, the oldest of the source (an
//!   IPv4 address, an IPv6 /64) that holds the most ([`victim`]). Connections opened and
//!   left silent, however many, never keep the apiserver from its handshake, and a flood
//!   from one pod closes that pod's own connections first;
//! - admitted connections are bounded by `node_api_max_connections`; an authorized caller
//!   who finds them all taken is answered 503 and the connection closed.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Where a connection comes from, for sharing the pending budget: an IPv4 address (an
/// IPv4-mapped IPv6 one too), or an IPv6 /64, what one host or pod can take addresses from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    V4(u32),
    V6(u64),
}

impl Source {
    pub fn of(ip: IpAddr) -> Source {
        match ip.to_canonical() {
            IpAddr::V4(a) => Source::V4(u32::from(a)),
            IpAddr::V6(a) => Source::V6((u128::from(a) >> 64) as u64),
        }
    }
}

/// The pending connection to close to make room for a new one (pure): of the sources holding
/// the most pending connections, the one whose oldest is oldest, and that one. Ids grow with
/// age: a smaller id is an older connection. `None` when nothing is pending.
pub fn victim(pending: &[(u64, Source)]) -> Option<u64> {
    // Per source: how many, and its oldest.
    let mut by: HashMap<Source, (usize, u64)> = HashMap::new();
    for (id, src) in pending {
        let e = by.entry(*src).or_insert((0, *id));
        e.0 += 1;
        e.1 = e.1.min(*id);
    }
    by.into_values()
        .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
        .map(|(_, oldest)| oldest)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Default)]
struct Entries {
    next: u64,
    by_id: BTreeMap<u64, (Source, Arc<Notify>)>,
}

/// The pending connections.
#[derive(Debug)]
pub struct Pending {
    max: usize,
    entries: Mutex<Entries>,
}

impl Pending {
    pub fn new(max: usize) -> Arc<Pending> {
        Arc::new(Pending {
            max: max.max(1),
            entries: Mutex::new(Entries::default()),
        })
    }

    /// Registers a new connection from `source`, closing another to make room when the
    /// budget is full.
    pub fn enter(self: &Arc<Self>, source: Source) -> Ticket {
        let mut e = lock(&self.entries);
        while e.by_id.len() >= self.max {
            let listed: Vec<(u64, Source)> = e.by_id.iter().map(|(id, (s, _))| (*id, *s)).collect();
            let Some((_, closed)) = victim(&listed).and_then(|v| e.by_id.remove(&v)) else {
                break;
            };
            // A permit is kept if its connection is not waiting yet: it sees it at once.
            closed.notify_one();
        }
        let id = e.next;
        e.next += 1;
        let evicted = Arc::new(Notify::new());
        e.by_id.insert(id, (source, evicted.clone()));
        Ticket {
            id,
            pending: self.clone(),
            evicted,
        }
    }

    /// How many connections are pending now.
    pub fn len(&self) -> usize {
        lock(&self.entries).by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes `id`; `false` when it was no longer there (closed to make room).
    fn leave(&self, id: u64) -> bool {
        lock(&self.entries).by_id.remove(&id).is_some()
    }
}

/// A pending connection's place; leaving it (admission, or the connection's end) frees it.
#[derive(Debug)]
pub struct Ticket {
    id: u64,
    pending: Arc<Pending>,
    evicted: Arc<Notify>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.pending.leave(self.id);
    }
}

/// What admitting a connection came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Admitted now or before.
    Admitted,
    /// Every admitted place is taken.
    Full,
    /// It was closed to make room before it could be admitted.
    Evicted,
}

/// One connection's standing: pending (its ticket) until admitted (its permit).
#[derive(Debug)]
pub struct Standing {
    ticket: Mutex<Option<Ticket>>,
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    evicted: Arc<Notify>,
}

impl Standing {
    pub fn pending(ticket: Ticket) -> Standing {
        Standing {
            evicted: ticket.evicted.clone(),
            ticket: Mutex::new(Some(ticket)),
            permit: Mutex::new(None),
        }
    }

    /// Resolves when the connection is closed to make room (only while it is pending).
    pub async fn evicted(&self) {
        self.evicted.notified().await
    }

    /// Moves the connection from the pending budget to one of `admitted`'s places.
    pub fn admit(&self, admitted: &Arc<Semaphore>) -> Admit {
        let mut permit = lock(&self.permit);
        if permit.is_some() {
            return Admit::Admitted;
        }
        let mut ticket = lock(&self.ticket);
        if ticket.is_none() {
            // Neither pending nor admitted: closed to make room.
            return Admit::Evicted;
        }
        let Ok(p) = admitted.clone().try_acquire_owned() else {
            return Admit::Full;
        };
        match ticket.take() {
            Some(t) if t.pending.leave(t.id) => {
                *permit = Some(p);
                Admit::Admitted
            }
            _ => Admit::Evicted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(last: u8) -> Source {
        Source::of(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn the_oldest_of_the_source_holding_the_most_is_closed() {
        assert_eq!(victim(&[]), None);
        // One pod holds 15, the apiserver 1 (older than all of them): the pod's oldest goes.
        let mut p: Vec<(u64, Source)> = (1..=15).map(|i| (i, v4(7))).collect();
        p.push((0, v4(1)));
        assert_eq!(victim(&p), Some(1));
        // All from one address (the tests' loopback): the oldest.
        let p: Vec<(u64, Source)> = (3..9).map(|i| (i, v4(1))).collect();
        assert_eq!(victim(&p), Some(3));
        // As many each: the source whose oldest is oldest.
        assert_eq!(
            victim(&[(5, v4(1)), (9, v4(1)), (2, v4(2)), (8, v4(2)), (0, v4(3))]),
            Some(2)
        );
    }

    #[test]
    fn sources_are_addresses_and_ipv6_64s() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of(a), Source::of(b));
        assert_ne!(Source::of(a), Source::of(c));
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        assert_eq!(Source::of(mapped), v4(7));
    }

    #[tokio::test]
    async fn a_full_budget_closes_one_to_make_room_and_admission_frees_its_place() {
        let pending = Pending::new(2);
        let admitted = Arc::new(Semaphore::new(1));
        let a = Standing::pending(pending.enter(v4(9)));
        let b = Standing::pending(pending.enter(v4(9)));
        assert_eq!(pending.len(), 2);
        // A third: a, the oldest of the busiest source, is closed.
        let c = Standing::pending(pending.enter(v4(1)));
        assert_eq!(pending.len(), 2);
        tokio::time::timeout(std::time::Duration::from_secs(1), a.evicted())
            .await
            .expect("a was told");
        assert_eq!(a.admit(&admitted), Admit::Evicted);
        assert_eq!(a.admit(&admitted), Admit::Evicted, "for good");
        assert_eq!(admitted.available_permits(), 1, "its permit given back");
        // c is admitted: its pending place is free, the admitted one taken.
        assert_eq!(c.admit(&admitted), Admit::Admitted);
        assert_eq!(c.admit(&admitted), Admit::Admitted, "once");
        assert_eq!(pending.len(), 1);
        assert_eq!(b.admit(&admitted), Admit::Full);
        drop(c);
        assert_eq!(b.admit(&admitted), Admit::Admitted);
        assert!(pending.is_empty());
        drop(b);
        assert_eq!(admitted.available_permits(), 1);
    }
}

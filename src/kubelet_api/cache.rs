//! A bounded map whose entries expire: the reviews' caches ([`super::reviews`]). Full, it
//! first drops what has expired, then the oldest entry, one at a time: a burst of new keys
//! never empties it, and never grows it past its bound.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Entry<V> {
    /// When it was put in: the oldest goes first.
    put: Instant,
    until: Instant,
    value: V,
}

/// At most `max` entries, each fresh for the time it was put in for.
#[derive(Debug)]
pub struct Bounded<K, V> {
    max: usize,
    map: HashMap<K, Entry<V>>,
}

impl<K: Hash + Eq + Clone, V: Clone> Bounded<K, V> {
    pub fn new(max: usize) -> Bounded<K, V> {
        Bounded {
            max: max.max(1),
            map: HashMap::new(),
        }
    }

    /// The value of `key` while it is fresh at `now`.
    pub fn get(&self, key: &K, now: Instant) -> Option<V> {
        self.map
            .get(key)
            .filter(|e| now < e.until)
            .map(|e| e.value.clone())
    }

    /// Puts `key` in, fresh for `ttl` from `now`; a full map makes room first.
    pub fn put(&mut self, key: K, value: V, ttl: Duration, now: Instant) {
        if !self.map.contains_key(&key) && self.map.len() >= self.max {
            self.map.retain(|_, e| now < e.until);
            if self.map.len() >= self.max {
                let oldest = self
                    .map
                    .iter()
                    .min_by_key(|(_, e)| e.put)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.map.remove(&k);
                }
            }
        }
        self.map.insert(
            key,
            Entry {
                put: now,
                until: now + ttl,
                value,
            },
        );
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_it_drops_the_expired_then_the_oldest_one_at_a_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut c = Bounded::new(3);
        c.put("a", 1, 100 * s, t0);
        c.put("b", 2, 100 * s, t0 + s);
        c.put("c", 3, 100 * s, t0 + 2 * s);
        assert_eq!(c.get(&"a", t0 + 3 * s), Some(1));
        // Full: the oldest (a) goes, the rest stay.
        c.put("d", 4, 100 * s, t0 + 3 * s);
        assert_eq!(c.len(), 3);
        assert_eq!(c.get(&"a", t0 + 3 * s), None);
        assert_eq!(c.get(&"b", t0 + 3 * s), Some(2));
        // Putting a key again refreshes it and makes no room.
        c.put("b", 5, 100 * s, t0 + 4 * s);
        assert_eq!((c.len(), c.get(&"b", t0 + 4 * s)), (3, Some(5)));
        // An expired entry goes before an older fresh one.
        let mut c2 = Bounded::new(2);
        c2.put("old", 1, 100 * s, t0);
        c2.put("brief", 2, s, t0 + s);
        c2.put("new", 3, 100 * s, t0 + 5 * s);
        assert_eq!(c2.get(&"old", t0 + 5 * s), Some(1));
        assert_eq!(c2.get(&"brief", t0 + 5 * s), None);
        // Stale entries are not answered.
        assert_eq!(c2.get(&"old", t0 + 100 * s), None);
        // 10 000 new keys: never more than the bound.
        let mut c3 = Bounded::new(64);
        for i in 0..10_000u32 {
            c3.put(i, (), 10 * s, t0 + Duration::from_millis(u64::from(i)));
            assert!(c3.len() <= 64);
        }
        assert!(!c3.is_empty());
    }
}

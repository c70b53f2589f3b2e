//! The aggregates this process last loaded or changed, each with the sequence it was
//! folded to, so that a command reads only the events stored after that sequence instead of
//! the aggregate's whole history (ARCHITECTURE.md, The path of one request).
//!
//! The cache is never trusted on its own. A load asks the store for the events after the
//! cached sequence (one indexed query that usually returns nothing), so an event written by
//! another instance, or by this one through another path, is always seen. A command runs on
//! the cached state without asking, and its append names the sequence it follows: the
//! store refuses it when anything was written after, and the command is decided again on
//! the stored state (`Repository::execute_linked`). An aggregate another command is decided
//! on (`Repository::load_basis`) is taken from the cache without asking as well: that
//! command names it with the sequence it saw, and its append stores nothing if the
//! aggregate has events after it (`Repository::execute_on`). What the cache saves is decoding and
//! folding the history again, which for an aggregate with thousands of events was most of a
//! command's cost, and for a command the read of its aggregate.
//!
//! An entry weighs the number of events folded into it; the least recently used entries are
//! dropped while the total is over the budget. One cache per aggregate type per
//! [`crate::Database`], shared by every repository of that type.

use cqrs_es::Aggregate;
use lru::LruCache;
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// An aggregate as of `sequence`, with its events when the repository keeps them.
#[derive(Debug, Clone)]
pub(crate) struct Cached<A: Aggregate> {
    pub aggregate: A,
    pub sequence: usize,
    pub history: Option<Vec<A::Event>>,
}

impl<A: Aggregate> Cached<A> {
    fn weight(&self) -> usize {
        self.sequence.max(1)
    }
}

/// One aggregate type's entries, by aggregate id.
pub(crate) struct AggregateCache<A: Aggregate> {
    budget: usize,
    inner: Mutex<Inner<A>>,
}

struct Inner<A: Aggregate> {
    entries: LruCache<String, Arc<Cached<A>>>,
    weight: usize,
}

impl<A: Aggregate> AggregateCache<A> {
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::new(Inner {
                entries: LruCache::unbounded(),
                weight: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<A>> {
        // Every change below leaves the map and its weight consistent before anything that
        // could panic, so a poisoned lock still guards a sound cache.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The entry for `id`, marked as just used.
    pub fn get(&self, id: &str) -> Option<Arc<Cached<A>>> {
        self.lock().entries.get(id).cloned()
    }

    /// Keeps `entry` for `id` unless the cache already holds a later sequence of it (a
    /// slower command must not put back an older state). An entry heavier than the whole
    /// budget is not kept.
    pub fn put(&self, id: &str, entry: Cached<A>) {
        let mut inner = self.lock();
        if let Some(held) = inner.entries.peek(id) {
            if held.sequence >= entry.sequence {
                return;
            }
        }
        if let Some(old) = inner.entries.pop(id) {
            inner.weight -= old.weight();
        }
        if entry.weight() > self.budget {
            return;
        }
        inner.weight += entry.weight();
        inner.entries.put(id.to_string(), Arc::new(entry));
        while inner.weight > self.budget {
            match inner.entries.pop_lru() {
                Some((_, dropped)) => inner.weight -= dropped.weight(),
                None => break,
            }
        }
    }

    #[cfg(test)]
    fn weight(&self) -> usize {
        self.lock().weight
    }
}

/// An aggregate type's name and whether its entries keep their histories.
type CacheKey = (&'static str, bool);

/// Every aggregate type's cache for one database, created on first use.
pub(crate) struct Caches {
    budget: usize,
    by_type: Mutex<HashMap<CacheKey, Arc<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl Caches {
    /// Caches of at most `budget` events per aggregate type; 0 turns caching off.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            by_type: Mutex::new(HashMap::new()),
        }
    }

    /// `A`'s cache (one for repositories that keep histories, one for those that do not),
    /// or `None` when caching is off.
    pub fn of<A>(&self, histories: bool) -> Option<Arc<AggregateCache<A>>>
    where
        A: Aggregate + 'static,
    {
        if self.budget == 0 {
            return None;
        }
        let mut by_type = self.by_type.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = by_type
            .entry((A::TYPE, histories))
            .or_insert_with(|| Arc::new(AggregateCache::<A>::new(self.budget)))
            .clone();
        // The key names A's type, so the entry was made for A.
        cache.downcast::<AggregateCache<A>>().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_domain::run::ProvisioningRun;

    fn entry(sequence: usize) -> Cached<ProvisioningRun> {
        Cached {
            aggregate: ProvisioningRun::default(),
            sequence,
            history: None,
        }
    }

    #[test]
    fn the_least_recently_used_entries_go_when_the_budget_is_spent() {
        let cache = AggregateCache::<ProvisioningRun>::new(10);
        cache.put("a", entry(4));
        cache.put("b", entry(4));
        assert!(cache.get("a").is_some()); // a is now the more recently used
        cache.put("c", entry(4));
        assert!(cache.get("b").is_none(), "b was least recently used");
        assert!(cache.get("a").is_some() && cache.get("c").is_some());
        assert_eq!(cache.weight(), 8);
        // Heavier than the whole budget: not kept, and nothing else is pushed out for it.
        cache.put("d", entry(11));
        assert!(cache.get("d").is_none());
        assert_eq!(cache.weight(), 8);
    }

    #[test]
    fn an_older_state_never_replaces_a_newer_one() {
        let cache = AggregateCache::<ProvisioningRun>::new(100);
        cache.put("a", entry(5));
        cache.put("a", entry(3));
        assert_eq!(cache.get("a").map(|e| e.sequence), Some(5));
        cache.put("a", entry(6));
        assert_eq!(cache.get("a").map(|e| e.sequence), Some(6));
        assert_eq!(cache.weight(), 6);
    }

    #[test]
    fn each_type_and_kind_has_its_own_cache_and_zero_turns_caching_off() {
        let caches = Caches::new(100);
        let plain = caches.of::<ProvisioningRun>(false).unwrap();
        plain.put("a", entry(1));
        assert!(caches
            .of::<ProvisioningRun>(false)
            .unwrap()
            .get("a")
            .is_some());
        assert!(caches
            .of::<ProvisioningRun>(true)
            .unwrap()
            .get("a")
            .is_none());
        assert!(Caches::new(0).of::<ProvisioningRun>(false).is_none());
    }
}

//! The items of Ferry's shared loops (the promotions driver, the reconciler) that keep
//! failing: each is retried on its own with a growing delay, and says why in the log, on
//! itself (e.g. the promotion's view), in `/readyz` and in `/metrics`, while the loop goes
//! on with every other item. One tenant's bad item never stops or delays another's
//! (ARCHITECTURE.md, Invariants). Subscriptions are not items: they keep their rule of
//! stopping at an event they cannot handle (`crate::stream::SubscriptionHealth`).
//!
//! The state is this process's: every instance runs the loops, meets the same failures and
//! reports them itself.

use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// The first retry's delay; each further failure doubles it.
pub const FIRST_RETRY: Duration = Duration::from_secs(1);
/// The longest delay between two attempts of a failing item.
pub const LONGEST_RETRY: Duration = Duration::from_secs(300);

/// An item of a loop that keeps failing.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ItemProblem {
    /// The loop (e.g. `promotions`, `reconciler`).
    pub r#loop: String,
    /// The item's tenant.
    pub tenant: String,
    /// The item (e.g. a promotion id).
    pub item: String,
    /// The last error.
    pub error: String,
    /// Consecutive failed attempts.
    pub attempts: u32,
    /// When the first of them failed.
    pub since: DateTime<Utc>,
    /// When the loop tries it again (not before).
    pub next_attempt_at: DateTime<Utc>,
}

type Key = (String, String, String);

/// The failing items of this process's loops (shared by every clone of the
/// [`crate::Database`]).
#[derive(Debug, Default)]
pub struct ItemHealth {
    failing: Mutex<BTreeMap<Key, ItemProblem>>,
}

/// The delay before the next attempt after `attempts` consecutive failures.
pub fn backoff(attempts: u32) -> Duration {
    let doublings = attempts.saturating_sub(1).min(16);
    FIRST_RETRY
        .saturating_mul(1u32 << doublings)
        .min(LONGEST_RETRY)
}

fn key(r#loop: &str, tenant: &str, item: &str) -> Key {
    (r#loop.to_string(), tenant.to_string(), item.to_string())
}

impl ItemHealth {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<Key, ItemProblem>> {
        // A panic while holding this lock leaves a consistent map: take it over.
        self.failing.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the loop should try `item` now: it is not failing, or its delay has passed.
    pub fn due(&self, r#loop: &str, tenant: &str, item: &str) -> bool {
        self.lock()
            .get(&key(r#loop, tenant, item))
            .is_none_or(|p| p.next_attempt_at <= Utc::now())
    }

    /// Records a failed attempt of `item` and when to try it again; returns the problem as
    /// it stands.
    pub fn failed(&self, r#loop: &str, tenant: &str, item: &str, error: &str) -> ItemProblem {
        let now = Utc::now();
        let mut failing = self.lock();
        let problem = failing
            .entry(key(r#loop, tenant, item))
            .or_insert_with(|| ItemProblem {
                r#loop: r#loop.to_string(),
                tenant: tenant.to_string(),
                item: item.to_string(),
                error: String::new(),
                attempts: 0,
                since: now,
                next_attempt_at: now,
            });
        problem.attempts = problem.attempts.saturating_add(1);
        problem.error = error.to_string();
        let delay = chrono::Duration::from_std(backoff(problem.attempts))
            .unwrap_or_else(|_| chrono::Duration::seconds(300));
        problem.next_attempt_at = now + delay;
        problem.clone()
    }

    /// `item` went through: it is healthy again.
    pub fn succeeded(&self, r#loop: &str, tenant: &str, item: &str) -> Option<ItemProblem> {
        self.lock().remove(&key(r#loop, tenant, item))
    }

    /// Forgets the failing items of `loop` that are no longer `live` (`live(tenant, item)`
    /// is false: the loop no longer has them to do, e.g. a promotion that ended another
    /// way), so that `/readyz` and the metric count only what is still stuck; returns them.
    pub fn retain_live(
        &self,
        r#loop: &str,
        mut live: impl FnMut(&str, &str) -> bool,
    ) -> Vec<ItemProblem> {
        let mut gone = Vec::new();
        self.lock().retain(|(l, tenant, item), problem| {
            let keep = l != r#loop || live(tenant, item);
            if !keep {
                gone.push(problem.clone());
            }
            keep
        });
        gone
    }

    /// The problem of `item`, if it is failing.
    pub fn problem(&self, r#loop: &str, tenant: &str, item: &str) -> Option<ItemProblem> {
        self.lock().get(&key(r#loop, tenant, item)).cloned()
    }

    /// Every failing item, by loop, tenant and item.
    pub fn problems(&self) -> Vec<ItemProblem> {
        self.lock().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_item_waits_longer_each_time_and_alone() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(5), Duration::from_secs(16));
        assert_eq!(backoff(40), LONGEST_RETRY);
        let health = ItemHealth::default();
        assert!(health.due("promotions", "globex", "p1"));
        let first = health.failed("promotions", "globex", "p1", "boom");
        assert_eq!(first.attempts, 1);
        assert!(!health.due("promotions", "globex", "p1"));
        // Another tenant's item, and the same id in another loop, are not held back.
        assert!(health.due("promotions", "acme", "p1"));
        assert!(health.due("reconciler", "globex", "p1"));
        let second = health.failed("promotions", "globex", "p1", "boom again");
        assert_eq!((second.attempts, second.since), (2, first.since));
        assert!(second.next_attempt_at > first.next_attempt_at);
        assert_eq!(health.problems().len(), 1);
        assert!(health.succeeded("promotions", "globex", "p1").is_some());
        assert!(health.due("promotions", "globex", "p1"));
        assert!(health.problems().is_empty());
    }

    #[test]
    fn items_the_loop_no_longer_has_are_forgotten() {
        let health = ItemHealth::default();
        health.failed("promotions", "globex", "gone", "boom");
        health.failed("promotions", "acme", "stuck", "boom");
        health.failed("reconciler", "globex", "gone", "boom");
        let gone = health.retain_live("promotions", |_, item| item == "stuck");
        assert_eq!(gone.len(), 1);
        assert_eq!(
            (gone[0].tenant.as_str(), gone[0].item.as_str()),
            ("globex", "gone")
        );
        let left: Vec<_> = health
            .problems()
            .into_iter()
            .map(|p| (p.r#loop, p.item))
            .collect();
        assert_eq!(
            left,
            vec![
                ("promotions".to_string(), "stuck".to_string()),
                ("reconciler".to_string(), "gone".to_string())
            ]
        );
    }
}

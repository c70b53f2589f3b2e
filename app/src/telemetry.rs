//! The process's telemetry behind the API's `/metrics` and `/readyz`.
//!
//! `/metrics` is the process's one Prometheus registry, made by the wiring
//! ([`crate::server::Server`]): the workers' run counters, the inbound counters, and the NATS
//! relay's and inbound consumers' state register their families in it; this module adds
//! the subscriptions' lag and stuck state and the group commit's counters, read from the
//! store just before each scrape. Each server has its own registry (not the library's
//! global one), so servers sharing one process (as in the end-to-end tests) each count
//! only their own work.

use crate::contexts::provisioning::work::metrics::Metrics;
use ferry_api::ports::{Readiness, Telemetry};
use ferry_messaging::health::ConsumerStatuses;
use ferry_messaging::RelayMetrics;
use ferry_store::group::GroupStats;
use ferry_store::items::ItemProblem;
use ferry_store::stream::{SubscriptionProblem, SubscriptionStatus};
use ferry_store::Database;
use prometheus::{IntCounter, IntGaugeVec, Opts, Registry, TextEncoder};
use std::sync::{Arc, Mutex, PoisonError};

/// What the NATS relay and the inbound consumers report about themselves.
#[derive(Clone)]
pub struct NatsHealth {
    /// The relay's stream.
    pub stream: String,
    /// The relay's checkpoint name (its row in the subscriptions' status).
    pub checkpoint: String,
    /// The relay's counters and state.
    pub relay: Arc<RelayMetrics>,
    /// The inbound consumers' states.
    pub consumers: Arc<ConsumerStatuses>,
}

/// The telemetry of one `ferry serve` process.
pub struct ProcessTelemetry {
    db: Database,
    runs: Arc<Metrics>,
    registry: Registry,
    // Held from setting these gauges until the registry is gathered, so that two scrapes
    // at once cannot mix their values.
    subscriptions: Mutex<SubscriptionGauges>,
    groups: GroupCounters,
    nats: Option<NatsHealth>,
    inbound_trust: Option<serde_json::Value>,
}

impl ProcessTelemetry {
    /// Telemetry over the process's `registry`, in which the parts have registered their
    /// families; it adds the subscriptions' gauges (refused only if one is already there).
    /// `runs` counts for [`Telemetry::run_reached`]; `nats` when NATS is configured.
    pub fn new(
        db: Database,
        registry: Registry,
        runs: Arc<Metrics>,
        nats: Option<NatsHealth>,
    ) -> prometheus::Result<Self> {
        let subscriptions = SubscriptionGauges::new()?;
        subscriptions.register(&registry)?;
        let groups = GroupCounters::new()?;
        groups.register(&registry, db.group_stats().is_some())?;
        Ok(Self {
            db,
            runs,
            registry,
            subscriptions: Mutex::new(subscriptions),
            groups,
            nats,
            inbound_trust: None,
        })
    }

    /// The same, reporting `trust` as `/readyz`'s `inboundTrust`.
    pub fn with_inbound_trust(mut self, trust: serde_json::Value) -> Self {
        self.inbound_trust = Some(trust);
        self
    }
}

/// The group commit's counters (Postgres only: SQLite has no groups, and shows none).
/// The store counts; each scrape moves these up to what it counted (scrapes take turns
/// under the subscription gauges' lock).
struct GroupCounters {
    /// `ferry_append_groups_total`.
    groups: IntCounter,
    /// `ferry_append_group_commands_total`: with the groups, the commands per group.
    commands: IntCounter,
    /// `ferry_append_group_events_total`.
    events: IntCounter,
    /// `ferry_append_groups_split_total`.
    split: IntCounter,
}

impl GroupCounters {
    fn new() -> prometheus::Result<Self> {
        Ok(Self {
            groups: IntCounter::new(
                "ferry_append_groups_total",
                "Group commits written: one statement and one transaction for the events of concurrent commands.",
            )?,
            commands: IntCounter::new(
                "ferry_append_group_commands_total",
                "Commands appended in group commits.",
            )?,
            events: IntCounter::new(
                "ferry_append_group_events_total",
                "Events appended in group commits.",
            )?,
            split: IntCounter::new(
                "ferry_append_groups_split_total",
                "Group commits refused as a whole (a command lost a race, or a deadlock), whose commands were appended one at a time.",
            )?,
        })
    }

    fn register(&self, registry: &Registry, postgres: bool) -> prometheus::Result<()> {
        if !postgres {
            return Ok(());
        }
        for counter in [&self.groups, &self.commands, &self.events, &self.split] {
            registry.register(Box::new(counter.clone()))?;
        }
        Ok(())
    }

    /// Moves each counter up to what the store counted.
    fn advance(&self, now: GroupStats) {
        for (counter, now) in [
            (&self.groups, now.groups),
            (&self.commands, now.commands),
            (&self.events, now.events),
            (&self.split, now.split),
        ] {
            counter.inc_by(now.saturating_sub(counter.get()));
        }
    }
}

/// The gauges known only at scrape time, from the store.
struct SubscriptionGauges {
    /// `ferry_subscription_lag_events{subscription}`, for every subscription.
    lag: IntGaugeVec,
    /// `ferry_nats_relay_lag_events{stream}`: the relay's subscription's lag.
    relay_lag: IntGaugeVec,
    /// `ferry_subscription_stuck{subscription}`: 1 while a subscription keeps failing on an
    /// event.
    stuck: IntGaugeVec,
    /// `ferry_subscription_failed_attempts{subscription}`.
    failed_attempts: IntGaugeVec,
    /// `ferry_loop_items_failing{loop}`: the items of a shared loop (the promotions
    /// driver, the reconciler) that keep failing, each retried alone.
    failing_items: IntGaugeVec,
}

impl SubscriptionGauges {
    fn new() -> prometheus::Result<Self> {
        let gauge =
            |name: &str, help: &str, label: &str| IntGaugeVec::new(Opts::new(name, help), &[label]);
        Ok(Self {
            lag: gauge(
                "ferry_subscription_lag_events",
                "Events stored after a subscription's checkpoint.",
                "subscription",
            )?,
            relay_lag: gauge(
                "ferry_nats_relay_lag_events",
                "Events stored and not yet acknowledged by JetStream.",
                "stream",
            )?,
            stuck: gauge(
                "ferry_subscription_stuck",
                "1 while a subscription keeps failing on an event (nothing is skipped).",
                "subscription",
            )?,
            failed_attempts: gauge(
                "ferry_subscription_failed_attempts",
                "Consecutive failed attempts of a stuck subscription.",
                "subscription",
            )?,
            failing_items: gauge(
                "ferry_loop_items_failing",
                "Items of a shared loop (promotions driver, reconciler) that keep failing; each is retried alone while the loop serves the others.",
                "loop",
            )?,
        })
    }

    fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        for gauge in [
            &self.lag,
            &self.relay_lag,
            &self.stuck,
            &self.failed_attempts,
            &self.failing_items,
        ] {
            registry.register(Box::new(gauge.clone()))?;
        }
        Ok(())
    }

    /// Sets every gauge anew: a subscription no longer stuck, or a lag the store did not
    /// answer for (`subscriptions` is `None`), leaves no sample rather than a stale one.
    fn set(
        &self,
        subscriptions: Option<&[SubscriptionStatus]>,
        problems: &[SubscriptionProblem],
        items: &[ItemProblem],
        nats: Option<&NatsHealth>,
    ) {
        for gauge in [
            &self.lag,
            &self.relay_lag,
            &self.stuck,
            &self.failed_attempts,
            &self.failing_items,
        ] {
            gauge.reset();
        }
        // Every loop shows a figure, zero included, so that an alert on it never goes
        // quiet for want of a series.
        for name in [
            crate::contexts::promotions::driver::LOOP,
            crate::contexts::provisioning::reconcile::LOOP,
        ] {
            self.failing_items.with_label_values(&[name]).set(0);
        }
        for item in items {
            self.failing_items.with_label_values(&[&item.r#loop]).inc();
        }
        let subscriptions = subscriptions.unwrap_or_default();
        for s in subscriptions {
            self.lag.with_label_values(&[&s.name]).set(s.lag);
        }
        if let Some(nats) = nats {
            // No checkpoint row yet (the store was down when the relay started): no figure,
            // rather than a made-up zero.
            if let Some(lag) = subscriptions
                .iter()
                .find(|s| s.name == nats.checkpoint)
                .map(|s| s.lag)
            {
                self.relay_lag.with_label_values(&[&nats.stream]).set(lag);
            }
        }
        for p in problems {
            self.stuck.with_label_values(&[&p.name]).set(1);
            self.failed_attempts
                .with_label_values(&[&p.name])
                .set(i64::try_from(p.attempts).unwrap_or(i64::MAX));
        }
    }
}

/// One `/readyz` line per loop with items that keep failing: how many, in how many tenants
/// (each item names its own error: the promotion's view, the log).
fn failing_items(items: &[ItemProblem]) -> Vec<String> {
    let mut by_loop: std::collections::BTreeMap<&str, (usize, std::collections::BTreeSet<&str>)> =
        std::collections::BTreeMap::new();
    for item in items {
        let entry = by_loop.entry(&item.r#loop).or_default();
        entry.0 += 1;
        entry.1.insert(&item.tenant);
    }
    by_loop
        .into_iter()
        .map(|(name, (count, tenants))| {
            format!(
                "{name}: {count} item(s) of {} tenant(s) keep failing; each is retried alone with a growing delay while the others go on",
                tenants.len()
            )
        })
        .collect()
}

impl Telemetry for ProcessTelemetry {
    fn run_reached(&self, tenant: &str, kind: &str, state: &str) {
        self.runs.run_reached(tenant, kind, state);
    }

    fn render(&self, subscriptions: Option<&[SubscriptionStatus]>) -> String {
        let gauges = self
            .subscriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        gauges.set(
            subscriptions,
            &self.db.subscription_health().problems(),
            &self.db.item_health().problems(),
            self.nats.as_ref(),
        );
        if let Some(stats) = self.db.group_stats() {
            self.groups.advance(stats);
        }
        let families = self.registry.gather();
        drop(gauges);
        TextEncoder::new()
            .encode_to_string(&families)
            .unwrap_or_else(|error| {
                tracing::error!(%error, "cannot encode /metrics");
                String::new()
            })
    }

    fn readiness(&self, subscriptions: &[SubscriptionStatus]) -> Readiness {
        let failing = failing_items(&self.db.item_health().problems());
        let Some(n) = &self.nats else {
            return Readiness {
                problems: failing,
                nats: None,
                inbound_trust: self.inbound_trust.clone(),
            };
        };
        let mut problems = failing;
        problems.extend(n.relay.problems(&n.stream));
        problems.extend(n.consumers.problems());
        let mut relay = serde_json::to_value(n.relay.status()).unwrap_or_default();
        relay["stream"] = n.stream.clone().into();
        if let Some(row) = subscriptions.iter().find(|s| s.name == n.checkpoint) {
            relay["checkpoint"] = serde_json::to_value(row.position).unwrap_or_default();
            relay["lag"] = row.lag.into();
        }
        Readiness {
            problems,
            nats: Some(serde_json::json!({"relay": relay, "consumers": n.consumers.snapshot()})),
            inbound_trust: self.inbound_trust.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_store::Position;

    fn status(name: &str, lag: i64) -> SubscriptionStatus {
        SubscriptionStatus {
            name: name.into(),
            position: Position {
                transaction_id: 1,
                global_position: 1,
            },
            lag,
            lag_estimated: false,
            head: 1 + lag,
        }
    }

    fn stuck(name: &str, attempts: u64) -> SubscriptionProblem {
        SubscriptionProblem {
            name: name.into(),
            position: None,
            event_id: None,
            event_type: None,
            error: "boom".into(),
            attempts,
            since: chrono::Utc::now(),
        }
    }

    fn scrape(
        gauges: &SubscriptionGauges,
        registry: &Registry,
        subscriptions: Option<&[SubscriptionStatus]>,
        problems: &[SubscriptionProblem],
        nats: Option<&NatsHealth>,
    ) -> String {
        gauges.set(subscriptions, problems, &[], nats);
        TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap()
    }

    #[test]
    fn each_scrape_shows_the_subscriptions_as_they_are_then() {
        let registry = Registry::new();
        let gauges = SubscriptionGauges::new().unwrap();
        gauges.register(&registry).unwrap();
        let nats = NatsHealth {
            stream: "FERRY_EVENTS".into(),
            checkpoint: "nats-relay:FERRY_EVENTS".into(),
            relay: Arc::default(),
            consumers: Arc::default(),
        };
        let rows = [status("runs", 3), status("nats-relay:FERRY_EVENTS", 2)];
        let text = scrape(
            &gauges,
            &registry,
            Some(&rows),
            &[stuck("runs", 4)],
            Some(&nats),
        );
        for line in [
            "# HELP ferry_subscription_lag_events Events stored after a subscription's checkpoint.\n# TYPE ferry_subscription_lag_events gauge\n",
            "ferry_subscription_lag_events{subscription=\"runs\"} 3\n",
            "ferry_nats_relay_lag_events{stream=\"FERRY_EVENTS\"} 2\n",
            "ferry_subscription_stuck{subscription=\"runs\"} 1\n",
            "ferry_subscription_failed_attempts{subscription=\"runs\"} 4\n",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
        // Unstuck, and the store did not answer: no stale samples (each loop's count of
        // failing items is shown, as zero).
        let text = scrape(&gauges, &registry, None, &[], Some(&nats));
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            samples,
            [
                "ferry_loop_items_failing{loop=\"promotions\"} 0",
                "ferry_loop_items_failing{loop=\"reconciler\"} 0"
            ],
            "{text}"
        );
        // No checkpoint row for the relay yet: no made-up relay lag.
        let text = scrape(&gauges, &registry, Some(&rows[..1]), &[], Some(&nats));
        assert!(!text.contains("ferry_nats_relay_lag_events"), "{text}");
    }

    #[test]
    fn the_group_counters_show_what_the_store_counted_however_often_scraped() {
        let registry = Registry::new();
        let counters = GroupCounters::new().unwrap();
        counters.register(&registry, true).unwrap();
        let shown = |stats: GroupStats| {
            counters.advance(stats);
            TextEncoder::new()
                .encode_to_string(&registry.gather())
                .unwrap()
        };
        let first = GroupStats {
            groups: 3,
            commands: 7,
            events: 9,
            split: 1,
        };
        for text in [shown(first), shown(first)] {
            for line in [
                "ferry_append_groups_total 3\n",
                "ferry_append_group_commands_total 7\n",
                "ferry_append_group_events_total 9\n",
                "ferry_append_groups_split_total 1\n",
            ] {
                assert!(text.contains(line), "no {line:?} in\n{text}");
            }
        }
        let later = GroupStats {
            groups: 5,
            commands: 12,
            events: 20,
            split: 1,
        };
        let text = shown(later);
        assert!(text.contains("ferry_append_groups_total 5\n"), "{text}");
        assert!(
            text.contains("ferry_append_group_commands_total 12\n"),
            "{text}"
        );
        // SQLite: nothing registered, nothing shown.
        let registry = Registry::new();
        GroupCounters::new()
            .unwrap()
            .register(&registry, false)
            .unwrap();
        assert!(registry.gather().is_empty());
    }
}

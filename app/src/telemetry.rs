//! The process's telemetry behind the API's `/metrics` and `/readyz`: the workers' run
//! counters, the subscriptions' lag and stuck state, the inbound counters, and the NATS
//! relay's and inbound consumers' state.

use ferry_api::ports::{Readiness, Telemetry};
use ferry_messaging::health::ConsumerStatuses;
use ferry_messaging::inbound::InboundMetrics;
use ferry_messaging::RelayMetrics;
use ferry_store::stream::{SubscriptionProblem, SubscriptionStatus};
use ferry_store::Database;
use ferry_workers::metrics::Metrics;
use std::sync::Arc;

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
    inbound: Arc<InboundMetrics>,
    nats: Option<NatsHealth>,
}

impl ProcessTelemetry {
    /// Telemetry over the process's parts; `nats` when NATS is configured.
    pub fn new(
        db: Database,
        runs: Arc<Metrics>,
        inbound: Arc<InboundMetrics>,
        nats: Option<NatsHealth>,
    ) -> Self {
        Self {
            db,
            runs,
            inbound,
            nats,
        }
    }

    /// `ferry_subscription_lag_events{subscription}` for every subscription, and the relay's
    /// lag as `ferry_nats_relay_lag_events{stream}`.
    fn render_lag(&self, subscriptions: &[SubscriptionStatus]) -> String {
        let mut out = String::from(
            "# HELP ferry_subscription_lag_events Events stored after a subscription's checkpoint.\n# TYPE ferry_subscription_lag_events gauge\n",
        );
        for s in subscriptions {
            out.push_str(&format!(
                "ferry_subscription_lag_events{{subscription=\"{}\"}} {}\n",
                s.name, s.lag
            ));
        }
        if let Some(nats) = &self.nats {
            // No checkpoint row yet (the store was down when the relay started): no figure,
            // rather than a made-up zero.
            if let Some(lag) = subscriptions
                .iter()
                .find(|s| s.name == nats.checkpoint)
                .map(|s| s.lag)
            {
                out.push_str(&format!(
                "# HELP ferry_nats_relay_lag_events Events stored and not yet acknowledged by JetStream.\n# TYPE ferry_nats_relay_lag_events gauge\nferry_nats_relay_lag_events{{stream=\"{}\"}} {lag}\n",
                    nats.stream
                ));
            }
        }
        out
    }
}

impl Telemetry for ProcessTelemetry {
    fn run_reached(&self, tenant: &str, kind: &str, state: &str) {
        self.runs.run_reached(tenant, kind, state);
    }

    fn render(&self, subscriptions: Option<&[SubscriptionStatus]>) -> String {
        let mut text = self.runs.render();
        text.push_str(&render_subscription_problems(
            &self.db.subscription_health().problems(),
        ));
        text.push_str(&self.inbound.render());
        if let Some(nats) = &self.nats {
            text.push_str(&nats.relay.render(&nats.stream));
            text.push_str(&nats.consumers.render());
        }
        if let Some(subscriptions) = subscriptions {
            text.push_str(&self.render_lag(subscriptions));
        }
        text
    }

    fn readiness(&self, subscriptions: &[SubscriptionStatus]) -> Readiness {
        let Some(n) = &self.nats else {
            return Readiness::default();
        };
        let mut problems = n.relay.problems(&n.stream);
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
        }
    }
}

/// `ferry_subscription_stuck{subscription}` (1 while a subscription keeps failing on an
/// event) and `ferry_subscription_failed_attempts{subscription}`.
fn render_subscription_problems(problems: &[SubscriptionProblem]) -> String {
    let mut out = String::from(
        "# HELP ferry_subscription_stuck 1 while a subscription keeps failing on an event (nothing is skipped).\n# TYPE ferry_subscription_stuck gauge\n",
    );
    for p in problems {
        out.push_str(&format!(
            "ferry_subscription_stuck{{subscription=\"{}\"}} 1\n",
            p.name
        ));
    }
    out.push_str("# HELP ferry_subscription_failed_attempts Consecutive failed attempts of a stuck subscription.\n# TYPE ferry_subscription_failed_attempts gauge\n");
    for p in problems {
        out.push_str(&format!(
            "ferry_subscription_failed_attempts{{subscription=\"{}\"}} {}\n",
            p.name, p.attempts
        ));
    }
    out
}

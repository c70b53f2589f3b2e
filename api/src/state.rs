//! What every handler shares: the store, the repositories, the read side, the verifier,
//! the metrics, the artifact store and the rules confining tenants' references.

use crate::auth::Verifier;
use ferry_domain::confinement::Confinement;
use ferry_domain::environment::Environment;
use ferry_domain::ports::sources::ArtifactStore;
use ferry_domain::run::ProvisioningRun;
use ferry_domain::specification::DeploymentSpecification;
use ferry_projections::ReadModels;
use ferry_store::{Database, Repository};
use ferry_workers::metrics::Metrics;
use std::sync::Arc;
use std::time::Duration;

/// What the NATS relay and the inbound consumers report about themselves.
#[derive(Clone)]
pub struct NatsHealth {
    /// The relay's stream.
    pub stream: String,
    /// The relay's checkpoint name (its row in the subscriptions' status).
    pub checkpoint: String,
    /// The relay's counters and state.
    pub relay: Arc<ferry_messaging::RelayMetrics>,
    /// The inbound consumers' states.
    pub consumers: Arc<ferry_messaging::health::ConsumerStatuses>,
}

/// Shared state of the HTTP API.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database,
    specifications: Repository<DeploymentSpecification>,
    runs: Repository<ProvisioningRun>,
    environments: Repository<Environment>,
    reads: ReadModels,
    services: Services,
}

/// What the state is built from, besides the store.
pub struct Services {
    /// Token verifier.
    pub verifier: Verifier,
    /// How long a command waits for its read model.
    pub read_your_writes: Duration,
    /// The process's metrics.
    pub metrics: Arc<Metrics>,
    /// Where run logs are kept.
    pub artifacts: Arc<dyn ArtifactStore>,
    /// Inbound event handling, shared by NATS consumers and `POST /factory/events`.
    pub inbound: ferry_messaging::inbound::InboundContext,
    /// What the NATS relay and the inbound consumers report, when NATS is configured.
    pub nats: Option<NatsHealth>,
    /// A transaction holding the global stream back longer than this is reported.
    pub stream_hold_warn: Duration,
    /// What each tenant's references may reach.
    pub confinement: Arc<Confinement>,
}

impl AppState {
    /// Builds the state.
    pub fn new(db: Database, reads: ReadModels, services: Services) -> Self {
        Self {
            inner: Arc::new(Inner {
                specifications: Repository::new(db.clone(), ()),
                runs: Repository::new(db.clone(), ()),
                environments: Repository::new(db.clone(), ()),
                db,
                reads,
                services,
            }),
        }
    }

    /// The store.
    pub fn db(&self) -> &Database {
        &self.inner.db
    }
    /// Specifications.
    pub fn specifications(&self) -> &Repository<DeploymentSpecification> {
        &self.inner.specifications
    }
    /// Runs.
    pub fn runs(&self) -> &Repository<ProvisioningRun> {
        &self.inner.runs
    }
    /// Environments.
    pub fn environments(&self) -> &Repository<Environment> {
        &self.inner.environments
    }
    /// Read models.
    pub fn reads(&self) -> &ReadModels {
        &self.inner.reads
    }
    /// Token verifier.
    pub fn verifier(&self) -> &Verifier {
        &self.inner.services.verifier
    }
    /// How long a command waits for its read model before answering.
    pub fn read_your_writes(&self) -> Duration {
        self.inner.services.read_your_writes
    }
    /// Metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.services.metrics
    }
    /// Artifacts (run logs).
    pub fn artifacts(&self) -> &dyn ArtifactStore {
        self.inner.services.artifacts.as_ref()
    }
    /// Inbound event handling.
    pub fn inbound(&self) -> &ferry_messaging::inbound::InboundContext {
        &self.inner.services.inbound
    }
    /// A transaction holding the global stream back longer than this is reported.
    pub fn stream_hold_warn(&self) -> Duration {
        self.inner.services.stream_hold_warn
    }
    /// The rules confining each tenant's references (checked at declaration).
    pub fn confinement(&self) -> &Confinement {
        &self.inner.services.confinement
    }
    /// The relay's and inbound consumers' reports, when NATS is configured.
    pub fn nats(&self) -> Option<&NatsHealth> {
        self.inner.services.nats.as_ref()
    }
    /// Every metric of the process, as Prometheus text.
    pub fn render_metrics(&self) -> String {
        let s = &self.inner.services;
        let mut text = s.metrics.render();
        text.push_str(&render_subscription_problems(
            &self.inner.db.subscription_health().problems(),
        ));
        text.push_str(&s.inbound.metrics.render());
        if let Some(nats) = &s.nats {
            text.push_str(&nats.relay.render(&nats.stream));
            text.push_str(&nats.consumers.render());
        }
        text
    }

    /// `ferry_subscription_lag_events{subscription}` for every subscription, and the relay's
    /// lag as `ferry_nats_relay_lag_events{stream}`.
    pub fn render_lag(&self, subscriptions: &[ferry_store::stream::SubscriptionStatus]) -> String {
        let mut out = String::from(
            "# HELP ferry_subscription_lag_events Events stored after a subscription's checkpoint.\n# TYPE ferry_subscription_lag_events gauge\n",
        );
        for s in subscriptions {
            out.push_str(&format!(
                "ferry_subscription_lag_events{{subscription=\"{}\"}} {}\n",
                s.name, s.lag
            ));
        }
        if let Some(nats) = &self.inner.services.nats {
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

/// `ferry_subscription_stuck{subscription}` (1 while a subscription keeps failing on an
/// event) and `ferry_subscription_failed_attempts{subscription}`.
fn render_subscription_problems(problems: &[ferry_store::stream::SubscriptionProblem]) -> String {
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

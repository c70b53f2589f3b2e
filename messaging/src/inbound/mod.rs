//! Events Ferry reacts to, over NATS (durable pull consumers) or HTTP
//! (`POST /factory/events`, [`accept_cloud_event`]), with one validation, dedupe and
//! dead-letter path for both.
//!
//! For each message: parse the CloudEvent, identify the event (NATS subject, or the
//! CloudEvent `type` over HTTP: the subject or the event name), check that its `source` is
//! trusted for it ([`TrustedSources`]), decode the typed payload, check that the payload's
//! tenant is the envelope's, claim (tenant, source, id) in `inbound_messages`, call the
//! [`InboundHandler`], and mark it `done`. A malformed, unknown or untrusted message, or one
//! the handler refuses for good, is dead-lettered with its reason and terminated (never
//! redelivered); a transient failure gives the claim back and is retried.
//!
//! Exactly-once effect: the handler commits its command together with
//! [`InboundEnvelope::mark`] (one transaction), so the effect and the "handled" record exist
//! together or not at all, and a delivery whose claim was taken over cannot commit. A
//! message handled is acknowledged as a duplicate when it comes again, and so is a message
//! whose effect the handler finds already recorded (the same approval under another id).

mod events;
mod nats;
pub mod store;
pub mod trust;

pub use events::{
    inbound_name, ApprovalDecided, ApprovalDecision, EnvironmentCreated, EnvironmentStateChanged,
    InboundEvent, ReleaseReady, ReleaseWithdrawn, INBOUND,
};
pub use nats::{subject_matches, Inbound, InboundConfig, InboundStartError};
pub use trust::{SourceIdentities, SourceIdentitiesError, TrustedSources, TrustedSourcesError};

use crate::cloudevent::CloudEvent;
use crate::metrics::{Family, ScrapeCollector};
use chrono::{DateTime, Utc};
use ferry_domain::{Actor, TenantId};
use ferry_store::{Database, LinkedWrite};
use prometheus::proto::MetricFamily;
use prometheus::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use store::{Claim, DeadLetter, MessageKey};

/// One inbound event handed to the integrator.
#[derive(Debug, Clone)]
pub struct InboundEnvelope {
    /// The CloudEvent id (unique per source); use it to derive idempotent command ids.
    pub id: String,
    /// The CloudEvent source.
    pub source: String,
    /// The tenant (`tenantid`, equal to the payload's `tenantId`).
    pub tenant_id: TenantId,
    /// The NATS subject, or the CloudEvent type over HTTP.
    pub subject: String,
    /// The CloudEvent time, if given.
    pub time: Option<DateTime<Utc>>,
    /// The correlation id extension, if given.
    pub correlation_id: Option<String>,
    /// `nats` or `http`.
    pub via: &'static str,
    /// Who sent it, recorded as the actor of its effects: the token's subject over HTTP,
    /// `nats:<source>` over NATS.
    pub actor: Actor,
    /// Marks the message handled: commit it in the same transaction as the effect.
    pub mark: LinkedWrite,
    /// The typed event.
    pub event: InboundEvent,
}

/// How a handler dealt with an event it accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// Its effect was committed together with [`InboundEnvelope::mark`].
    Recorded,
    /// It needs nothing done (e.g. an event Ferry only logs): mark it handled.
    NothingToDo,
    /// Its effect was already recorded (the same decision under another message id): mark
    /// it handled and report a duplicate.
    AlreadyRecorded,
}

/// How a handler failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InboundError {
    /// Will never succeed (malformed for the domain, refused by a domain rule): the message
    /// is dead-lettered and terminated.
    #[error("refused: {0}")]
    Permanent(String),
    /// May succeed later (store down, conflict): the message is retried after a delay.
    #[error("temporarily failed: {0}")]
    Transient(String),
}

/// What the integrator implements: apply one inbound event, committing its effect with
/// [`InboundEnvelope::mark`] (see the module documentation).
#[async_trait::async_trait]
pub trait InboundHandler: Send + Sync {
    /// Applies the event.
    async fn handle(&self, event: InboundEnvelope) -> Result<Handled, InboundError>;
}

/// Counters of inbound processing, for `/metrics` and tests.
#[derive(Debug, Default)]
pub struct InboundMetrics {
    /// Messages received (NATS deliveries and HTTP posts).
    pub received: AtomicU64,
    /// Messages the handler applied.
    pub handled: AtomicU64,
    /// Redeliveries or re-posts of messages already handled or refused.
    pub duplicates: AtomicU64,
    /// Messages dead-lettered (malformed, unknown or refused).
    pub dead_lettered: AtomicU64,
    /// Transient failures (retried).
    pub transient_failures: AtomicU64,
    /// HTTP posts refused because their tenant is not the caller's.
    pub forbidden: AtomicU64,
    /// Messages refused because their source is not trusted for them.
    pub untrusted: AtomicU64,
}

impl InboundMetrics {
    fn families(&self) -> Vec<MetricFamily> {
        INBOUND_COUNTERS
            .iter()
            .map(|(family, read)| family.one(vec![], read(self) as f64))
            .collect()
    }

    /// The counters in the Prometheus text format.
    pub fn render(&self) -> String {
        crate::metrics::encode(self.families())
    }

    /// Registers the counters in `registry` (the process's, served at `/metrics`); they
    /// are read at each scrape.
    pub fn register(self: &Arc<Self>, registry: &Registry) -> prometheus::Result<()> {
        let metrics = self.clone();
        registry.register(Box::new(ScrapeCollector::new(
            INBOUND_COUNTERS.iter().map(|(family, _)| family),
            move || metrics.families(),
        )?))
    }
}

/// Reads one inbound counter.
type ReadCounter = fn(&InboundMetrics) -> u64;

/// The inbound counters, with the field each is read from.
const INBOUND_COUNTERS: [(Family, ReadCounter); 7] = [
    (
        Family::counter(
            "ferry_inbound_received_total",
            "Inbound messages received (NATS and HTTP).",
            &[],
        ),
        |m| m.received.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_inbound_handled_total",
            "Inbound messages applied.",
            &[],
        ),
        |m| m.handled.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_inbound_duplicates_total",
            "Redelivered or re-posted messages without effect.",
            &[],
        ),
        |m| m.duplicates.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_inbound_dead_lettered_total",
            "Malformed, unknown or refused messages.",
            &[],
        ),
        |m| m.dead_lettered.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_inbound_transient_failures_total",
            "Transient failures (retried).",
            &[],
        ),
        |m| m.transient_failures.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_inbound_forbidden_total",
            "HTTP events of another tenant than the caller's.",
            &[],
        ),
        |m| m.forbidden.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_inbound_untrusted_total",
            "Messages whose CloudEvent source is not trusted for them.",
            &[],
        ),
        |m| m.untrusted.load(Ordering::Relaxed),
    ),
];

/// What inbound processing needs: the store, the handler and the counters.
#[derive(Clone)]
pub struct InboundContext {
    /// The store holding `inbound_messages` and `inbound_dead_letters`.
    pub db: Database,
    /// The integrator's handler.
    pub handler: Arc<dyn InboundHandler>,
    /// Counters.
    pub metrics: Arc<InboundMetrics>,
    /// How long one handler call may hold a message (then it counts as abandoned).
    pub lease: Duration,
    /// The sources trusted per event.
    pub trusted: TrustedSources,
}

impl InboundContext {
    /// A context with a five-minute lease that trusts any source.
    pub fn new(db: Database, handler: Arc<dyn InboundHandler>) -> Self {
        Self {
            db,
            handler,
            metrics: Arc::new(InboundMetrics::default()),
            lease: Duration::from_secs(300),
            trusted: TrustedSources::any(),
        }
    }

    /// The same, trusting only `trusted`.
    pub fn with_trusted_sources(mut self, trusted: TrustedSources) -> Self {
        self.trusted = trusted;
        self
    }
}

/// The verified caller of `POST /factory/events`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poster {
    /// The token's tenant: the event must be for it.
    pub tenant: TenantId,
    /// The token's subject: the actor of the event's effects.
    pub actor: Actor,
}

/// A CloudEvent accepted over HTTP.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    /// The CloudEvent id.
    pub id: String,
    /// The event name (`ReleaseReady`, …).
    pub event: String,
    /// True when the id was handled before (nothing happened this time).
    pub duplicate: bool,
}

/// Why an HTTP CloudEvent was not accepted. [`AcceptError::status`] gives the HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AcceptError {
    /// Not a valid CloudEvent or payload, or an unknown type (dead-lettered): 400.
    #[error("malformed event: {0}")]
    Malformed(String),
    /// The CloudEvent's tenant is not the caller's, or its source is not trusted: 403.
    #[error("{0}")]
    Forbidden(String),
    /// A domain rule refused it (dead-lettered): 422.
    #[error("event refused: {0}")]
    Rejected(String),
    /// The same id is being handled right now: 409, retry later.
    #[error("event {0} is being handled; retry later")]
    InProgress(String),
    /// The store or a dependency is unavailable: 503, retry later.
    #[error("temporarily unavailable: {0}")]
    Unavailable(String),
}

impl AcceptError {
    /// The HTTP status for this error.
    pub fn status(&self) -> axum::http::StatusCode {
        use axum::http::StatusCode;
        match self {
            Self::Malformed(_) => StatusCode::BAD_REQUEST,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::Rejected(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::InProgress(_) => StatusCode::CONFLICT,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The result of processing one message (shared by NATS and HTTP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    Handled {
        id: String,
        event: &'static str,
    },
    Duplicate {
        id: String,
        event: &'static str,
    },
    /// Dead-lettered: malformed or unknown.
    Malformed(String),
    /// Dead-lettered (now or before): refused by the handler.
    Rejected(String),
    Forbidden(String),
    Busy(String),
    Transient(String),
}

/// Accepts a CloudEvent posted over HTTP (`POST /factory/events`) by a verified `poster`:
/// same validation, trust, dedupe and dead-lettering as NATS.
pub async fn accept_cloud_event(
    ctx: &InboundContext,
    poster: &Poster,
    body: &[u8],
) -> Result<Accepted, AcceptError> {
    match process(ctx, "http", None, Some(poster), body).await {
        Outcome::Handled { id, event } => Ok(Accepted {
            id,
            event: event.to_string(),
            duplicate: false,
        }),
        Outcome::Duplicate { id, event } => Ok(Accepted {
            id,
            event: event.to_string(),
            duplicate: true,
        }),
        Outcome::Malformed(r) => Err(AcceptError::Malformed(r)),
        Outcome::Rejected(r) => Err(AcceptError::Rejected(r)),
        Outcome::Forbidden(r) => Err(AcceptError::Forbidden(r)),
        Outcome::Busy(id) => Err(AcceptError::InProgress(id)),
        Outcome::Transient(r) => Err(AcceptError::Unavailable(r)),
    }
}

/// The actor recorded for a NATS message's effects.
fn nats_actor(source: &str) -> Actor {
    let name: String = format!("nats:{source}").chars().take(256).collect();
    Actor::parse(name).unwrap_or_else(|_| {
        Actor::parse("nats:unnamed-source").expect("a constant actor name is valid")
    })
}

/// Processes one message. `nats_subject` is set for NATS deliveries; `poster` for HTTP
/// posts.
pub(crate) async fn process(
    ctx: &InboundContext,
    via: &'static str,
    nats_subject: Option<&str>,
    poster: Option<&Poster>,
    body: &[u8],
) -> Outcome {
    ctx.metrics.received.fetch_add(1, Ordering::Relaxed);
    let fallback_subject = nats_subject.unwrap_or("http:/factory/events");
    let caller_tenant = poster.map(|p| p.tenant.as_str());
    let dead = |subject: String, id: Option<String>, tenant: Option<String>, reason: String| async move {
        ctx.metrics.dead_lettered.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(via, %subject, id = ?id, %reason, "inbound message dead-lettered");
        let letter = DeadLetter {
            via,
            subject: &subject,
            message_id: id.as_deref(),
            tenant_id: tenant.as_deref(),
            reason: &reason,
            payload: body,
        };
        if let Err(error) = store::dead_letter(&ctx.db, &letter).await {
            // Still terminated: redelivering a malformed message cannot fix it.
            tracing::error!(%error, "cannot record a dead letter");
        }
    };
    let event = match CloudEvent::parse(body) {
        Ok(e) => e,
        Err(e) => {
            let reason = e.to_string();
            dead(
                fallback_subject.to_string(),
                None,
                caller_tenant.map(str::to_string),
                reason.clone(),
            )
            .await;
            return Outcome::Malformed(reason);
        }
    };
    let tenant_attr = event.tenantid.clone().unwrap_or_default();
    if let Some(caller) = caller_tenant {
        if caller != tenant_attr {
            ctx.metrics.forbidden.fetch_add(1, Ordering::Relaxed);
            return Outcome::Forbidden(format!(
                "the event belongs to tenant {tenant_attr:?}, not to the caller's tenant"
            ));
        }
    }
    let subject = nats_subject.unwrap_or(&event.event_type).to_string();
    let id = Some(event.id.clone());
    let tenant = Some(tenant_attr.clone());
    let name = match inbound_name(&subject) {
        Some(n) => n,
        None => {
            let reason = format!("unknown event type {subject:?}");
            dead(subject, id, tenant, reason.clone()).await;
            return Outcome::Malformed(reason);
        }
    };
    // Over NATS the subject decides; a `type` naming another known event is a contradiction.
    if let Some(other) = inbound_name(&event.event_type).filter(|o| *o != name) {
        let reason = format!(
            "type {:?} ({other}) does not match subject {subject:?} ({name})",
            event.event_type
        );
        dead(subject, id, tenant, reason.clone()).await;
        return Outcome::Malformed(reason);
    }
    let canonical_subject = INBOUND
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(subject.as_str(), |(_, s)| *s);
    if let Err(untrusted) = ctx.trusted.check(name, canonical_subject, &event.source) {
        let reason = untrusted.to_string();
        ctx.metrics.untrusted.fetch_add(1, Ordering::Relaxed);
        if poster.is_some() {
            // The caller is told; nothing to keep for an operator.
            return Outcome::Forbidden(reason);
        }
        dead(subject, id, tenant, reason.clone()).await;
        return Outcome::Rejected(reason);
    }
    // Over HTTP the body's `source` is only a claim: the token's subject must be bound to it.
    if let Some(p) = poster {
        if let Err(untrusted) = ctx.trusted.check_poster(&event.source, &p.actor) {
            ctx.metrics.untrusted.fetch_add(1, Ordering::Relaxed);
            return Outcome::Forbidden(untrusted.to_string());
        }
    }
    let typed = match InboundEvent::decode(name, event.data.clone()) {
        Ok(t) => t,
        Err(reason) => {
            dead(subject, id, tenant, reason.clone()).await;
            return Outcome::Malformed(reason);
        }
    };
    if typed.tenant_id().as_str() != tenant_attr {
        let reason = format!(
            "payload tenantId {:?} differs from the tenantid attribute {tenant_attr:?}",
            typed.tenant_id().as_str()
        );
        dead(subject, id, tenant, reason.clone()).await;
        return Outcome::Malformed(reason);
    }
    let tenant_id = typed.tenant_id().clone();
    let key = MessageKey {
        tenant: &tenant_attr,
        source: &event.source,
        id: &event.id,
    };
    let token = match store::claim(&ctx.db, key, name, ctx.lease).await {
        Ok(Claim::Claimed(token)) => token,
        Ok(Claim::Done) => {
            ctx.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
            return Outcome::Duplicate {
                id: event.id,
                event: name,
            };
        }
        Ok(Claim::Rejected(reason)) => {
            ctx.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
            return Outcome::Rejected(reason);
        }
        Ok(Claim::Busy) => return Outcome::Busy(event.id),
        Err(error) => {
            ctx.metrics
                .transient_failures
                .fetch_add(1, Ordering::Relaxed);
            return Outcome::Transient(format!("store: {error}"));
        }
    };
    let envelope = InboundEnvelope {
        id: event.id.clone(),
        source: event.source.clone(),
        tenant_id,
        subject: subject.clone(),
        time: event.time,
        correlation_id: event.correlationid.clone(),
        via,
        actor: poster.map_or_else(|| nats_actor(&event.source), |p| p.actor.clone()),
        mark: store::handled_mark(&ctx.db, key, &token),
        event: typed,
    };
    let result = match tokio::time::timeout(ctx.lease, ctx.handler.handle(envelope)).await {
        Ok(r) => r,
        Err(_) => Err(InboundError::Transient("the handler timed out".to_string())),
    };
    let transient = |reason: String| {
        ctx.metrics
            .transient_failures
            .fetch_add(1, Ordering::Relaxed);
        Outcome::Transient(reason)
    };
    match result {
        Ok(Handled::Recorded) => {
            ctx.metrics.handled.fetch_add(1, Ordering::Relaxed);
            Outcome::Handled {
                id: event.id,
                event: name,
            }
        }
        Ok(handled @ (Handled::NothingToDo | Handled::AlreadyRecorded)) => {
            match store::finish(&ctx.db, key, &token, None).await {
                Ok(true) if handled == Handled::AlreadyRecorded => {
                    ctx.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
                    Outcome::Duplicate {
                        id: event.id,
                        event: name,
                    }
                }
                Ok(true) => {
                    ctx.metrics.handled.fetch_add(1, Ordering::Relaxed);
                    Outcome::Handled {
                        id: event.id,
                        event: name,
                    }
                }
                // Another delivery took the claim over: it decides.
                Ok(false) => Outcome::Busy(event.id),
                Err(error) => transient(format!("handled, but cannot mark it: {error}")),
            }
        }
        Err(InboundError::Permanent(reason)) => {
            match store::finish(&ctx.db, key, &token, Some(&reason)).await {
                Ok(true) => {}
                Ok(false) => return Outcome::Busy(event.id),
                Err(error) => tracing::error!(%error, "cannot mark a refused message"),
            }
            dead(subject, id, tenant, reason.clone()).await;
            Outcome::Rejected(reason)
        }
        Err(InboundError::Transient(reason)) => {
            if let Err(error) = store::release(&ctx.db, key, &token).await {
                tracing::warn!(%error, "cannot release a claim; it expires with its lease");
            }
            transient(reason)
        }
    }
}

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
    BrokenRule, DecodeError, Heard, InboundClash, InboundEvent, InboundKind, InboundKinds,
};
pub use ferry_domain::cloudevent::{Accepted, IntakeError, Poster};
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
    /// The typed event ([`Heard::get`] reads its payload).
    pub event: Heard,
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
    /// The events it hears: nothing else is accepted, and the NATS consumers consume their
    /// subjects.
    fn kinds(&self) -> InboundKinds;

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
    /// The events it hears (the handler's, read once).
    pub kinds: InboundKinds,
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
            kinds: handler.kinds(),
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
) -> Result<Accepted, IntakeError> {
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
        Outcome::Malformed(r) => Err(IntakeError::Malformed(r)),
        Outcome::Rejected(r) => Err(IntakeError::Rejected(r)),
        Outcome::Forbidden(r) => Err(IntakeError::Forbidden(r)),
        Outcome::Busy(id) => Err(IntakeError::InProgress(id)),
        Outcome::Transient(r) => Err(IntakeError::Unavailable(r)),
    }
}

/// The actor recorded for a NATS message's effects.
fn nats_actor(source: &str) -> Actor {
    let name: String = format!("nats:{source}").chars().take(256).collect();
    Actor::parse(name).unwrap_or_else(|_| {
        Actor::parse("nats:unnamed-source").expect("a constant actor name is valid")
    })
}

/// One message as it arrived: where it came from, and how to dead-letter it.
struct Delivery<'a> {
    ctx: &'a InboundContext,
    via: &'static str,
    body: &'a [u8],
}

impl Delivery<'_> {
    /// Records the message as a dead letter with `reason` (and gives the reason back).
    async fn dead(
        &self,
        subject: &str,
        id: Option<&str>,
        tenant: Option<&str>,
        reason: String,
    ) -> String {
        self.ctx
            .metrics
            .dead_lettered
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(via = self.via, %subject, id = ?id, %reason, "inbound message dead-lettered");
        let letter = DeadLetter {
            via: self.via,
            subject,
            message_id: id,
            tenant_id: tenant,
            reason: &reason,
            payload: self.body,
        };
        if let Err(error) = store::dead_letter(&self.ctx.db, &letter).await {
            // Still terminated: redelivering a malformed message cannot fix it.
            tracing::error!(%error, "cannot record a dead letter");
        }
        reason
    }
}

/// A message identified, trusted and decoded: ready to be claimed and handled.
struct Admitted {
    event: CloudEvent,
    /// The event's name.
    name: &'static str,
    /// The NATS subject, or the CloudEvent type over HTTP.
    subject: String,
    /// The CloudEvent's `tenantid`, equal to the payload's tenant.
    tenant: String,
    heard: Heard,
}

/// Parses, identifies, trusts and decodes the message; the outcome when it goes no further.
async fn admit(
    delivery: &Delivery<'_>,
    nats_subject: Option<&str>,
    poster: Option<&Poster>,
) -> Result<Admitted, Outcome> {
    let ctx = delivery.ctx;
    let caller_tenant = poster.map(|p| p.tenant.as_str());
    let event = match CloudEvent::parse(delivery.body) {
        Ok(e) => e,
        Err(e) => {
            let subject = nats_subject.unwrap_or("http:/factory/events");
            let reason = delivery
                .dead(subject, None, caller_tenant, e.to_string())
                .await;
            return Err(Outcome::Malformed(reason));
        }
    };
    let tenant = event.tenantid.clone().unwrap_or_default();
    if caller_tenant.is_some_and(|caller| caller != tenant) {
        ctx.metrics.forbidden.fetch_add(1, Ordering::Relaxed);
        return Err(Outcome::Forbidden(format!(
            "the event belongs to tenant {tenant:?}, not to the caller's tenant"
        )));
    }
    let subject = nats_subject.unwrap_or(&event.event_type).to_string();
    let dead = |reason: String| async {
        let reason = delivery
            .dead(&subject, Some(&event.id), Some(&tenant), reason)
            .await;
        Outcome::Malformed(reason)
    };
    let Some(kind) = ctx.kinds.find(&subject) else {
        return Err(dead(format!("unknown event type {subject:?}")).await);
    };
    let name = kind.name();
    // Over NATS the subject decides; a `type` naming another known event is a contradiction.
    if let Some(other) = ctx
        .kinds
        .find(&event.event_type)
        .filter(|o| o.name() != name)
    {
        let reason = format!(
            "type {:?} ({}) does not match subject {subject:?} ({name})",
            event.event_type,
            other.name()
        );
        return Err(dead(reason).await);
    }
    trust(delivery, kind, &event, poster, &subject).await?;
    let heard = match kind.decode(event.data.clone()) {
        Ok(heard) => heard,
        Err(e) => return Err(dead(e.to_string()).await),
    };
    if heard.tenant_id().as_str() != tenant {
        let reason = format!(
            "payload tenantId {:?} differs from the tenantid attribute {tenant:?}",
            heard.tenant_id().as_str()
        );
        return Err(dead(reason).await);
    }
    Ok(Admitted {
        event,
        name,
        subject,
        tenant,
        heard,
    })
}

/// Whether the event's source is trusted for it and, over HTTP, the poster may speak for
/// that source.
async fn trust(
    delivery: &Delivery<'_>,
    kind: &InboundKind,
    event: &CloudEvent,
    poster: Option<&Poster>,
    subject: &str,
) -> Result<(), Outcome> {
    let ctx = delivery.ctx;
    if let Err(untrusted) = ctx
        .trusted
        .check(kind.name(), kind.subject(), &event.source)
    {
        ctx.metrics.untrusted.fetch_add(1, Ordering::Relaxed);
        if poster.is_some() {
            // The caller is told; nothing to keep for an operator.
            return Err(Outcome::Forbidden(untrusted.to_string()));
        }
        let tenant = event.tenantid.as_deref();
        let reason = delivery
            .dead(subject, Some(&event.id), tenant, untrusted.to_string())
            .await;
        return Err(Outcome::Rejected(reason));
    }
    // Over HTTP the body's `source` is only a claim: the token's subject must be bound to it.
    if let Some(p) = poster {
        if let Err(untrusted) = ctx.trusted.check_poster(&event.source, &p.actor) {
            ctx.metrics.untrusted.fetch_add(1, Ordering::Relaxed);
            return Err(Outcome::Forbidden(untrusted.to_string()));
        }
    }
    Ok(())
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
    let delivery = Delivery { ctx, via, body };
    let admitted = match admit(&delivery, nats_subject, poster).await {
        Ok(admitted) => admitted,
        Err(outcome) => return outcome,
    };
    let event = &admitted.event;
    let key = MessageKey {
        tenant: &admitted.tenant,
        source: &event.source,
        id: &event.id,
    };
    let token = match store::claim(&ctx.db, key, admitted.name, ctx.lease).await {
        Ok(Claim::Claimed(token)) => token,
        Ok(Claim::Done) => {
            ctx.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
            return Outcome::Duplicate {
                id: event.id.clone(),
                event: admitted.name,
            };
        }
        Ok(Claim::Rejected(reason)) => {
            ctx.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
            return Outcome::Rejected(reason);
        }
        Ok(Claim::Busy) => return Outcome::Busy(event.id.clone()),
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
        tenant_id: admitted.heard.tenant_id().clone(),
        subject: admitted.subject.clone(),
        time: event.time,
        correlation_id: event.correlationid.clone(),
        via,
        actor: poster.map_or_else(|| nats_actor(&event.source), |p| p.actor.clone()),
        mark: store::handled_mark(&ctx.db, key, &token),
        event: admitted.heard.clone(),
    };
    let result = match tokio::time::timeout(ctx.lease, ctx.handler.handle(envelope)).await {
        Ok(r) => r,
        Err(_) => Err(InboundError::Transient("the handler timed out".to_string())),
    };
    conclude(&delivery, &admitted, key, &token, result).await
}

/// Records how the handler dealt with a claimed message and says what to answer.
async fn conclude(
    delivery: &Delivery<'_>,
    admitted: &Admitted,
    key: MessageKey<'_>,
    token: &str,
    result: Result<Handled, InboundError>,
) -> Outcome {
    let ctx = delivery.ctx;
    let id = admitted.event.id.clone();
    let event = admitted.name;
    let transient = |reason: String| {
        ctx.metrics
            .transient_failures
            .fetch_add(1, Ordering::Relaxed);
        Outcome::Transient(reason)
    };
    match result {
        Ok(Handled::Recorded) => {
            ctx.metrics.handled.fetch_add(1, Ordering::Relaxed);
            Outcome::Handled { id, event }
        }
        Ok(handled @ (Handled::NothingToDo | Handled::AlreadyRecorded)) => {
            match store::finish(&ctx.db, key, token, None).await {
                Ok(true) if handled == Handled::AlreadyRecorded => {
                    ctx.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
                    Outcome::Duplicate { id, event }
                }
                Ok(true) => {
                    ctx.metrics.handled.fetch_add(1, Ordering::Relaxed);
                    Outcome::Handled { id, event }
                }
                // Another delivery took the claim over: it decides.
                Ok(false) => Outcome::Busy(id),
                Err(error) => transient(format!("handled, but cannot mark it: {error}")),
            }
        }
        Err(InboundError::Permanent(reason)) => {
            match store::finish(&ctx.db, key, token, Some(&reason)).await {
                Ok(true) => {}
                Ok(false) => return Outcome::Busy(id),
                Err(error) => tracing::error!(%error, "cannot mark a refused message"),
            }
            let reason = delivery
                .dead(&admitted.subject, Some(&id), Some(&admitted.tenant), reason)
                .await;
            Outcome::Rejected(reason)
        }
        Err(InboundError::Transient(reason)) => {
            if let Err(error) = store::release(&ctx.db, key, token).await {
                tracing::warn!(%error, "cannot release a claim; it expires with its lease");
            }
            transient(reason)
        }
    }
}

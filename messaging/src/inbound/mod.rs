//! Events Ferry reacts to, over NATS (durable pull consumers) or HTTP
//! (`POST /factory/events`, [`accept_cloud_event`]), with one validation, dedupe and
//! dead-letter path for both.
//!
//! For each message: parse the CloudEvent, identify the event (NATS subject, or the
//! CloudEvent `type` over HTTP: the subject or the event name), decode the typed payload,
//! check that the payload's tenant is the envelope's, claim the message id in
//! `inbound_messages`, call the [`InboundHandler`], and mark it `done`. A malformed or unknown
//! message, or one the handler refuses for good, is dead-lettered with its reason and
//! terminated (never redelivered); a transient failure gives the claim back and is retried.
//!
//! Exactly-once effect: the mark and the handler's commands are in different transactions,
//! so a crash right after the handler succeeded leaves the claim `processing`; after its
//! lease the message is handled again. Handlers must therefore be idempotent (e.g. derive
//! command ids from [`InboundEnvelope::id`]); the table guarantees that a message marked
//! handled never reaches the handler again and that two deliveries never run at once.

mod events;
mod nats;
pub mod store;

pub use events::{
    inbound_name, ApprovalDecided, ApprovalDecision, EnvironmentCreated, EnvironmentStateChanged,
    InboundEvent, PromotionApproved, ReleaseReady, ReleaseWithdrawn, INBOUND,
};
pub use nats::{Inbound, InboundConfig, InboundStartError};

use crate::cloudevent::CloudEvent;
use chrono::{DateTime, Utc};
use ferry_domain::TenantId;
use ferry_store::Database;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use store::{Claim, DeadLetter};

/// One inbound event handed to the integrator.
#[derive(Debug, Clone, PartialEq)]
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
    /// The typed event.
    pub event: InboundEvent,
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

/// What the integrator implements: apply one inbound event. Must be idempotent per
/// [`InboundEnvelope::id`] (see the module documentation).
#[async_trait::async_trait]
pub trait InboundHandler: Send + Sync {
    /// Applies the event.
    async fn handle(&self, event: InboundEnvelope) -> Result<(), InboundError>;
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
}

impl InboundMetrics {
    /// The counters in Prometheus text format.
    pub fn render(&self) -> String {
        let rows = [
            (
                "ferry_inbound_received_total",
                "Inbound messages received (NATS and HTTP).",
                &self.received,
            ),
            (
                "ferry_inbound_handled_total",
                "Inbound messages applied.",
                &self.handled,
            ),
            (
                "ferry_inbound_duplicates_total",
                "Redelivered or re-posted messages without effect.",
                &self.duplicates,
            ),
            (
                "ferry_inbound_dead_lettered_total",
                "Malformed, unknown or refused messages.",
                &self.dead_lettered,
            ),
            (
                "ferry_inbound_transient_failures_total",
                "Transient failures (retried).",
                &self.transient_failures,
            ),
            (
                "ferry_inbound_forbidden_total",
                "HTTP events of another tenant than the caller's.",
                &self.forbidden,
            ),
        ];
        let mut out = String::new();
        for (name, help, value) in rows {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
                value.load(Ordering::Relaxed)
            ));
        }
        out
    }
}

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
}

impl InboundContext {
    /// A context with a five-minute lease.
    pub fn new(db: Database, handler: Arc<dyn InboundHandler>) -> Self {
        Self {
            db,
            handler,
            metrics: Arc::new(InboundMetrics::default()),
            lease: Duration::from_secs(300),
        }
    }
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
    /// The CloudEvent's tenant is not the caller's: 403.
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

/// Accepts a CloudEvent posted over HTTP (`POST /factory/events`) by a caller whose token
/// names `tenant_from_token`: same validation, dedupe and dead-lettering as NATS.
pub async fn accept_cloud_event(
    ctx: &InboundContext,
    tenant_from_token: &str,
    body: &[u8],
) -> Result<Accepted, AcceptError> {
    match process(ctx, "http", None, Some(tenant_from_token), body).await {
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

/// Processes one message. `nats_subject` is set for NATS deliveries; `caller_tenant` for
/// HTTP posts.
pub(crate) async fn process(
    ctx: &InboundContext,
    via: &'static str,
    nats_subject: Option<&str>,
    caller_tenant: Option<&str>,
    body: &[u8],
) -> Outcome {
    ctx.metrics.received.fetch_add(1, Ordering::Relaxed);
    let fallback_subject = nats_subject.unwrap_or("http:/factory/events");
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
    match store::claim(
        &ctx.db,
        &tenant_attr,
        &event.id,
        &event.source,
        name,
        ctx.lease,
    )
    .await
    {
        Ok(Claim::Claimed) => {}
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
    }
    let envelope = InboundEnvelope {
        id: event.id.clone(),
        source: event.source.clone(),
        tenant_id,
        subject: subject.clone(),
        time: event.time,
        correlation_id: event.correlationid.clone(),
        via,
        event: typed,
    };
    let result = match tokio::time::timeout(ctx.lease, ctx.handler.handle(envelope)).await {
        Ok(r) => r,
        Err(_) => Err(InboundError::Transient("the handler timed out".to_string())),
    };
    match result {
        Ok(()) => match store::finish(&ctx.db, &tenant_attr, &event.id, None).await {
            Ok(()) => {
                ctx.metrics.handled.fetch_add(1, Ordering::Relaxed);
                Outcome::Handled {
                    id: event.id,
                    event: name,
                }
            }
            Err(error) => {
                // The effect happened; the claim stays `processing` and after its lease a
                // redelivery reaches the (idempotent) handler again.
                ctx.metrics
                    .transient_failures
                    .fetch_add(1, Ordering::Relaxed);
                Outcome::Transient(format!("handled, but cannot mark it: {error}"))
            }
        },
        Err(InboundError::Permanent(reason)) => {
            if let Err(error) = store::finish(&ctx.db, &tenant_attr, &event.id, Some(&reason)).await
            {
                tracing::error!(%error, "cannot mark a refused message");
            }
            dead(subject, id, tenant, reason.clone()).await;
            Outcome::Rejected(reason)
        }
        Err(InboundError::Transient(reason)) => {
            ctx.metrics
                .transient_failures
                .fetch_add(1, Ordering::Relaxed);
            if let Err(error) = store::release(&ctx.db, &tenant_attr, &event.id).await {
                tracing::warn!(%error, "cannot release a claim; it expires with its lease");
            }
            Outcome::Transient(reason)
        }
    }
}

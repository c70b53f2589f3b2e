//! What the HTTP API needs from the rest of the process, as traits the application crate
//! (`ferry-app`) implements: taking in other services' events, the live event stream, and
//! the process's telemetry. They keep this crate free of NATS, workers and adapters (see
//! ARCHITECTURE.md, "Crates and what each may depend on").

use axum::response::sse::Event;
use ferry_domain::{Actor, TenantId};
use ferry_store::stream::SubscriptionStatus;
use futures::stream::BoxStream;
use std::convert::Infallible;

/// Who posted an event over HTTP: the verified token's tenant and subject.
#[derive(Debug, Clone)]
pub struct Poster {
    /// The token's tenant: the event must be for it.
    pub tenant: TenantId,
    /// The token's subject: the actor of the event's effects.
    pub actor: Actor,
}

/// An event taken in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// The CloudEvent id.
    pub id: String,
    /// The event name (`ReleaseReady`, …).
    pub event: String,
    /// True when the id was handled before (nothing happened this time).
    pub duplicate: bool,
}

/// Why an event posted over HTTP was not taken in; each variant is one HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    /// Not a valid CloudEvent or payload, or an unknown type: 400.
    #[error("malformed event: {0}")]
    Malformed(String),
    /// Another tenant's event, or an untrusted source: 403.
    #[error("{0}")]
    Forbidden(String),
    /// A domain rule refused it: 422.
    #[error("event refused: {0}")]
    Rejected(String),
    /// The same id is being handled right now: 409, retry later.
    #[error("event {0} is being handled; retry later")]
    InProgress(String),
    /// The store did not answer: 503.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
}

/// `POST /factory/events`: the same validation, de-duplication and dead-lettering as the
/// NATS consumers.
#[async_trait::async_trait]
pub trait EventIntake: Send + Sync {
    /// Takes in one structured-JSON CloudEvent from `poster`.
    async fn accept(&self, poster: &Poster, body: &[u8]) -> Result<Accepted, IntakeError>;
}

/// `GET /factory/events/stream`: the caller's tenant's events as Server-Sent Events.
pub trait EventFeed: Send + Sync {
    /// True when `text` is a stream position (an event's SSE id).
    fn is_position(&self, text: &str) -> bool;
    /// The events of `tenant` after the `Last-Event-ID` header if it parses, else after
    /// `after`, else from the beginning; it ends only when the client goes away.
    fn stream(
        &self,
        tenant: &TenantId,
        last_event_id: Option<&str>,
        after: Option<&str>,
    ) -> BoxStream<'static, Result<Event, Infallible>>;
}

/// What `/readyz` adds to the store's own report.
#[derive(Debug, Default, Clone)]
pub struct Readiness {
    /// Lines an operator must look at (each makes the service `degraded`).
    pub problems: Vec<String>,
    /// The NATS relay's and inbound consumers' report, when NATS is configured.
    pub nats: Option<serde_json::Value>,
    /// Who may post which inbound events (`inboundTrust`): open to every service token by
    /// default, or the trusted sources and the identities bound to them.
    pub inbound_trust: Option<serde_json::Value>,
}

/// The process's counters and the state of its background parts.
pub trait Telemetry: Send + Sync {
    /// A run of `kind` of `tenant` reached `state` (counted for `/metrics`).
    fn run_reached(&self, tenant: &str, kind: &str, state: &str);
    /// Every metric as Prometheus text; the subscriptions' positions when the store answered.
    fn render(&self, subscriptions: Option<&[SubscriptionStatus]>) -> String;
    /// The background parts' problems and report for `/readyz`.
    fn readiness(&self, subscriptions: &[SubscriptionStatus]) -> Readiness;
}

//! What the HTTP API needs from the rest of the process, as traits the application crate
//! (`ferry-app`) implements: taking in other services' events, the live event stream, and
//! the process's telemetry. They keep this crate free of NATS, workers and adapters (see
//! ARCHITECTURE.md, "Crates and what each may depend on").

use axum::response::sse::Event;
use ferry_domain::TenantId;
use ferry_store::stream::SubscriptionStatus;
use futures::stream::BoxStream;
use std::convert::Infallible;

pub use ferry_domain::cloudevent::{Accepted, IntakeError, Poster};

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
    /// As [`EventFeed::stream`], without event names (for a browser's `EventSource`).
    fn stream_unnamed(
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

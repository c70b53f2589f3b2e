//! The API's event ports over the messaging crate: `POST /factory/events` goes through the
//! same inbound processing as the NATS consumers, and `GET /factory/events/stream` is the
//! SSE reader of the global stream.

use axum::response::sse::Event;
use ferry_api::ports::{Accepted, EventFeed, EventIntake, IntakeError, Poster};
use ferry_domain::TenantId;
use ferry_messaging::inbound::InboundContext;
use ferry_store::Database;
use futures::stream::{BoxStream, StreamExt};
use std::convert::Infallible;

/// Events posted over HTTP, handled like NATS deliveries.
pub struct Intake {
    inbound: InboundContext,
}

impl Intake {
    /// Intake through `inbound` (shared with the NATS consumers).
    pub fn new(inbound: InboundContext) -> Self {
        Self { inbound }
    }
}

#[async_trait::async_trait]
impl EventIntake for Intake {
    async fn accept(&self, poster: &Poster, body: &[u8]) -> Result<Accepted, IntakeError> {
        ferry_messaging::inbound::accept_cloud_event(&self.inbound, poster, body).await
    }
}

/// The live event stream of one tenant, from the store.
pub struct Feed {
    db: Database,
    publishers: ferry_messaging::Publishers,
}

impl Feed {
    /// A feed over `db`, each event made by `publishers` as the relay would publish it.
    pub fn new(db: Database, publishers: ferry_messaging::Publishers) -> Self {
        Self { db, publishers }
    }
}

impl EventFeed for Feed {
    fn is_position(&self, text: &str) -> bool {
        ferry_messaging::parse_position(text).is_some()
    }

    fn stream(
        &self,
        tenant: &TenantId,
        last_event_id: Option<&str>,
        after: Option<&str>,
    ) -> BoxStream<'static, Result<Event, Infallible>> {
        ferry_messaging::sse_stream(
            self.db.clone(),
            self.publishers.clone(),
            tenant.to_string(),
            ferry_messaging::start_position(last_event_id, after),
            self.db.subscribe_commits(),
        )
        .boxed()
    }

    fn stream_unnamed(
        &self,
        tenant: &TenantId,
        last_event_id: Option<&str>,
        after: Option<&str>,
    ) -> BoxStream<'static, Result<Event, Infallible>> {
        ferry_messaging::sse::sse_stream_unnamed(
            self.db.clone(),
            self.publishers.clone(),
            tenant.to_string(),
            ferry_messaging::start_position(last_event_id, after),
            self.db.subscribe_commits(),
        )
        .boxed()
    }
}

//! Bounded contexts: each declares, in one place, everything the process collects from it
//! (ARCHITECTURE.md, Adding an aggregate).
//!
//! A [`BoundedContext`] names the aggregates it stores, its routes with their
//! documentation, its projections, its publishers (the subjects and payloads of its events,
//! with their schemas), the events it hears with its handler, and the background work it
//! starts. [`Contexts`] collects them: the
//! router and the OpenAPI document are built from every context's routes, the projector
//! runs every context's projections, the relay and the SSE stream publish through every
//! context's publishers, the events each context declares it hears are consumed and go to
//! its handler, and `ferry schemas` documents them all. No other list exists.

pub mod promotions;
pub mod provisioning;

use crate::config::Config;
use crate::inbound::{ContextInbound, InboundParts};
use crate::server::StartError;
use aide::axum::ApiRouter;
use ferry_api::state::AppState;
use ferry_api::Api;
use ferry_messaging::{InboundClash, InboundKind, InboundKinds, Publishers};
use ferry_projections::Projection;
use ferry_store::Database;
use std::sync::Arc;
use tokio::sync::watch;

pub use promotions::Promotions;
pub use provisioning::Provisioning;

/// What a context's background work is started with: the process's shared parts.
pub struct Process<'a> {
    /// The store.
    pub db: &'a Database,
    /// The configuration.
    pub config: &'a Config,
    /// The adapters (runner, programs, secrets, policy, artifacts).
    pub ports: &'a crate::contexts::provisioning::work::Ports,
    /// The work counters (`/metrics`).
    pub metrics: &'a Arc<crate::contexts::provisioning::work::metrics::Metrics>,
    /// The process's metrics registry, for a context's own families.
    pub registry: &'a prometheus::Registry,
    /// Flips to true at shutdown.
    pub shutdown: &'a watch::Receiver<bool>,
    /// The reloadable settings, as they are now (a reload sends the new ones).
    pub options: &'a watch::Receiver<crate::config::Reloadable>,
}

/// One bounded context: its aggregates, routes, projections, publishers and background work.
pub trait BoundedContext: Send + Sync {
    /// Its name, for logs.
    fn name(&self) -> &'static str;

    /// Makes the aggregates it stores known to every reader of the stream
    /// (`ferry_store::events::register::<A>()` for each): an event of an aggregate no
    /// context registers stops the subscriptions that meet it.
    fn register_aggregates(&self);

    /// Its routes, each declared with its documentation (the OpenAPI document follows).
    fn routes(&self) -> ApiRouter<AppState>;

    /// Its read models, each with its tables and checkpoint.
    fn projections(&self) -> Vec<Arc<dyn Projection>>;

    /// What its aggregates' events become on NATS and the SSE stream, and their schemas.
    fn publishers(&self) -> Publishers;

    /// The token scopes its routes name (for `ferry token`). None by default.
    fn scopes(&self) -> &'static [&'static str] {
        &[]
    }

    /// The events of other services it hears (`InboundKind::of::<Payload>()` for each):
    /// their names, subjects, payload types and rules. Its [`inbound`](Self::inbound)
    /// handler gets them. None by default.
    fn inbound_events(&self) -> Vec<InboundKind> {
        Vec::new()
    }

    /// Its handler of the events it declares in
    /// [`inbound_events`](Self::inbound_events). None by default.
    fn inbound(&self, parts: &InboundParts) -> Option<Arc<dyn ContextInbound>> {
        let _ = parts;
        None
    }

    /// Starts its background work (workers, the subscriptions that enqueue their steps).
    /// Nothing by default.
    fn start(&self, process: &Process<'_>) -> Result<(), StartError> {
        let _ = process;
        Ok(())
    }
}

/// The contexts a process runs.
#[derive(Clone)]
pub struct Contexts(Vec<Arc<dyn BoundedContext>>);

impl Contexts {
    /// Ferry's own contexts.
    pub fn builtin() -> Self {
        Self(vec![Arc::new(Provisioning), Arc::new(Promotions)])
    }

    /// These and `context`.
    pub fn with(mut self, context: Arc<dyn BoundedContext>) -> Self {
        self.0.push(context);
        self
    }

    /// Makes every context's aggregates known.
    pub fn register_aggregates(&self) {
        for context in &self.0 {
            context.register_aggregates();
        }
    }

    /// Every scope a token may carry: the process's and every context's.
    pub fn scopes(&self) -> Vec<&'static str> {
        let mut scopes = ferry_api::auth::SCOPES.to_vec();
        for scope in self.0.iter().flat_map(|c| c.scopes().iter().copied()) {
            if !scopes.contains(&scope) {
                scopes.push(scope);
            }
        }
        scopes
    }

    /// Every context's projections.
    pub fn projections(&self) -> Vec<Arc<dyn Projection>> {
        self.0.iter().flat_map(|c| c.projections()).collect()
    }

    /// Every context's publishers.
    pub fn publishers(&self) -> Publishers {
        self.0
            .iter()
            .fold(Publishers::new(), |all, c| all.extend(c.publishers()))
    }

    /// The process's routes and every context's, with the OpenAPI document built from them.
    pub fn api(&self) -> Api {
        Api::build(|| {
            self.0
                .iter()
                .fold(ApiRouter::new(), |all, c| all.merge(c.routes()))
        })
    }

    /// Every event some context hears, each once; refused when two contexts name one event
    /// or subject with different payload types.
    pub fn inbound_kinds(&self) -> Result<InboundKinds, InboundClash> {
        InboundKinds::new(self.0.iter().flat_map(|c| c.inbound_events()))
    }

    /// The handler of inbound events: every context's, with the events each declares.
    pub fn inbound(
        &self,
        parts: &InboundParts,
    ) -> Result<crate::inbound::FerryInbound, InboundClash> {
        crate::inbound::FerryInbound::new(
            self.0
                .iter()
                .filter_map(|c| Some((c.inbound_events(), c.inbound(parts)?)))
                .collect(),
        )
    }

    /// Starts every context's background work.
    pub fn start(&self, process: &Process<'_>) -> Result<(), StartError> {
        for context in &self.0 {
            context.start(process)?;
            tracing::debug!(context = context.name(), "started");
        }
        Ok(())
    }

    /// Every file `ferry schemas` writes (relative to `schemas/`): the OpenAPI document and
    /// the message schemas with the AsyncAPI document.
    pub fn published_schemas(&self) -> Result<Vec<(String, String)>, InboundClash> {
        let mut files = vec![("openapi.json".to_string(), self.api().document_text())];
        files.extend(ferry_messaging::published_schemas(
            &self.publishers(),
            &self.inbound_kinds()?,
        ));
        Ok(files)
    }
}

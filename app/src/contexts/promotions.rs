//! The promotions context: releases Ferry may promote, and promotions of a release into an
//! environment through ordered gates with their evidence (ARCHITECTURE.md, Bounded
//! contexts).
//!
//! * [`views`]: the `delivery` projection (releases, promotions, completions) and its
//!   queries;
//! * [`use_cases`]: what a caller may do (record, request, decide, roll back, conclude,
//!   lift), whichever transport asks;
//! * [`routes`]: the delivery API (HTTP), translating to the use cases;
//! * [`events`]: what promotions publish (`releases.promotions.v1.*` and domain events);
//! * [`metrics`]: the promotion counters and lead-time histogram;
//! * [`verification`]: the health, smoke and SLO checks after an apply;
//! * [`probe`]: the client those checks probe tenants' URLs with (public addresses only);
//! * [`environments`]: `GET /factory/environments`, what runs where;
//! * [`driver`]: the worker that queues promotions per environment and evaluates their
//!   gates.
//!

pub mod driver;
pub mod environments;
pub mod events;
pub mod inbound;
pub mod metrics;
pub mod probe;
pub mod routes;
pub mod use_cases;
pub mod verification;
pub mod views;

use super::{BoundedContext, Process};
use crate::server::StartError;
use aide::axum::ApiRouter;
use ferry_api::state::AppState;
use ferry_domain::promotion::Promotion;
use ferry_domain::release::Release;
use ferry_messaging::{DomainEvents, Publishers};
use ferry_projections::Projection;
use ferry_store::events::register;
use std::sync::Arc;

/// Reading releases and promotions.
pub const READ: &str = "factory.delivery.read";
/// Requesting promotions (the deploy-environment tool, Operators, workspace admins).
pub const PROMOTE: &str = "factory.delivery.promote";
/// Rolling back (Operators).
pub const OPERATE: &str = "factory.delivery.operate";

/// Releases and promotions.
pub struct Promotions;

impl BoundedContext for Promotions {
    fn name(&self) -> &'static str {
        "promotions"
    }

    fn register_aggregates(&self) {
        register::<Release>();
        register::<Promotion>();
    }

    fn routes(&self) -> ApiRouter<AppState> {
        routes::routes()
    }

    fn projections(&self) -> Vec<Arc<dyn Projection>> {
        vec![Arc::new(views::DeliveryProjection)]
    }

    fn publishers(&self) -> Publishers {
        Publishers::new()
            .with(Arc::new(DomainEvents::<Release>::new()))
            .with(Arc::new(events::PromotionPublisher))
    }

    fn scopes(&self) -> &'static [&'static str] {
        &routes::SCOPES
    }

    fn inbound_events(&self) -> Vec<ferry_messaging::InboundKind> {
        inbound::events()
    }

    fn inbound(
        &self,
        parts: &crate::inbound::InboundParts,
    ) -> Option<Arc<dyn crate::inbound::ContextInbound>> {
        Some(Arc::new(inbound::PromotionsInbound::new(parts)))
    }

    fn start(&self, process: &Process<'_>) -> Result<(), StartError> {
        if let Some(metrics) = metrics::metrics() {
            metrics.register(process.registry)?;
        }
        if process.config.workers {
            let policy = ferry_adapters::RegoPolicy::load(process.config.policy_dir.as_deref())?;
            Arc::new(driver::Driver::new(
                process.db.clone(),
                Arc::new(policy),
                driver::DriverSettings {
                    options: process.options.clone(),
                    prometheus_url: process.config.prometheus_url.clone(),
                    confinement: Arc::new(process.config.confinement()?),
                    approval_expiry: process.config.approval_expiry,
                    poll: process.config.poll_interval,
                },
            ))
            .start(process.shutdown.clone());
        }
        Ok(())
    }
}

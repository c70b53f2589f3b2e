//! The promotions context: releases Ferry may promote, and promotions of a release into an
//! environment through ordered gates with their evidence (ARCHITECTURE.md, Bounded
//! contexts).
//!
//! * [`views`]: the `delivery` projection (releases, promotions, completions) and its
//!   queries;
//! * [`routes`]: the delivery API;
//! * [`driver`]: the worker that queues promotions per environment and evaluates their
//!   gates.
//!
//! Built so far: recording releases, requesting promotions, the queue (one promotion per
//! environment), the five gates, the rejection of a withdrawn release's promotions, the
//! hand-off to provisioning and health verification of promotions that need no approval.
//! The production approval and rollback are the aggregate's (`ferry_domain::promotion`) but
//! not yet driven here.

pub mod driver;
pub mod routes;
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
        // Domain events for now; the seed's `releases.promotions.v1.*` integration payloads
        // come with the hand-off to provisioning.
        Publishers::new()
            .with(Arc::new(DomainEvents::<Release>::new()))
            .with(Arc::new(DomainEvents::<Promotion>::new()))
    }

    fn scopes(&self) -> &'static [&'static str] {
        &routes::SCOPES
    }

    fn start(&self, process: &Process<'_>) -> Result<(), StartError> {
        if process.config.workers {
            let policy = ferry_adapters::RegoPolicy::load(process.config.policy_dir.as_deref())?;
            Arc::new(driver::Driver::new(
                process.db.clone(),
                Arc::new(policy),
                driver::DriverSettings {
                    path: process.config.promotion_path.clone(),
                    auto_rollback: process.config.auto_rollback,
                    verification_window: process.config.verification_window,
                    approval_expiry: process.config.approval_expiry,
                    poll: process.config.poll_interval,
                },
            ))
            .start(process.shutdown.clone());
        }
        Ok(())
    }
}

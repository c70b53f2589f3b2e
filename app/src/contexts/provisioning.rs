//! The provisioning context: desired-state specifications, environments and provisioning
//! runs (ARCHITECTURE.md, Bounded contexts). Its aggregates live in the domain crate; this
//! folder holds the rest:
//!
//! * [`views`]: its read models (specifications, runs, environments' specifications), their
//!   projections and queries;
//! * [`use_cases`]: declaring specifications, requesting plans, cancelling runs and deciding
//!   their approvals, reading specifications, runs and logs, whichever transport asks;
//! * [`environments`]: recording environments, reading them, deciding class lowerings;
//! * [`routes`]: the provisioning and environment API (HTTP), translating to the use cases;
//! * [`events`]: what provisioning publishes (`provisioning.*.v1.*` and domain events);
//! * [`reconcile`]: the GitOps reconciler;
//! * [`drift`]: the environments' ignore rules it applies;
//! * [`inbound`]: what it does with other services' events;
//! * [`work`]: the planner, applier, baseline and expiry steps the workers run.

pub mod drift;
pub mod environments;
pub mod events;
pub mod inbound;
pub mod payloads;
pub mod reconcile;
pub mod routes;
pub mod use_cases;
pub mod views;
pub mod work;

use super::{BoundedContext, Process};
use crate::server::{worker_settings, StartError};
use aide::axum::ApiRouter;
use ferry_api::state::AppState;
use ferry_domain::environment::Environment;
use ferry_domain::run::ProvisioningRun;
use ferry_domain::specification::DeploymentSpecification;
use ferry_messaging::Publishers;
use ferry_projections::Projection;
use ferry_store::events::register;
use std::sync::Arc;

/// Specifications, environments and runs; the plan, apply, baseline and expiry workers.
pub struct Provisioning;

impl BoundedContext for Provisioning {
    fn name(&self) -> &'static str {
        "provisioning"
    }

    fn register_aggregates(&self) {
        register::<DeploymentSpecification>();
        register::<ProvisioningRun>();
        register::<Environment>();
        register::<ferry_domain::drift::DriftIgnoreRules>();
    }

    fn routes(&self) -> ApiRouter<AppState> {
        routes::routes()
            .merge(reconcile::routes())
            .merge(drift::routes())
    }

    fn projections(&self) -> Vec<Arc<dyn Projection>> {
        views::provisioning_projections()
    }

    fn publishers(&self) -> Publishers {
        events::publishers()
    }

    fn inbound_events(&self) -> Vec<ferry_messaging::InboundKind> {
        inbound::events()
    }

    fn inbound(
        &self,
        parts: &crate::inbound::InboundParts,
    ) -> Option<Arc<dyn crate::inbound::ContextInbound>> {
        Some(Arc::new(inbound::ProvisioningInbound::new(parts)))
    }

    fn start(&self, process: &Process<'_>) -> Result<(), StartError> {
        if process.config.workers {
            let mut settings = worker_settings(process.config);
            let identities = process.config.runner_identities()?;
            // Said once at start: the operator sees what tenants' programs will run as.
            if process.config.runner != crate::config::RunnerKind::Simulated {
                if identities.has_shared() {
                    tracing::warn!("FERRY_RUNNER_SHARED_IDENTITY is declared: every tenant without an identity of its own runs its program with the server's named variables (single-tenant installations only)");
                } else if identities.tenants().next().is_none() {
                    tracing::warn!("FERRY_RUNNER_IDENTITIES names no tenant: every plan fails until a tenant has a runner identity");
                }
            }
            settings.runner_identities = Arc::new(identities);
            settings.auto_apply_non_destructive =
                follow(process.options, |o| o.auto_apply_non_destructive);
            work::workers(
                process.db.clone(),
                process.ports.clone(),
                settings,
                process.metrics.clone(),
            )
            .start(process.shutdown.clone());
            if let Some(pattern) = &process.config.reconcile_schedule {
                // Checked when the configuration loaded.
                let schedule =
                    reconcile::Schedule::parse(pattern).map_err(|e| crate::ConfigError {
                        setting: "FERRY_RECONCILE_SCHEDULE".to_string(),
                        source_name: "configuration".to_string(),
                        reason: e.to_string(),
                    })?;
                reconcile::spawn_schedule(process.db.clone(), schedule, process.shutdown.clone());
            }
        }
        Ok(())
    }
}

/// A channel of one reloadable setting, following the process's reloadable settings (for
/// parts that know only that setting).
fn follow<T: Clone + PartialEq + Send + Sync + 'static>(
    options: &tokio::sync::watch::Receiver<crate::config::Reloadable>,
    pick: fn(&crate::config::Reloadable) -> T,
) -> tokio::sync::watch::Receiver<T> {
    let mut options = options.clone();
    let (tx, rx) = tokio::sync::watch::channel(pick(&options.borrow()));
    tokio::spawn(async move {
        // Ends when the server (the sender) or every reader is gone.
        while options.changed().await.is_ok() {
            let value = pick(&options.borrow_and_update());
            if tx.send(value).is_err() {
                break;
            }
        }
    });
    rx
}

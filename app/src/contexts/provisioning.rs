//! The provisioning context: desired-state specifications, environments and provisioning
//! runs. Its parts predate the registration and live in the layer crates (domain, api,
//! projections, workers, messaging); this module is where the process collects them.

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
    }

    fn routes(&self) -> ApiRouter<AppState> {
        ferry_api::provisioning_routes()
    }

    fn projections(&self) -> Vec<Arc<dyn Projection>> {
        ferry_projections::provisioning_projections()
    }

    fn publishers(&self) -> Publishers {
        Publishers::provisioning()
    }

    fn start(&self, process: &Process<'_>) -> Result<(), StartError> {
        if process.config.workers {
            ferry_workers::Workers::new(
                process.db.clone(),
                process.ports.clone(),
                worker_settings(process.config),
                process.metrics.clone(),
            )
            .start(process.shutdown.clone());
        }
        Ok(())
    }
}

//! The `workers` subscription: turns stored events into work items, in the same transaction
//! as its checkpoint, so no event is missed and none makes work twice.
//!
//! | event | work |
//! |---|---|
//! | `ProvisioningRequested` | plan the run |
//! | `ApplyStarted`, `ApprovalGranted` | apply the run |
//! | `ApprovalRequired` | reject it when the approval expires (if expiry is configured) |
//! | `EnvironmentRegistered` | declare and plan the environment's baseline |
//!
//! It reads runs and environments as typed events ([`ferry_store::events`]): one that does
//! not decode stops the subscription, which reports it and retries, rather than leaving
//! work undone.

use ferry_domain::environment::{Environment, EnvironmentEvent};
use ferry_domain::run::{ProvisioningRun, RunEvent, RunRequest};
use ferry_store::stream::{HandlerError, Tx};
use ferry_store::{Subscriber, Subscription, Typed};
use ferry_workers::queue::{enqueue, now_ms, Step};
use std::sync::Arc;
use std::time::Duration;

/// The subscription.
pub struct Enqueuer {
    /// How long an approval may wait before the run is rejected; `None` = forever.
    pub approval_expiry: Option<Duration>,
}

impl Enqueuer {
    /// The `workers` subscription: runs and environments make work.
    pub fn subscription(self) -> Subscription {
        let enqueuer = Arc::new(self);
        Subscription::new("workers")
            .on::<ProvisioningRun>(enqueuer.clone())
            .on::<Environment>(enqueuer)
    }
}

/// The event's correlation (kept from its metadata) and causation (the event itself).
fn correlation<E>(event: &Typed<E>) -> (Option<String>, Option<String>) {
    (
        event.metadata.correlation_id().map(str::to_string),
        Some(event.event_id.to_string()),
    )
}

/// The run's request: its first event.
async fn run_request(tx: &mut Tx, run_id: &str) -> Result<RunRequest, HandlerError> {
    match tx.first_event::<ProvisioningRun>(run_id).await? {
        Some(Typed {
            event: RunEvent::ProvisioningRequested(request),
            ..
        }) => Ok(*request),
        other => Err(HandlerError::Record {
            what: format!("the request of run {run_id}"),
            source: match other {
                Some(first) => format!("its first event is {}", first.event.stored_type().name),
                None => "the run has no events".to_string(),
            }
            .into(),
        }),
    }
}

/// The tenant and the environment key (`<tenant>/<environment>`) of a run's work.
fn work_keys(request: &RunRequest) -> (String, String) {
    let tenant = request.tenant_id.to_string();
    let environment_key = format!("{tenant}/{}", request.environment_id);
    (tenant, environment_key)
}

#[async_trait::async_trait]
impl Subscriber<ProvisioningRun> for Enqueuer {
    async fn on(&self, tx: &mut Tx, event: &Typed<RunEvent>) -> Result<(), HandlerError> {
        let (step, not_before, (tenant, environment_key)) = match &event.event {
            RunEvent::ProvisioningRequested(request) => (Step::Plan, now_ms(), work_keys(request)),
            RunEvent::ApplyStarted { .. } | RunEvent::ApprovalGranted(_) => {
                let request = run_request(tx, &event.aggregate_id).await?;
                (Step::Apply, now_ms(), work_keys(&request))
            }
            RunEvent::ApprovalRequired { .. } => {
                let Some(expiry) = self.approval_expiry else {
                    return Ok(());
                };
                let request = run_request(tx, &event.aggregate_id).await?;
                let required_at = event.recorded_at.timestamp_millis();
                let not_before = required_at + expiry.as_millis() as i64;
                (Step::Expiry, not_before, work_keys(&request))
            }
            _ => return Ok(()),
        };
        let (correlation_id, causation_id) = correlation(event);
        enqueue(
            tx,
            &event.aggregate_id,
            step,
            &tenant,
            &environment_key,
            not_before,
            correlation_id,
            causation_id,
        )
        .await?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Subscriber<Environment> for Enqueuer {
    async fn on(&self, tx: &mut Tx, event: &Typed<EnvironmentEvent>) -> Result<(), HandlerError> {
        let EnvironmentEvent::EnvironmentRegistered(registration) = &event.event else {
            return Ok(());
        };
        let (correlation_id, causation_id) = correlation(event);
        let tenant = registration.tenant_id.as_str();
        enqueue(
            tx,
            &event.aggregate_id,
            Step::Baseline,
            tenant,
            &format!("{tenant}/{}", registration.environment_id),
            now_ms(),
            correlation_id,
            causation_id,
        )
        .await?;
        Ok(())
    }
}

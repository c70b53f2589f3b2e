//! The `workers` subscription: turns stored events into work items, in the same transaction
//! as its checkpoint, so no event is missed and none makes work twice.
//!
//! | event | work |
//! |---|---|
//! | `ProvisioningRequested` | plan the run |
//! | `ApplyStarted`, `ApprovalGranted` | apply the run |
//! | `ApprovalRequired` | reject it when the approval expires (if expiry is configured) |
//! | `EnvironmentRegistered` | declare and plan the environment's baseline |

use crate::queue::{enqueue, now_ms, Step};
use ferry_store::stream::{Handler, HandlerError, Param, StoredEvent, Tx};
use std::time::Duration;

/// The subscription.
pub struct Enqueuer {
    /// How long an approval may wait before the run is rejected; `None` = forever.
    pub approval_expiry: Option<Duration>,
}

fn inner(event: &StoredEvent) -> Option<&serde_json::Value> {
    event.payload.get(&event.event_type)
}

fn correlation(event: &StoredEvent) -> (Option<String>, Option<String>) {
    (
        event
            .metadata
            .get("correlationId")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        Some(event.event_id.to_string()),
    )
}

/// The tenant and environment of a run, from its first event.
async fn run_environment(
    tx: &mut Tx,
    run_id: &str,
) -> Result<Option<(String, String)>, HandlerError> {
    let payload = tx
        .fetch_json(
            "SELECT payload FROM events WHERE aggregate_type = 'ProvisioningRun' AND aggregate_id = $1 AND sequence = 1",
            &[Param::Text(Some(run_id.to_string()))],
        )
        .await?;
    Ok(payload.and_then(|p| {
        let r = p.get("ProvisioningRequested")?;
        Some((
            r.get("tenantId")?.as_str()?.to_string(),
            r.get("environmentId")?.as_str()?.to_string(),
        ))
    }))
}

#[async_trait::async_trait]
impl Handler for Enqueuer {
    fn name(&self) -> &str {
        "workers"
    }

    async fn handle(&self, tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError> {
        let (correlation_id, causation_id) = correlation(event);
        let now = now_ms();
        match (event.aggregate_type.as_str(), event.event_type.as_str()) {
            ("ProvisioningRun", "ProvisioningRequested") => {
                let Some((tenant, env)) = run_environment(tx, &event.aggregate_id).await? else {
                    return Ok(());
                };
                enqueue(
                    tx,
                    &event.aggregate_id,
                    Step::Plan,
                    &tenant,
                    &format!("{tenant}/{env}"),
                    now,
                    correlation_id,
                    causation_id,
                )
                .await?;
            }
            ("ProvisioningRun", "ApplyStarted" | "ApprovalGranted") => {
                let Some((tenant, env)) = run_environment(tx, &event.aggregate_id).await? else {
                    return Ok(());
                };
                enqueue(
                    tx,
                    &event.aggregate_id,
                    Step::Apply,
                    &tenant,
                    &format!("{tenant}/{env}"),
                    now,
                    correlation_id,
                    causation_id,
                )
                .await?;
            }
            ("ProvisioningRun", "ApprovalRequired") => {
                let Some(expiry) = self.approval_expiry else {
                    return Ok(());
                };
                let Some((tenant, env)) = run_environment(tx, &event.aggregate_id).await? else {
                    return Ok(());
                };
                let required_at = event.recorded_at.timestamp_millis();
                enqueue(
                    tx,
                    &event.aggregate_id,
                    Step::Expiry,
                    &tenant,
                    &format!("{tenant}/{env}"),
                    required_at + expiry.as_millis() as i64,
                    correlation_id,
                    causation_id,
                )
                .await?;
            }
            ("Environment", "EnvironmentRegistered") => {
                let Some(r) = inner(event) else { return Ok(()) };
                let (Some(tenant), Some(env)) = (
                    r.get("tenantId").and_then(|v| v.as_str()),
                    r.get("environmentId").and_then(|v| v.as_str()),
                ) else {
                    return Ok(());
                };
                enqueue(
                    tx,
                    &event.aggregate_id,
                    Step::Baseline,
                    tenant,
                    &format!("{tenant}/{env}"),
                    now,
                    correlation_id,
                    causation_id,
                )
                .await?;
            }
            _ => {}
        }
        Ok(())
    }
}

//! Turns a stored event into the CloudEvent Ferry publishes (relay) or streams (SSE).
//!
//! Integration events get their fixed payloads; any other event, or an integration event
//! whose payload cannot be built (which would be a bug: it is logged and counted), goes on
//! `ferry.events.<aggregate>.<event>` with the domain event's inner object as data, so the
//! audit trail stays complete and the relay never stops on one odd event.

use crate::cloudevent::{CloudEvent, JSON, SPEC_VERSION};
use crate::payloads::{
    PlanSummary, ProvisioningAppliedPayload, ProvisioningFailedPayload, ProvisioningPlannedPayload,
    SpecificationDeclaredPayload,
};
use crate::subjects;
use ferry_domain::run::{RunEvent, RunRequest};
use ferry_domain::specification::SpecificationEvent;
use ferry_store::database::Pool;
use ferry_store::{Database, Position, StoredEvent};
use serde_json::Value;

/// Default CloudEvent `source` of Ferry's events.
pub const DEFAULT_SOURCE: &str = "urn:ferry";

/// One message ready to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct Outbound {
    /// The NATS subject (also the CloudEvent `type`).
    pub subject: String,
    /// The envelope with its data.
    pub event: CloudEvent,
    /// Set when an integration payload could not be built and the domain fallback was used.
    pub degraded: Option<String>,
}

/// `<transaction id>.<global position>`: the position as text, for `ferryposition`, the
/// `Ferry-Position` header and SSE ids.
pub fn position_token(p: Position) -> String {
    format!("{}.{}", p.transaction_id, p.global_position)
}

/// Reads a [`position_token`] back (a bare number is a global position on SQLite).
pub fn parse_position(token: &str) -> Option<Position> {
    let token = token.trim();
    let (tx, pos) = token.split_once('.').unwrap_or(("0", token));
    let transaction_id = tx.parse::<i64>().ok()?;
    let global_position = pos.parse::<i64>().ok()?;
    (transaction_id >= 0 && global_position >= 0).then_some(Position {
        transaction_id,
        global_position,
    })
}

/// Why an integration payload could not be built.
#[derive(Debug, thiserror::Error)]
enum Unmappable {
    #[error("database: {0}")]
    Sql(#[from] sqlx::Error),
    #[error("{0}")]
    Data(String),
}

/// The CloudEvent for `event`. Only a database error fails (the caller retries).
pub async fn to_outbound(
    db: &Database,
    source: &str,
    event: &StoredEvent,
) -> Result<Outbound, sqlx::Error> {
    let (subject, data, degraded) =
        match subjects::integration_subject(&event.aggregate_type, &event.event_type) {
            Some(subject) => match integration_payload(db, event).await {
                Ok(data) => (subject.to_string(), data, None),
                Err(Unmappable::Sql(e)) => return Err(e),
                Err(Unmappable::Data(reason)) => {
                    tracing::error!(
                        event_id = %event.event_id, event_type = %event.event_type, %reason,
                        "integration payload cannot be built; publishing the domain event instead"
                    );
                    (
                        subjects::domain_subject(&event.aggregate_type, &event.event_type),
                        inner_payload(&event.payload),
                        Some(reason),
                    )
                }
            },
            None => (
                subjects::domain_subject(&event.aggregate_type, &event.event_type),
                inner_payload(&event.payload),
                None,
            ),
        };
    let meta = |key: &str| {
        event
            .metadata
            .get(key)
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    Ok(Outbound {
        event: CloudEvent {
            specversion: SPEC_VERSION.to_string(),
            id: event.event_id.to_string(),
            source: source.to_string(),
            event_type: subject.clone(),
            subject: Some(event.aggregate_id.clone()),
            time: Some(event.recorded_at),
            datacontenttype: Some(JSON.to_string()),
            tenantid: meta("tenantId"),
            ferryaggregatetype: Some(event.aggregate_type.clone()),
            ferrysequence: Some(event.sequence),
            ferryposition: Some(position_token(event.position)),
            correlationid: meta("correlationId"),
            causationid: meta("causationId"),
            data,
        },
        subject,
        degraded,
    })
}

/// The object inside an externally tagged event (`{"Variant": {...}}` → `{...}`).
pub fn inner_payload(payload: &Value) -> Value {
    match payload.as_object() {
        Some(map) if map.len() == 1 => map.values().next().cloned().unwrap_or(Value::Null),
        _ => payload.clone(),
    }
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, v: &Value) -> Result<T, Unmappable> {
    serde_json::from_value(v.clone())
        .map_err(|e| Unmappable::Data(format!("{what} does not decode: {e}")))
}

async fn integration_payload(db: &Database, event: &StoredEvent) -> Result<Value, Unmappable> {
    let value = if event.aggregate_type == "DeploymentSpecification" {
        let SpecificationEvent::SpecificationDeclared(v) =
            decode::<SpecificationEvent>(&event.event_type, &event.payload)?;
        serde_json::to_value(SpecificationDeclaredPayload {
            specification_id: v.specification_id,
            tenant_id: v.tenant_id,
            environment_id: v.environment_id,
            kind: v.kind,
            version: v.version,
            program_version: v.program_version.to_string(),
        })
    } else {
        let run_event = decode::<RunEvent>(&event.event_type, &event.payload)?;
        let request = run_request(db, &event.aggregate_id).await?;
        match run_event {
            RunEvent::ProvisioningPlanned { plan_receipt, .. } => {
                serde_json::to_value(ProvisioningPlannedPayload {
                    provisioning_run_id: request.provisioning_run_id,
                    tenant_id: request.tenant_id,
                    environment_id: request.environment_id,
                    kind: request.kind,
                    promotion_id: request.promotion_id,
                    plan_summary: PlanSummary {
                        adds: plan_receipt.adds,
                        changes: plan_receipt.changes,
                        deletes: plan_receipt.deletes,
                        replaces: plan_receipt.replaces,
                        resources: u32::try_from(plan_receipt.resources.len()).unwrap_or(u32::MAX),
                    },
                })
            }
            RunEvent::ProvisioningApplied { apply_receipt, .. } => {
                serde_json::to_value(ProvisioningAppliedPayload {
                    provisioning_run_id: request.provisioning_run_id,
                    tenant_id: request.tenant_id,
                    project_id: request.project_id,
                    environment_id: request.environment_id,
                    kind: request.kind,
                    promotion_id: request.promotion_id,
                    specification_version: request.specification_version,
                    outputs: apply_receipt.outputs,
                })
            }
            RunEvent::ProvisioningFailed { reason, .. } => {
                serde_json::to_value(ProvisioningFailedPayload {
                    provisioning_run_id: request.provisioning_run_id,
                    tenant_id: request.tenant_id,
                    environment_id: request.environment_id,
                    kind: request.kind,
                    promotion_id: request.promotion_id,
                    reason,
                })
            }
            other => {
                return Err(Unmappable::Data(format!(
                    "stored type {} holds a different event {other:?}",
                    event.event_type
                )))
            }
        }
    };
    value.map_err(|e| Unmappable::Data(e.to_string()))
}

/// The run's `ProvisioningRequested` payload, read from the events table.
async fn run_request(db: &Database, run_id: &str) -> Result<RunRequest, Unmappable> {
    const SQL: &str = "SELECT payload FROM events
        WHERE aggregate_type = 'ProvisioningRun' AND aggregate_id = $1
          AND event_type = 'ProvisioningRequested'
        ORDER BY sequence LIMIT 1";
    let payload: Option<Value> = match db.pool() {
        Pool::Postgres(p) => {
            sqlx::query_scalar(SQL)
                .bind(run_id)
                .fetch_optional(p)
                .await?
        }
        Pool::Sqlite(p) => {
            let text: Option<String> = sqlx::query_scalar(&db.sql(SQL))
                .bind(run_id)
                .fetch_optional(p)
                .await?;
            text.map(|t| serde_json::from_str(&t))
                .transpose()
                .map_err(|e| Unmappable::Data(format!("ProvisioningRequested: {e}")))?
        }
    };
    let payload = payload
        .ok_or_else(|| Unmappable::Data(format!("run {run_id} has no ProvisioningRequested")))?;
    match decode::<RunEvent>("ProvisioningRequested", &payload)? {
        RunEvent::ProvisioningRequested(request) => Ok(*request),
        _ => Err(Unmappable::Data(
            "ProvisioningRequested holds another event".to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_round_trip() {
        let p = Position {
            transaction_id: 812,
            global_position: 17,
        };
        assert_eq!(parse_position(&position_token(p)), Some(p));
        assert_eq!(
            parse_position("42"),
            Some(Position {
                transaction_id: 0,
                global_position: 42
            })
        );
        assert_eq!(parse_position("x.1"), None);
        assert_eq!(parse_position("-1.1"), None);
        assert_eq!(parse_position(""), None);
    }

    #[test]
    fn the_inner_object_of_a_tagged_event_is_the_data() {
        let v = serde_json::json!({"ProvisioningCancelled": {"cancelledBy": "ann"}});
        assert_eq!(inner_payload(&v), serde_json::json!({"cancelledBy": "ann"}));
        let flat = serde_json::json!({"a": 1, "b": 2});
        assert_eq!(inner_payload(&flat), flat);
    }
}

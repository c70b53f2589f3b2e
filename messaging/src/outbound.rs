//! The provisioning context's publishers, and the pieces every [`Publisher`] shares.
//!
//! Events are decoded first, through their upcasters ([`ferry_store::events`]); one that
//! does not decode is an error, at which the relay stops and which it reports until it goes
//! through: nothing is skipped. Integration events get their fixed payloads; every other
//! event goes on `ferry.events.<aggregate>.<event>` with the domain event's inner object as
//! data. An integration event whose payload cannot be built (its run has no request: a bug,
//! logged and counted) goes on its domain subject instead, so the audit trail stays
//! complete.

use crate::cloudevent::CloudEvent;
use crate::payloads::{
    PlanSummary, ProvisioningAppliedPayload, ProvisioningFailedPayload, ProvisioningPlannedPayload,
    SpecificationDeclaredPayload,
};
use crate::publish::{DomainEvents, Message, Publisher, Publishers};
use crate::schemas::{domain_event_docs, schema_value, Direction, Documents, SubjectDoc};
use crate::subjects;
use cqrs_es::{Aggregate, DomainEvent};
use ferry_domain::drift::DriftIgnoreRules;
use ferry_domain::environment::Environment;
use ferry_domain::receipts::{ApplyReceipt, PlanReceipt};
use ferry_domain::run::{ProvisioningRun, RunEvent, RunRequest};
use ferry_domain::specification::{DeploymentSpecification, SpecificationEvent};
use ferry_store::events::{decode_event, first_event, ReadError};
use ferry_store::{Database, Position, StoredEvent, Typed};
use serde_json::value::RawValue;
use serde_json::Value;
use std::sync::Arc;

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

/// The object inside an externally tagged event (`{"Variant": {...}}` → `{...}`).
pub fn inner_payload(payload: &Value) -> Value {
    match payload.as_object() {
        Some(map) if map.len() == 1 => map.values().next().cloned().unwrap_or(Value::Null),
        _ => payload.clone(),
    }
}

/// [`inner_payload`] of a stored event's payload (for an event that was not decoded), as
/// compact JSON text (the store may hold it spaced). The store only holds JSON, so the text
/// is the data only if that JSON is too deep to parse.
pub fn stored_inner_payload(stored: &StoredEvent) -> Box<RawValue> {
    let text = |json: &str| {
        serde_json::value::to_raw_value(json).unwrap_or_else(|_| RawValue::NULL.to_owned())
    };
    match stored.payload.to_value() {
        Ok(value) => serde_json::value::to_raw_value(&into_inner_payload(value))
            .unwrap_or_else(|_| text(stored.payload.get())),
        Err(_) => text(stored.payload.get()),
    }
}

/// [`inner_payload`] of a value the caller owns: nothing is copied.
fn into_inner_payload(payload: Value) -> Value {
    match payload {
        Value::Object(map) if map.len() == 1 => {
            map.into_iter().next().map_or(Value::Null, |(_, v)| v)
        }
        other => other,
    }
}

/// [`inner_payload`] of the compact JSON an event serialized to, read without building a
/// tree: the object of a map with one key (an externally tagged variant), else the whole
/// text (a unit variant is a string).
fn inner_raw(json: String) -> Result<Box<RawValue>, serde_json::Error> {
    let inner = match serde_json::from_str::<std::collections::HashMap<&str, &RawValue>>(&json) {
        Ok(map) if map.len() == 1 => map.values().next().map(|inner| inner.get().to_string()),
        _ => None,
    };
    RawValue::from_string(inner.unwrap_or(json))
}

/// The domain event on `ferry.events.<aggregate>.<event>`, its inner object as data.
pub fn domain_message<E: DomainEvent>(stored: &StoredEvent, event: &E) -> Message {
    let subject = subjects::domain_subject(&stored.aggregate_type, &event.event_type());
    match serde_json::to_string(event).and_then(inner_raw) {
        Ok(data) => Message {
            subject,
            data,
            degraded: None,
        },
        // Ferry's events always serialize; should one not, the stored object still tells.
        Err(e) => {
            let reason = format!("the event does not serialize: {e}");
            log_degraded(stored, &reason);
            Message {
                subject,
                data: stored_inner_payload(stored),
                degraded: Some(reason),
            }
        }
    }
}

/// An integration event whose payload cannot be built goes on its domain subject.
pub fn integration_failed<E: DomainEvent>(
    stored: &StoredEvent,
    event: &E,
    reason: String,
) -> Message {
    log_degraded(stored, &reason);
    Message {
        degraded: Some(reason),
        ..domain_message(stored, event)
    }
}

fn log_degraded(stored: &StoredEvent, reason: &str) {
    tracing::error!(
        event_id = %stored.event_id, event_type = %stored.event_type, %reason,
        "integration payload cannot be built; publishing the domain event instead"
    );
}

/// A built integration payload on `subject`, or the domain event when it cannot be built.
pub fn integration<E: DomainEvent>(
    stored: &StoredEvent,
    event: &E,
    subject: &str,
    data: Result<Box<RawValue>, serde_json::Error>,
) -> Message {
    match data {
        Ok(data) => Message {
            subject: subject.to_string(),
            data,
            degraded: None,
        },
        Err(e) => integration_failed(stored, event, e.to_string()),
    }
}

impl Publishers {
    /// The provisioning context's publishers: runs and specifications with their integration
    /// events, environments' domain events.
    pub fn provisioning() -> Self {
        Self::new()
            .with(Arc::new(RunPublisher))
            .with(Arc::new(SpecificationPublisher))
            .with(Arc::new(DomainEvents::<Environment>::new()))
            .with(Arc::new(DomainEvents::<DriftIgnoreRules>::new()))
    }
}

/// An integration subject's documentation and the schema file of its payload.
pub fn integration_doc<T: schemars::JsonSchema>(
    subject: &str,
    event: &str,
    direction: Direction,
    summary: &str,
) -> Documents {
    let path = format!("events/{}.schema.json", subjects::kebab(event));
    Documents {
        subjects: vec![SubjectDoc {
            subject: subject.to_string(),
            event: event.to_string(),
            schema: path.clone(),
            direction,
            summary: summary.to_string(),
        }],
        files: vec![(path, schema_value::<T>())],
    }
}

/// Specifications: `SpecificationDeclared` is an integration event.
pub struct SpecificationPublisher;

#[async_trait::async_trait]
impl Publisher for SpecificationPublisher {
    fn aggregate_type(&self) -> &'static str {
        DeploymentSpecification::TYPE
    }

    async fn message(&self, _db: &Database, event: &StoredEvent) -> Result<Message, ReadError> {
        let decoded = decode_event::<DeploymentSpecification>(event)?;
        Ok(specification_message(event, &decoded))
    }

    fn documents(&self) -> Documents {
        let mut docs = integration_doc::<SpecificationDeclaredPayload>(
            subjects::SPECIFICATION_DECLARED,
            "SpecificationDeclared",
            Direction::Out,
            "A desired-state version exists for an environment.",
        );
        docs.extend(domain_event_docs::<SpecificationEvent>(
            DeploymentSpecification::TYPE,
            &["SpecificationDeclared"],
        ));
        docs
    }
}

/// Runs: planned, applied and failed are integration events (their payloads carry the run's
/// request, read from the store); the others are domain events.
pub struct RunPublisher;

#[async_trait::async_trait]
impl Publisher for RunPublisher {
    fn aggregate_type(&self) -> &'static str {
        ProvisioningRun::TYPE
    }

    async fn message(&self, db: &Database, event: &StoredEvent) -> Result<Message, ReadError> {
        let decoded = decode_event::<ProvisioningRun>(event)?;
        run_message(db, event, &decoded).await
    }

    fn documents(&self) -> Documents {
        let mut docs = Documents::default();
        for integration in [
            integration_doc::<ProvisioningPlannedPayload>(
                subjects::PROVISIONING_PLANNED,
                "ProvisioningPlanned",
                Direction::Out,
                "A plan exists (adds, changes, deletes) and may await approval.",
            ),
            integration_doc::<ProvisioningAppliedPayload>(
                subjects::PROVISIONING_APPLIED,
                "ProvisioningApplied",
                Direction::Both,
                "The desired state was applied; outputs are recorded.",
            ),
            integration_doc::<ProvisioningFailedPayload>(
                subjects::PROVISIONING_FAILED,
                "ProvisioningFailed",
                Direction::Both,
                "Planning or the apply failed; the reason names the failing resource or reference.",
            ),
        ] {
            docs.extend(integration);
        }
        docs.extend(domain_event_docs::<RunEvent>(
            ProvisioningRun::TYPE,
            &[
                "ProvisioningPlanned",
                "ProvisioningApplied",
                "ProvisioningFailed",
            ],
        ));
        docs
    }
}

fn specification_message(stored: &StoredEvent, event: &SpecificationEvent) -> Message {
    let SpecificationEvent::SpecificationDeclared(v) = event;
    let data = serde_json::value::to_raw_value(&SpecificationDeclaredPayload {
        specification_id: v.specification_id,
        tenant_id: v.tenant_id.clone(),
        environment_id: v.environment_id.clone(),
        kind: v.kind,
        version: v.version,
        program_version: v.program_version.to_string(),
    });
    integration(stored, event, subjects::SPECIFICATION_DECLARED, data)
}

/// The run events that are integration events, with what their payloads need.
enum RunIntegration<'a> {
    Planned(&'a PlanReceipt),
    Applied(&'a ApplyReceipt),
    Failed(&'a str),
}

async fn run_message(
    db: &Database,
    stored: &StoredEvent,
    run: &RunEvent,
) -> Result<Message, ReadError> {
    let which = match run {
        RunEvent::ProvisioningPlanned { plan_receipt, .. } => RunIntegration::Planned(plan_receipt),
        RunEvent::ProvisioningApplied { apply_receipt, .. } => {
            RunIntegration::Applied(apply_receipt)
        }
        RunEvent::ProvisioningFailed { reason, .. } => RunIntegration::Failed(reason),
        other => return Ok(domain_message(stored, other)),
    };
    let request = match run_request(db, &stored.aggregate_id).await? {
        Ok(request) => request,
        Err(reason) => return Ok(integration_failed(stored, run, reason)),
    };
    let (subject, data) = match which {
        RunIntegration::Planned(receipt) => (
            subjects::PROVISIONING_PLANNED,
            serde_json::value::to_raw_value(&ProvisioningPlannedPayload {
                provisioning_run_id: request.provisioning_run_id,
                tenant_id: request.tenant_id,
                environment_id: request.environment_id,
                kind: request.kind,
                promotion_id: request.promotion_id,
                plan_summary: PlanSummary {
                    adds: receipt.adds,
                    changes: receipt.changes,
                    deletes: receipt.deletes,
                    replaces: receipt.replaces,
                    resources: u32::try_from(receipt.resources.len()).unwrap_or(u32::MAX),
                },
            }),
        ),
        RunIntegration::Applied(receipt) => (
            subjects::PROVISIONING_APPLIED,
            serde_json::value::to_raw_value(&ProvisioningAppliedPayload {
                provisioning_run_id: request.provisioning_run_id,
                tenant_id: request.tenant_id,
                project_id: request.project_id,
                environment_id: request.environment_id,
                kind: request.kind,
                promotion_id: request.promotion_id,
                specification_version: request.specification_version,
                outputs: receipt.outputs.clone(),
            }),
        ),
        RunIntegration::Failed(reason) => (
            subjects::PROVISIONING_FAILED,
            serde_json::value::to_raw_value(&ProvisioningFailedPayload {
                provisioning_run_id: request.provisioning_run_id,
                tenant_id: request.tenant_id,
                environment_id: request.environment_id,
                kind: request.kind,
                promotion_id: request.promotion_id,
                reason: reason.to_string(),
            }),
        ),
    };
    Ok(integration(stored, run, subject, data))
}

/// The run's request (its first event), or why there is none.
async fn run_request(db: &Database, run_id: &str) -> Result<Result<RunRequest, String>, ReadError> {
    Ok(match first_event::<ProvisioningRun>(db, run_id).await? {
        Some(Typed {
            event: RunEvent::ProvisioningRequested(request),
            ..
        }) => Ok(*request),
        Some(first) => Err(format!(
            "run {run_id} has no ProvisioningRequested (its first event is {})",
            first.event.stored_type().name
        )),
        None => Err(format!("run {run_id} has no ProvisioningRequested")),
    })
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
    fn every_aggregate_of_provisioning_has_a_publisher() {
        let publishers = Publishers::provisioning();
        for aggregate_type in [
            ProvisioningRun::TYPE,
            DeploymentSpecification::TYPE,
            Environment::TYPE,
            DriftIgnoreRules::TYPE,
        ] {
            assert!(publishers.declares(aggregate_type), "{aggregate_type}");
        }
    }

    #[test]
    fn the_inner_object_of_a_tagged_event_is_the_data() {
        let v = serde_json::json!({"ProvisioningCancelled": {"cancelledBy": "ann"}});
        assert_eq!(inner_payload(&v), serde_json::json!({"cancelledBy": "ann"}));
        let flat = serde_json::json!({"a": 1, "b": 2});
        assert_eq!(inner_payload(&flat), flat);
        assert_eq!(into_inner_payload(v.clone()), inner_payload(&v));
        assert_eq!(into_inner_payload(flat.clone()), flat);
        // The text route gives the same JSON as the tree route.
        for event in [&v, &flat, &serde_json::json!("ProvisioningCancelled")] {
            let raw = inner_raw(event.to_string()).unwrap();
            let read: Value = serde_json::from_str(raw.get()).unwrap();
            assert_eq!(read, inner_payload(event), "{event}");
        }
    }
}

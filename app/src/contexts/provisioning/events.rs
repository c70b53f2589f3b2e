//! What provisioning publishes: `SpecificationDeclared`, `ProvisioningPlanned`,
//! `ProvisioningApplied` and `ProvisioningFailed` are integration events, on
//! `provisioning.*.v1.*` with their fixed payloads (`ferry_messaging::payloads`); every other
//! event of its aggregates (runs, specifications, environments, drift ignore rules) goes on
//! `ferry.events.<aggregate>.<event>` as the domain event's inner object.
//!
//! A run's integration payloads carry fields its events do not (the tenant, project,
//! environment, kind): they come from the run's first event, its request, read from the
//! store. A run without one is a bug: its event goes on its domain subject instead, logged
//! and counted, so the audit trail stays complete.

use super::payloads::{
    self, PlanSummary, ProvisioningAppliedPayload, ProvisioningFailedPayload,
    ProvisioningPlannedPayload, SpecificationDeclaredPayload,
};
use cqrs_es::Aggregate;
use ferry_domain::drift::DriftIgnoreRules;
use ferry_domain::environment::Environment;
use ferry_domain::receipts::{ApplyReceipt, PlanReceipt};
use ferry_domain::run::{ProvisioningRun, RunEvent, RunRequest};
use ferry_domain::specification::{DeploymentSpecification, SpecificationEvent};
use ferry_messaging::outbound::{domain_message, integration, integration_doc, integration_failed};
use ferry_messaging::publish::{DomainEvents, Message, Publisher, Publishers};
use ferry_messaging::schemas::{domain_event_docs, Direction, Documents};
use ferry_store::events::{decode_event, first_event, ReadError};
use ferry_store::{Database, StoredEvent, Typed};
use std::sync::Arc;

/// The provisioning context's publishers: runs and specifications with their integration
/// events, environments' and drift ignore rules' domain events.
pub fn publishers() -> Publishers {
    Publishers::new()
        .with(Arc::new(RunPublisher))
        .with(Arc::new(SpecificationPublisher))
        .with(Arc::new(DomainEvents::<Environment>::new()))
        .with(Arc::new(DomainEvents::<DriftIgnoreRules>::new()))
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
            payloads::SPECIFICATION_DECLARED,
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
                payloads::PROVISIONING_PLANNED,
                "ProvisioningPlanned",
                Direction::Out,
                "A plan exists (adds, changes, deletes) and may await approval.",
            ),
            integration_doc::<ProvisioningAppliedPayload>(
                payloads::PROVISIONING_APPLIED,
                "ProvisioningApplied",
                Direction::Both,
                "The desired state was applied; outputs are recorded.",
            ),
            integration_doc::<ProvisioningFailedPayload>(
                payloads::PROVISIONING_FAILED,
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
    integration(stored, event, payloads::SPECIFICATION_DECLARED, data)
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
    let request = match run_request(db, &stored.aggregate_id).await {
        Ok(request) => request,
        Err(RunRequestError::Read(e)) => return Err(e),
        Err(missing) => return Ok(integration_failed(stored, run, missing.to_string())),
    };
    let (subject, data) = match which {
        RunIntegration::Planned(receipt) => (
            payloads::PROVISIONING_PLANNED,
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
            payloads::PROVISIONING_APPLIED,
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
            payloads::PROVISIONING_FAILED,
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

/// Why a run's request could not be read.
#[derive(Debug, thiserror::Error)]
enum RunRequestError {
    /// The store failed, or the first event does not decode: the relay retries or stops.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The run's first event is not its request (a bug: its events go on their domain
    /// subjects).
    #[error("run {run_id} has no ProvisioningRequested (its first event is {first})")]
    NotFirst {
        /// The run.
        run_id: String,
        /// The type of its first event.
        first: String,
    },
    /// The run has no events.
    #[error("run {run_id} has no ProvisioningRequested")]
    Missing {
        /// The run.
        run_id: String,
    },
}

/// The run's request (its first event).
async fn run_request(db: &Database, run_id: &str) -> Result<RunRequest, RunRequestError> {
    match first_event::<ProvisioningRun>(db, run_id).await? {
        Some(Typed {
            event: RunEvent::ProvisioningRequested(request),
            ..
        }) => Ok(*request),
        Some(first) => Err(RunRequestError::NotFirst {
            run_id: run_id.to_string(),
            first: first.event.stored_type().name.to_string(),
        }),
        None => Err(RunRequestError::Missing {
            run_id: run_id.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_messaging::schemas::{asyncapi, published_schemas, subject_docs};
    use ferry_messaging::subjects::domain_subject;

    #[test]
    fn every_aggregate_of_provisioning_has_a_publisher() {
        let publishers = publishers();
        for aggregate_type in [
            ProvisioningRun::TYPE,
            DeploymentSpecification::TYPE,
            Environment::TYPE,
            DriftIgnoreRules::TYPE,
        ] {
            assert!(publishers.declares(aggregate_type), "{aggregate_type}");
        }
    }

    /// The subject provisioning's publishers document for `event`.
    fn subject_for(event: &str) -> String {
        publishers()
            .documents()
            .subjects
            .into_iter()
            .find(|d| d.event == event)
            .map(|d| d.subject)
            .unwrap_or_else(|| panic!("{event} is not documented"))
    }

    #[test]
    fn integration_events_use_the_seed_subjects() {
        assert_eq!(
            subject_for("ProvisioningPlanned"),
            "provisioning.runs.v1.provisioning-planned"
        );
        assert_eq!(
            subject_for("SpecificationDeclared"),
            "provisioning.specifications.v1.specification-declared"
        );
    }

    #[test]
    fn other_and_unknown_events_fall_back_to_ferry_events() {
        assert_eq!(
            subject_for("ProvisioningCancelled"),
            "ferry.events.provisioning-run.provisioning-cancelled"
        );
        assert_eq!(
            domain_subject("Promotion", "PromotionGateEvaluated"),
            "ferry.events.promotion.promotion-gate-evaluated"
        );
        assert_eq!(
            subject_for("EnvironmentRegistered"),
            "ferry.events.environment.environment-registered"
        );
    }

    #[test]
    fn every_domain_variant_has_a_schema() {
        let names: Vec<String> = publishers()
            .documents()
            .files
            .into_iter()
            .filter_map(|(path, schema)| {
                path.starts_with("events/ferry/")
                    .then(|| schema["title"].as_str().unwrap_or_default().to_string())
            })
            .collect();
        for expected in [
            "ProvisioningRequested",
            "ProvisioningPlanned",
            "ApprovalRequired",
            "ApprovalGranted",
            "ApprovalRejected",
            "ApplyStarted",
            "ProvisioningApplied",
            "ProvisioningFailed",
            "ProvisioningCancelled",
            "ProvisioningSuperseded",
            "SpecificationDeclared",
        ] {
            assert!(
                names.iter().any(|n| n == expected),
                "{expected} missing from {names:?}"
            );
        }
    }

    #[test]
    fn asyncapi_lists_every_subject_in_and_out() {
        let inbound = crate::contexts::Contexts::builtin()
            .inbound_kinds()
            .unwrap();
        let doc = asyncapi(&publishers(), &inbound);
        let addresses: Vec<&str> = doc["channels"]
            .as_object()
            .unwrap()
            .values()
            .map(|c| c["address"].as_str().unwrap())
            .collect();
        for s in [
            payloads::PROVISIONING_PLANNED,
            "releases.releases.v1.release-ready",
            "runcontrol.approvals.v1.approval-decided",
            "ferry.events.provisioning-run.provisioning-cancelled",
            "ferry.events.{aggregate}.{event}",
        ] {
            assert!(addresses.contains(&s), "{s} missing");
        }
        assert_eq!(
            doc["operations"]["consumeProvisioningApplied"]["action"],
            "receive"
        );
        assert_eq!(
            doc["operations"]["publishProvisioningApplied"]["action"],
            "send"
        );
        // Every referenced schema file is generated.
        let publishers = publishers();
        let files: Vec<String> = published_schemas(&publishers, &inbound)
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        assert_eq!(
            doc["operations"]["consumeReleaseReady"]["action"],
            "receive"
        );
        for d in subject_docs(&publishers, &inbound) {
            assert!(files.contains(&d.schema), "{} not generated", d.schema);
        }
    }
}

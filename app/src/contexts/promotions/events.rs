//! What promotions publish: the five integration events other services consume, on
//! `releases.promotions.v1.*` with their fixed payloads, and every other promotion event
//! (gate evaluated, approval requested, verification measured, …) on
//! `ferry.events.promotion.*` as the domain event's inner object.
//!
//! The payloads carry fields the event itself does not (the tenant, release, environment):
//! they come from the promotion's first event, its request, read from the store as the
//! provisioning publishers read a run's request.

use cqrs_es::{Aggregate, DomainEvent};
use ferry_domain::promotion::{Promotion, PromotionEvent, PromotionRequest, Strategy};
use ferry_domain::{
    ApprovalId, EnvironmentClass, EnvironmentId, FactoryRunId, ProjectId, PromotionId, ReleaseId,
    TenantId,
};
use ferry_messaging::outbound::{domain_message, integration, integration_doc, integration_failed};
use ferry_messaging::publish::{Message, Publisher};
use ferry_messaging::schemas::{domain_event_docs, Direction, Documents};
use ferry_store::events::{first_event, ReadError};
use ferry_store::{Database, StoredEvent, Typed};
use serde::{Deserialize, Serialize};

/// `PromotionRequested` (integration).
pub const PROMOTION_REQUESTED: &str = "releases.promotions.v1.promotion-requested";
/// `PromotionApproved` (integration).
pub const PROMOTION_APPROVED: &str = "releases.promotions.v1.promotion-approved";
/// `PromotionCompleted` (integration).
pub const PROMOTION_COMPLETED: &str = "releases.promotions.v1.promotion-completed";
/// `PromotionFailed` (integration).
pub const PROMOTION_FAILED: &str = "releases.promotions.v1.promotion-failed";
/// `RollbackCompleted` (integration).
pub const ROLLBACK_COMPLETED: &str = "releases.promotions.v1.rollback-completed";

/// The promotion events that are integration events, by name.
const INTEGRATION: [&str; 5] = [
    "PromotionRequested",
    "PromotionApproved",
    "PromotionCompleted",
    "PromotionFailed",
    "RollbackCompleted",
];

/// `releases.promotions.v1.promotion-requested`: gates are evaluating (or it is queued).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PromotionRequestedPayload {
    /// The promotion.
    pub promotion_id: PromotionId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The release's project.
    pub project_id: ProjectId,
    /// The release.
    pub release_id: ReleaseId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Its class when requested.
    pub environment_class: EnvironmentClass,
    /// The Factory run that asked for it, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<FactoryRunId>,
}

/// `releases.promotions.v1.promotion-approved`: the desired state is handed to provisioning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PromotionApprovedPayload {
    /// The promotion.
    pub promotion_id: PromotionId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The release.
    pub release_id: ReleaseId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// How it is rolled out.
    pub strategy: Strategy,
    /// The declared desired state (`<specificationId>@<version>`).
    pub desired_state_ref: String,
    /// The production approval, when one was needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<ApprovalId>,
}

/// `releases.promotions.v1.promotion-completed`: the release runs and is verified there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PromotionCompletedPayload {
    /// The promotion.
    pub promotion_id: PromotionId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The release's project.
    pub project_id: ProjectId,
    /// The release now current in the environment.
    pub release_id: ReleaseId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Its class.
    pub environment_class: EnvironmentClass,
    /// The release current there before, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_release_id: Option<ReleaseId>,
}

/// `releases.promotions.v1.promotion-failed`: provisioning or verification failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PromotionFailedPayload {
    /// The promotion.
    pub promotion_id: PromotionId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The release.
    pub release_id: ReleaseId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Why.
    pub reason: String,
    /// True when the previous release was restored.
    pub rolled_back: bool,
}

/// `releases.promotions.v1.rollback-completed`: the previous release is back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RollbackCompletedPayload {
    /// The promotion rolled back.
    pub promotion_id: PromotionId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The release rolled back (quarantined there).
    pub release_id: ReleaseId,
    /// The release restored.
    pub restored_release_id: ReleaseId,
}

/// Promotions: five integration events, the rest domain events.
pub struct PromotionPublisher;

#[async_trait::async_trait]
impl Publisher for PromotionPublisher {
    fn aggregate_type(&self) -> &'static str {
        Promotion::TYPE
    }

    async fn message(&self, db: &Database, event: &StoredEvent) -> Result<Message, ReadError> {
        let decoded = ferry_store::events::decode_event::<Promotion>(event)?;
        if !INTEGRATION.contains(&decoded.event_type().as_str()) {
            return Ok(domain_message(event, &decoded));
        }
        let request = match &decoded {
            // The request is the event itself.
            PromotionEvent::PromotionRequested(request) => (**request).clone(),
            _ => match first_event::<Promotion>(db, &event.aggregate_id).await? {
                Some(Typed {
                    event: PromotionEvent::PromotionRequested(request),
                    ..
                }) => *request,
                _ => {
                    let reason = format!(
                        "promotion {} has no PromotionRequested as its first event",
                        event.aggregate_id
                    );
                    return Ok(integration_failed(event, &decoded, reason));
                }
            },
        };
        Ok(integration_message(event, &decoded, &request))
    }

    fn documents(&self) -> Documents {
        let mut docs = Documents::default();
        for integration in [
            integration_doc::<PromotionRequestedPayload>(
                PROMOTION_REQUESTED,
                "PromotionRequested",
                Direction::Out,
                "A promotion was requested; gates are evaluating (or it waits its turn).",
            ),
            integration_doc::<PromotionApprovedPayload>(
                PROMOTION_APPROVED,
                "PromotionApproved",
                Direction::Out,
                "Gates passed and (for production) the approval was granted; the desired state is handed to provisioning.",
            ),
            integration_doc::<PromotionCompletedPayload>(
                PROMOTION_COMPLETED,
                "PromotionCompleted",
                Direction::Out,
                "The release is running and verified in the environment.",
            ),
            integration_doc::<PromotionFailedPayload>(
                PROMOTION_FAILED,
                "PromotionFailed",
                Direction::Out,
                "Provisioning or verification failed; rolledBack tells whether the previous release was restored.",
            ),
            integration_doc::<RollbackCompletedPayload>(
                ROLLBACK_COMPLETED,
                "RollbackCompleted",
                Direction::Out,
                "The previous release is back in the environment.",
            ),
        ] {
            docs.extend(integration);
        }
        docs.extend(domain_event_docs::<PromotionEvent>(
            Promotion::TYPE,
            &INTEGRATION,
        ));
        docs
    }
}

/// The integration message for `event` (one of [`INTEGRATION`]) of the promotion `request`
/// asked for.
fn integration_message(
    stored: &StoredEvent,
    event: &PromotionEvent,
    request: &PromotionRequest,
) -> Message {
    let r = request;
    let (subject, data) = match event {
        PromotionEvent::PromotionRequested(_) => (
            PROMOTION_REQUESTED,
            serde_json::value::to_raw_value(&PromotionRequestedPayload {
                promotion_id: r.promotion_id,
                tenant_id: r.tenant_id.clone(),
                project_id: r.project_id.clone(),
                release_id: r.release_id,
                environment_id: r.environment_id.clone(),
                environment_class: r.environment_class,
                run_id: r.run_id,
            }),
        ),
        PromotionEvent::PromotionApproved {
            desired_state_ref,
            approval_id,
            strategy,
            ..
        } => (
            PROMOTION_APPROVED,
            serde_json::value::to_raw_value(&PromotionApprovedPayload {
                promotion_id: r.promotion_id,
                tenant_id: r.tenant_id.clone(),
                release_id: r.release_id,
                environment_id: r.environment_id.clone(),
                strategy: *strategy,
                desired_state_ref: desired_state_ref.clone(),
                approval_id: *approval_id,
            }),
        ),
        PromotionEvent::PromotionCompleted { .. } => (
            PROMOTION_COMPLETED,
            serde_json::value::to_raw_value(&PromotionCompletedPayload {
                promotion_id: r.promotion_id,
                tenant_id: r.tenant_id.clone(),
                project_id: r.project_id.clone(),
                release_id: r.release_id,
                environment_id: r.environment_id.clone(),
                environment_class: r.environment_class,
                previous_release_id: r.previous_release_id,
            }),
        ),
        PromotionEvent::PromotionFailed {
            reason,
            rolled_back,
            ..
        } => (
            PROMOTION_FAILED,
            serde_json::value::to_raw_value(&PromotionFailedPayload {
                promotion_id: r.promotion_id,
                tenant_id: r.tenant_id.clone(),
                release_id: r.release_id,
                environment_id: r.environment_id.clone(),
                reason: reason.clone(),
                rolled_back: *rolled_back,
            }),
        ),
        PromotionEvent::RollbackCompleted {
            restored_release_id,
            ..
        } => (
            ROLLBACK_COMPLETED,
            serde_json::value::to_raw_value(&RollbackCompletedPayload {
                promotion_id: r.promotion_id,
                tenant_id: r.tenant_id.clone(),
                environment_id: r.environment_id.clone(),
                release_id: r.release_id,
                restored_release_id: *restored_release_id,
            }),
        ),
        other => return domain_message(stored, other),
    };
    integration(stored, event, subject, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integration_events_go_on_the_seed_subjects_and_the_rest_on_domain_subjects() {
        let docs = PromotionPublisher.documents();
        let subject = |event: &str| {
            docs.subjects
                .iter()
                .find(|d| d.event == event)
                .map(|d| d.subject.clone())
                .unwrap_or_else(|| panic!("{event} is not documented"))
        };
        assert_eq!(subject("PromotionRequested"), PROMOTION_REQUESTED);
        assert_eq!(subject("PromotionApproved"), PROMOTION_APPROVED);
        assert_eq!(subject("PromotionCompleted"), PROMOTION_COMPLETED);
        assert_eq!(subject("PromotionFailed"), PROMOTION_FAILED);
        assert_eq!(subject("RollbackCompleted"), ROLLBACK_COMPLETED);
        assert_eq!(
            subject("GateEvaluated"),
            "ferry.events.promotion.gate-evaluated"
        );
        // Each integration event is documented once (not also as a domain event).
        for event in INTEGRATION {
            assert_eq!(
                docs.subjects.iter().filter(|d| d.event == event).count(),
                1,
                "{event}"
            );
        }
    }
}

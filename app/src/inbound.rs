//! What Ferry does with the events it hears (over NATS or `POST /factory/events`): each
//! bounded context declares the events it hears (`BoundedContext::inbound_events`: their
//! payload types, names and subjects) and its handler (`BoundedContext::inbound`);
//! [`FerryInbound`] hands each event to the handlers of the contexts that declared it, and
//! the transport accepts only what some context declared. What each context does with its
//! events is in its `inbound` module. [`ApprovalDecided`] is here because two contexts
//! hear it: provisioning when it names a run, promotions when it names a promotion.
//!
//! Every effect is committed with the message's "handled" mark (one transaction), and its
//! actor is who sent the event (the token's subject over HTTP, `nats:<source>` over NATS),
//! never a name the payload carries. A decision already recorded on the run (the same
//! approval again, under another message id) is a duplicate, not a refusal. Domain refusals
//! are permanent (the message is dead-lettered with the reason); a concurrent change or an
//! unavailable store is transient (redelivered later).

use crate::contexts::provisioning::work::metrics::Metrics;
use chrono::{DateTime, Utc};
use ferry_domain::confinement::Confinement;
use ferry_domain::ports::sources::ProgramSource;
use ferry_domain::{Actor, TenantId};
use ferry_domain::{ApprovalId, PromotionId, ProvisioningRunId};
use ferry_domain::{StoredAggregate, TenantOwned};
use ferry_messaging::inbound::{
    BrokenRule, Handled, InboundEnvelope, InboundError, InboundEvent, InboundHandler, InboundKind,
    InboundKinds,
};
use ferry_store::{CommandError, Database, EventMetadata, Executed, Repository};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What a context's inbound handler is made from: the process's shared parts.
pub struct InboundParts {
    /// The store.
    pub db: Database,
    /// The work counters.
    pub metrics: Arc<Metrics>,
    /// The rules tenants' references and addresses must pass.
    pub confinement: Arc<Confinement>,
    /// Where programs are looked up.
    pub programs: Arc<dyn ProgramSource>,
}

/// A context's handler of the events it registers (`BoundedContext::inbound_events`).
#[async_trait::async_trait]
pub trait ContextInbound: Send + Sync {
    /// Handles one; [`Handled::NothingToDo`] when this one is not the context's (another
    /// context registered for the same event may take it).
    async fn handle(&self, envelope: &InboundEnvelope) -> Result<Handled, InboundError>;
}

/// The handler of inbound events: each to the contexts registered for it, in order; the
/// first that does something answers.
pub struct FerryInbound {
    kinds: InboundKinds,
    handlers: BTreeMap<&'static str, Vec<Arc<dyn ContextInbound>>>,
}

impl FerryInbound {
    /// A handler over the contexts' handlers, each with the events it registers.
    pub fn new(
        handlers: Vec<(Vec<InboundKind>, Arc<dyn ContextInbound>)>,
    ) -> Result<Self, ferry_messaging::InboundClash> {
        let mut by_event: BTreeMap<&'static str, Vec<Arc<dyn ContextInbound>>> = BTreeMap::new();
        let mut kinds = Vec::new();
        for (events, handler) in handlers {
            for kind in events {
                by_event
                    .entry(kind.name())
                    .or_default()
                    .push(handler.clone());
                kinds.push(kind);
            }
        }
        Ok(Self {
            kinds: InboundKinds::new(kinds)?,
            handlers: by_event,
        })
    }
}

#[async_trait::async_trait]
impl InboundHandler for FerryInbound {
    fn kinds(&self) -> InboundKinds {
        self.kinds.clone()
    }

    async fn handle(&self, envelope: InboundEnvelope) -> Result<Handled, InboundError> {
        for handler in self
            .handlers
            .get(envelope.event.name())
            .into_iter()
            .flatten()
        {
            match handler.handle(&envelope).await? {
                Handled::NothingToDo => continue,
                handled => return Ok(handled),
            }
        }
        tracing::info!(event = envelope.event.name(), subject = %envelope.subject, id = %envelope.id, "heard; nothing of Ferry's to do (another service's promotions are not driven by Ferry)");
        Ok(Handled::NothingToDo)
    }
}

/// Runs `command` on the aggregate `id` as the message's sender, committed with the
/// message's "handled" mark in one transaction (so the effect and the mark are one).
pub async fn execute_marked<A>(
    repository: &Repository<A>,
    envelope: &InboundEnvelope,
    id: &str,
    command: A::Command,
    may_create: bool,
) -> Result<Executed<A>, CommandError<A::Error>>
where
    A: StoredAggregate + TenantOwned + Clone + Send + Sync + 'static,
    A::Command: Clone,
{
    repository
        .execute_linked(
            &envelope.tenant_id,
            id,
            command,
            &metadata(envelope, envelope.actor.clone()),
            may_create,
            Some(&envelope.mark),
        )
        .await
}

/// The answer to a command on a record another event creates: a record not there yet is
/// tried again later (`missing` says which), as events may arrive out of order.
pub(crate) fn recorded_once_there<T, E: std::error::Error>(
    result: Result<T, CommandError<E>>,
    missing: impl FnOnce() -> String,
) -> Result<Handled, InboundError> {
    match result {
        Ok(_) => Ok(Handled::Recorded),
        Err(CommandError::NotFound) => Err(InboundError::Transient(missing())),
        Err(other) => Err(classify(other)),
    }
}

/// Refuses a payload whose `tenantId` is not the CloudEvent's.
pub(crate) fn same_tenant(payload: &TenantId, tenant: &TenantId) -> Result<(), InboundError> {
    if payload == tenant {
        Ok(())
    } else {
        Err(InboundError::Permanent(
            "payload tenantId differs from the CloudEvent's".to_string(),
        ))
    }
}

/// Refuses a decider named as Ferry names its own actors.
pub(crate) fn check_decider(a: &ApprovalDecided) -> Result<(), InboundError> {
    match a.decided_by.reserved_prefix() {
        Some(prefix) => Err(InboundError::Permanent(format!(
            "decidedBy may not start with {prefix:?}: Ferry names its own actors so"
        ))),
        None => Ok(()),
    }
}

/// What a refused command means for the message: a domain refusal or a missing record is
/// permanent (dead-lettered), a concurrent change or an unavailable store transient.
pub fn classify<E: std::error::Error>(e: CommandError<E>) -> InboundError {
    match e {
        CommandError::Domain(d) => InboundError::Permanent(d.to_string()),
        CommandError::NotFound => {
            InboundError::Permanent("no such record for this tenant".to_string())
        }
        // Also: the claim was taken over by another delivery (the mark matched no row).
        CommandError::Conflict | CommandError::Moved => {
            InboundError::Transient("concurrent change, or the claim was lost".to_string())
        }
        CommandError::Unavailable(s) | CommandError::Store(s) => {
            InboundError::Transient(ferry_store::error_chain(s.as_ref()))
        }
    }
}

/// The metadata of a command an inbound message causes: its tenant, `actor`, and the
/// message's correlation and causation ids where they are uuids.
pub fn metadata(envelope: &InboundEnvelope, actor: Actor) -> EventMetadata {
    let request_id = uuid::Uuid::new_v4();
    let correlation_id = envelope
        .correlation_id
        .as_deref()
        .and_then(|c| uuid::Uuid::parse_str(c).ok())
        .unwrap_or(request_id);
    // The causing message's id is a CloudEvent id; keep it when it is a uuid.
    let causation_id = uuid::Uuid::parse_str(&envelope.id).unwrap_or(request_id);
    EventMetadata {
        tenant_id: envelope.tenant_id.clone(),
        actor,
        correlation_id,
        causation_id,
        request_id,
    }
}

/// The decision carried by `ApprovalDecided`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ApprovalDecision {
    /// Approved.
    #[serde(alias = "approved")]
    Approve,
    /// Rejected.
    #[serde(alias = "rejected")]
    Reject,
    /// Expired without a decision (treat as a rejection).
    #[serde(alias = "expired")]
    Expire,
}

// Both contexts hear it: provisioning when it names a run, promotions when it names a
// promotion. (Its doc comment is its schema's description.)
/// `runcontrol.approvals.v1.approval-decided`: a person decided an approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalDecided {
    /// The approval.
    pub approval_id: ApprovalId,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The run waiting for it (baseline and reconciliation applies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning_run_id: Option<ProvisioningRunId>,
    /// The promotion waiting for it (production promotions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion_id: Option<PromotionId>,
    /// approve | reject | expire.
    pub decision: ApprovalDecision,
    /// Who decided.
    pub decided_by: Actor,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<DateTime<Utc>>,
}

impl InboundEvent for ApprovalDecided {
    const NAME: &'static str = "ApprovalDecided";
    const SUBJECT: &'static str = "runcontrol.approvals.v1.approval-decided";
    const SUMMARY: &'static str = "Run control decided an approval for a run or a promotion.";

    fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }

    fn check(&self) -> Result<(), BrokenRule> {
        if self.provisioning_run_id.is_none() && self.promotion_id.is_none() {
            return Err(BrokenRule(
                "names neither provisioningRunId nor promotionId".to_string(),
            ));
        }
        // Deserialising takes an actor's name as stored events hold it; one that arrives
        // must not hide what it is (`Actor::parse`).
        Actor::parse(self.decided_by.as_str())
            .map(|_| ())
            .map_err(|e| BrokenRule(format!("decidedBy: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_approval_must_name_what_it_decides_and_a_visible_decider() {
        let kind = InboundKind::of::<ApprovalDecided>();
        let err = kind
            .decode(
                json!({"approvalId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a11", "tenantId": "acme",
                           "decision": "approve", "decidedBy": "bob"}),
            )
            .unwrap_err();
        assert!(err.to_string().contains("neither"), "{err}");
        // An approver's name that hides characters is refused when it arrives.
        for hidden in ["alice\u{200B}", "\u{202E}ecila", "alice\u{061C}"] {
            let err = kind
                .decode(json!({"approvalId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a11",
                               "tenantId": "acme",
                               "promotionId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a12",
                               "decision": "approve", "decidedBy": hidden}))
                .unwrap_err();
            assert!(err.to_string().contains("decidedBy"), "{hidden:?}: {err}");
        }
        let heard = kind
            .decode(json!({"approvalId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a11",
                           "tenantId": "acme",
                           "promotionId": "6f1b5c2e-7d7a-4f0e-9c3b-2a1d0e5f4a12",
                           "decision": "approved", "decidedBy": "bob"}))
            .unwrap();
        let decided = heard.get::<ApprovalDecided>().unwrap();
        assert_eq!(decided.decision, ApprovalDecision::Approve);
    }
}

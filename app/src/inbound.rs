//! What Ferry does with the events it hears (over NATS or `POST /factory/events`): each
//! bounded context registers the events it handles and its handler
//! (`BoundedContext::inbound`); [`FerryInbound`] hands each event to them.
//!
//! | event | effect |
//! |---|---|
//! | `EnvironmentCreated` | records the environment (class, health URL, baseline program): its baseline is planned |
//! | `EnvironmentStateChanged` | records its readiness |
//! | `ApprovalDecided` | decides the named promotion's pending approval (it must name that approval), or approves or rejects the named run awaiting approval (expired = rejected); a promotion's run is decided only through its promotion |
//! | `ReleaseReady` | records the release (it needs its program, commit and version to be promotable; a commit or folder its repository does not hold is recorded as the release's problem, and its promotions are rejected at the pipeline gate) |
//! | `ReleaseWithdrawn` | withdraws the release: promotions of it not yet deploying are rejected |
//! | `ProvisioningApplied`, `ProvisioningFailed` | logged only: Ferry's promotions follow their runs in process (the promotions driver) |
//!
//! Every effect is committed with the message's "handled" mark (one transaction), and its
//! actor is who sent the event (the token's subject over HTTP, `nats:<source>` over NATS),
//! never a name the payload carries. A decision already recorded on the run (the same
//! approval again, under another message id) is a duplicate, not a refusal. Domain refusals
//! are permanent (the message is dead-lettered with the reason); a concurrent change or an
//! unavailable store is transient (redelivered later).

use ferry_domain::confinement::Confinement;
use ferry_domain::ports::sources::ProgramSource;
use ferry_domain::{Actor, TenantId};
use ferry_domain::{StoredAggregate, TenantOwned};
use ferry_messaging::inbound::{
    ApprovalDecided, Handled, InboundEnvelope, InboundError, InboundHandler,
};
use ferry_store::{CommandError, Database, EventMetadata, Executed, Repository};
use ferry_workers::metrics::Metrics;
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

/// A context's handler of the events it registers.
#[async_trait::async_trait]
pub trait ContextInbound: Send + Sync {
    /// The events (by name) it handles.
    fn events(&self) -> &'static [&'static str];

    /// Handles one; [`Handled::NothingToDo`] when this one is not the context's (another
    /// context registered for the same event may take it).
    async fn handle(&self, envelope: &InboundEnvelope) -> Result<Handled, InboundError>;
}

/// The handler of inbound events: each to the contexts registered for it, in order; the
/// first that does something answers.
pub struct FerryInbound {
    handlers: BTreeMap<&'static str, Vec<Arc<dyn ContextInbound>>>,
}

impl FerryInbound {
    /// A handler over the contexts' `handlers`.
    pub fn new(handlers: Vec<Arc<dyn ContextInbound>>) -> Self {
        let mut by_event: BTreeMap<&'static str, Vec<Arc<dyn ContextInbound>>> = BTreeMap::new();
        for handler in handlers {
            for event in handler.events() {
                by_event.entry(event).or_default().push(handler.clone());
            }
        }
        Self { handlers: by_event }
    }
}

#[async_trait::async_trait]
impl InboundHandler for FerryInbound {
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
pub(crate) async fn execute_marked<A>(
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

pub(crate) fn classify<E: std::error::Error>(e: CommandError<E>) -> InboundError {
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

pub(crate) fn metadata(envelope: &InboundEnvelope, actor: Actor) -> EventMetadata {
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

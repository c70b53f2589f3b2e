//! The Environment aggregate: what Ferry knows of an environment owned by the environment
//! service (its class, health URL and readiness). Recorded from `EnvironmentCreated` /
//! `EnvironmentStateChanged`, or `PUT /factory/environments/{id}`, as events like
//! everything else, so that every read model can be rebuilt.
//!
//! Lowering an environment's class (production to staging, say) takes the production rules
//! off every run requested after it, so it is an event of its own,
//! `EnvironmentClassLowered`, naming who did it. Lowering out of production is a change
//! a second person decides, whichever way it arrives (`PUT /factory/environments/{id}` or
//! an `EnvironmentCreated` event): it is recorded as requested
//! (`EnvironmentClassLoweringRequested`) and the class stays production, with production's
//! rules for every run, until someone other than the requester approves it
//! ([`EnvironmentCommand::DecideClassLowering`]). Runs keep the class they were requested
//! under. Readiness changes are ordered by the time the environment service observed them:
//! an older report arriving late never overwrites a newer one.

use crate::ids::{Actor, EnvironmentId, TenantId};
use crate::values::{EnvironmentClass, ProgramRef, ProgramVersion};
use crate::{text, EventType, TenantOwned};
use chrono::{DateTime, Utc};
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, DomainEvent};
use serde::{Deserialize, Serialize};

/// The program an environment's baseline is declared from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BaselineProgram {
    /// `<repository>#<folder>`.
    pub program_ref: ProgramRef,
    /// The commit.
    pub program_version: ProgramVersion,
}

/// A service-level objective: a Prometheus query (`/api/v1/query`, one series or a scalar)
/// whose value must stay within `threshold` while a release is verified.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SloObjective {
    /// The PromQL expression, e.g. an error ratio.
    pub query: String,
    /// The bound.
    pub threshold: f64,
    /// Whether the value must stay at most (default, e.g. an error ratio) or at least
    /// (e.g. availability) the threshold.
    #[serde(default)]
    pub bound: SloBound,
}

/// Which side of the threshold an objective's value must stay on.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum SloBound {
    /// `value <= threshold`.
    #[default]
    AtMost,
    /// `value >= threshold`.
    AtLeast,
}

impl SloObjective {
    /// Why the objective cannot be checked, naming the field; `None` when it can.
    pub fn invalid(&self) -> Option<(&'static str, &'static str)> {
        if self.query.trim().is_empty() || self.query.chars().count() > 4096 {
            return Some(("slo.query", "must be 1 to 4096 characters"));
        }
        if text::first_hidden_or_control(&self.query.replace(['\n', '\t'], " ")).is_some() {
            return Some((
                "slo.query",
                "must not contain control, format or invisible characters",
            ));
        }
        if !self.threshold.is_finite() {
            return Some(("slo.threshold", "must be a finite number"));
        }
        None
    }

    /// Whether `value` meets the objective.
    pub fn met_by(&self, value: f64) -> bool {
        match self.bound {
            SloBound::AtMost => value <= self.threshold,
            SloBound::AtLeast => value >= self.threshold,
        }
    }

    /// The condition, for a measurement's threshold (`<= 0.01`).
    pub fn condition(&self) -> String {
        match self.bound {
            SloBound::AtMost => format!("<= {}", self.threshold),
            SloBound::AtLeast => format!(">= {}", self.threshold),
        }
    }
}

/// The payload of `EnvironmentRegistered`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentRegistration {
    /// The environment.
    pub environment_id: EnvironmentId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// Its class.
    pub environment_class: EnvironmentClass,
    /// Where its health can be probed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_url: Option<String>,
    /// The baseline program the creation carried, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_program: Option<BaselineProgram>,
    /// The service-level objective verification checks after an apply, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<SloObjective>,
    /// Who recorded it (a token's subject, or `system:inbound`).
    pub recorded_by: Actor,
    /// When.
    pub recorded_at: DateTime<Utc>,
}

/// A lowering of the class out of production, waiting for a second person.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PendingLowering {
    /// The class now (production).
    pub previous_class: EnvironmentClass,
    /// The lower class asked for.
    pub environment_class: EnvironmentClass,
    /// Who asked.
    pub requested_by: Actor,
    /// When.
    pub requested_at: DateTime<Utc>,
}

/// Commands of the environment aggregate.
#[derive(Debug, Clone, PartialEq)]
pub enum EnvironmentCommand {
    /// Record the environment, or update its class and health URL (idempotent: the same
    /// values again change nothing).
    Register(Box<EnvironmentRegistration>),
    /// Approve or refuse the pending lowering of the class out of production. Only
    /// someone other than its requester approves it; anyone allowed may refuse it.
    DecideClassLowering {
        /// `true` to lower the class, `false` to keep production.
        approve: bool,
        /// Who decides.
        by: Actor,
        /// When.
        at: DateTime<Utc>,
    },
    /// The environment's readiness changed. Ignored when older than the state recorded.
    ChangeState {
        /// `true` when ready to receive changes.
        ready: bool,
        /// The state as the environment service names it.
        state: String,
        /// Who.
        by: Actor,
        /// When the environment service observed it (the report's time).
        at: DateTime<Utc>,
    },
}

/// How much protection a class carries: production rules apply above all.
fn rank(class: EnvironmentClass) -> u8 {
    match class {
        EnvironmentClass::Development => 0,
        EnvironmentClass::Test => 1,
        EnvironmentClass::Staging => 2,
        EnvironmentClass::Production => 3,
    }
}

/// Events of the environment aggregate (all version 1.0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum EnvironmentEvent {
    /// First record of the environment.
    EnvironmentRegistered(Box<EnvironmentRegistration>),
    /// Class or health URL changed.
    #[serde(rename_all = "camelCase")]
    EnvironmentUpdated {
        /// The new class.
        environment_class: EnvironmentClass,
        /// The new health URL.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        health_url: Option<String>,
        /// Who.
        recorded_by: Actor,
        /// When.
        recorded_at: DateTime<Utc>,
    },
    /// The class was lowered (e.g. production to development): an audited change of its
    /// own, since it lifts the production rules from runs requested after it.
    #[serde(rename_all = "camelCase")]
    EnvironmentClassLowered {
        /// The class before.
        previous_class: EnvironmentClass,
        /// The new, lower class.
        environment_class: EnvironmentClass,
        /// The health URL after the change.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        health_url: Option<String>,
        /// Who lowered it (out of production: who asked for it).
        lowered_by: Actor,
        /// When.
        lowered_at: DateTime<Utc>,
        /// Out of production: the second person who approved it (absent on events
        /// recorded before lowering out of production needed one).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        approved_by: Option<Actor>,
    },
    /// Lowering the class out of production was asked for: the class stays until a second
    /// person approves it.
    EnvironmentClassLoweringRequested(PendingLowering),
    /// The pending lowering was refused, or withdrawn by a registration naming the class
    /// recorded or a higher one.
    #[serde(rename_all = "camelCase")]
    EnvironmentClassLoweringRefused {
        /// Who.
        refused_by: Actor,
        /// When.
        refused_at: DateTime<Utc>,
    },
    /// The service-level objective was set, changed or removed.
    #[serde(rename_all = "camelCase")]
    EnvironmentSloChanged {
        /// The objective now (none: removed).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slo: Option<SloObjective>,
        /// Who.
        changed_by: Actor,
        /// When.
        changed_at: DateTime<Utc>,
    },
    /// Readiness changed.
    #[serde(rename_all = "camelCase")]
    EnvironmentStateChanged {
        /// Ready to receive changes.
        ready: bool,
        /// The state's name.
        state: String,
        /// Who.
        changed_by: Actor,
        /// When.
        changed_at: DateTime<Utc>,
    },
}

impl EnvironmentEvent {
    /// The name and version this event is stored under (see [`crate::event_type`]).
    pub fn stored_type(&self) -> EventType {
        match self {
            Self::EnvironmentRegistered(_) => EventType::first("EnvironmentRegistered"),
            Self::EnvironmentUpdated { .. } => EventType::first("EnvironmentUpdated"),
            Self::EnvironmentClassLowered { .. } => EventType::first("EnvironmentClassLowered"),
            Self::EnvironmentClassLoweringRequested(_) => {
                EventType::first("EnvironmentClassLoweringRequested")
            }
            Self::EnvironmentClassLoweringRefused { .. } => {
                EventType::first("EnvironmentClassLoweringRefused")
            }
            Self::EnvironmentStateChanged { .. } => EventType::first("EnvironmentStateChanged"),
            Self::EnvironmentSloChanged { .. } => EventType::first("EnvironmentSloChanged"),
        }
    }
}

impl DomainEvent for EnvironmentEvent {
    fn event_type(&self) -> String {
        self.stored_type().name.to_string()
    }
    fn event_version(&self) -> String {
        self.stored_type().version.to_string()
    }
}

/// Rules an environment command can break.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvironmentError {
    /// A state change for an environment Ferry has not recorded.
    #[error("environment is not registered")]
    NotRegistered,
    /// The registration names another environment or tenant than the aggregate.
    #[error("registration does not match the environment record")]
    IdentityMismatch,
    /// No lowering of the class waits for a decision.
    #[error("no lowering of the environment's class waits for a decision")]
    NoPendingLowering,
    /// The person who asked to lower the class out of production tried to approve it.
    #[error("{0} asked to lower the class out of production: a second person approves it")]
    LoweringApprovedByItsRequester(Actor),
    /// A health URL or state a console could not render faithfully.
    #[error(transparent)]
    InvalidText(#[from] text::InvalidText),
}

/// The environment as recorded.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Environment {
    registration: Option<EnvironmentRegistration>,
    ready: bool,
    state: Option<String>,
    state_observed_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pending_lowering: Option<PendingLowering>,
}

impl Environment {
    /// The aggregate id of an environment of a tenant.
    pub fn aggregate_id(tenant: &TenantId, environment: &EnvironmentId) -> String {
        format!("{tenant}/{environment}")
    }
    /// The registration (with the current class and health URL).
    pub fn registration(&self) -> Option<&EnvironmentRegistration> {
        self.registration.as_ref()
    }
    /// The class, if registered.
    pub fn class(&self) -> Option<EnvironmentClass> {
        self.registration.as_ref().map(|r| r.environment_class)
    }
    /// The lowering of the class out of production waiting for a second person, if any.
    pub fn pending_lowering(&self) -> Option<&PendingLowering> {
        self.pending_lowering.as_ref()
    }
    /// Ready to receive changes.
    pub fn is_ready(&self) -> bool {
        self.ready
    }
    /// The state the environment service last reported, and when it observed it; `None`
    /// when it never reported (readiness must then be probed).
    pub fn reported_state(&self) -> Option<(&str, Option<DateTime<Utc>>)> {
        self.state
            .as_deref()
            .map(|state| (state, self.state_observed_at))
    }
}

impl Environment {
    /// A registration lowering the class out of production: the class stays, the other
    /// changes (health URL) are recorded, and the lowering waits for a second person
    /// (asked once: the same lowering asked again changes nothing).
    async fn request_lowering(
        &mut self,
        existing: EnvironmentRegistration,
        r: EnvironmentRegistration,
        sink: &EventSink<Self>,
    ) -> Result<(), EnvironmentError> {
        if existing.health_url != r.health_url {
            sink.write(
                EnvironmentEvent::EnvironmentUpdated {
                    environment_class: existing.environment_class,
                    health_url: r.health_url.clone(),
                    recorded_by: r.recorded_by.clone(),
                    recorded_at: r.recorded_at,
                },
                self,
            )
            .await;
        }
        let asked = self
            .pending_lowering
            .as_ref()
            .is_some_and(|p| p.environment_class == r.environment_class);
        if !asked {
            sink.write(
                EnvironmentEvent::EnvironmentClassLoweringRequested(PendingLowering {
                    previous_class: existing.environment_class,
                    environment_class: r.environment_class,
                    requested_by: r.recorded_by,
                    requested_at: r.recorded_at,
                }),
                self,
            )
            .await;
        }
        Ok(())
    }

    /// A registration: the first records the environment; a later one changes the
    /// objective, the class or the health URL (a lowering out of production waits for a
    /// second person). `None` when nothing more is to be written.
    async fn register(
        &mut self,
        r: Box<EnvironmentRegistration>,
        sink: &EventSink<Self>,
    ) -> Result<Option<EnvironmentEvent>, EnvironmentError> {
        // A copy: the objective's event is written (which borrows the aggregate) before
        // the rest is decided.
        let Some(existing) = self.registration.clone() else {
            return Ok(Some(EnvironmentEvent::EnvironmentRegistered(r)));
        };
        if existing.environment_id != r.environment_id || existing.tenant_id != r.tenant_id {
            return Err(EnvironmentError::IdentityMismatch);
        }
        // The objective changes in an event of its own, with the rest in the same commit.
        if existing.slo != r.slo {
            sink.write(
                EnvironmentEvent::EnvironmentSloChanged {
                    slo: r.slo.clone(),
                    changed_by: r.recorded_by.clone(),
                    changed_at: r.recorded_at,
                },
                self,
            )
            .await;
        }
        let out_of_production = existing.environment_class == EnvironmentClass::Production
            && r.environment_class != EnvironmentClass::Production;
        if out_of_production {
            self.request_lowering(existing, *r, sink).await?;
            return Ok(None);
        }
        // A registration naming the class recorded (or a higher one) withdraws a lowering
        // asked for before.
        if self.pending_lowering.is_some() {
            sink.write(
                EnvironmentEvent::EnvironmentClassLoweringRefused {
                    refused_by: r.recorded_by.clone(),
                    refused_at: r.recorded_at,
                },
                self,
            )
            .await;
        }
        if existing.environment_class == r.environment_class && existing.health_url == r.health_url
        {
            return Ok(None);
        }
        Ok(Some(
            if rank(r.environment_class) < rank(existing.environment_class) {
                EnvironmentEvent::EnvironmentClassLowered {
                    previous_class: existing.environment_class,
                    environment_class: r.environment_class,
                    health_url: r.health_url,
                    lowered_by: r.recorded_by,
                    lowered_at: r.recorded_at,
                    approved_by: None,
                }
            } else {
                EnvironmentEvent::EnvironmentUpdated {
                    environment_class: r.environment_class,
                    health_url: r.health_url,
                    recorded_by: r.recorded_by,
                    recorded_at: r.recorded_at,
                }
            },
        ))
    }

    /// A second person's decision on the pending lowering out of production.
    fn decide_class_lowering(
        &self,
        approve: bool,
        by: Actor,
        at: DateTime<Utc>,
    ) -> Result<EnvironmentEvent, EnvironmentError> {
        let pending = self
            .pending_lowering
            .clone()
            .ok_or(EnvironmentError::NoPendingLowering)?;
        let registration = self
            .registration
            .as_ref()
            .ok_or(EnvironmentError::NotRegistered)?;
        if !approve {
            Ok(EnvironmentEvent::EnvironmentClassLoweringRefused {
                refused_by: by,
                refused_at: at,
            })
        } else if pending.requested_by.same_person(&by) {
            Err(EnvironmentError::LoweringApprovedByItsRequester(by))
        } else {
            Ok(EnvironmentEvent::EnvironmentClassLowered {
                previous_class: registration.environment_class,
                environment_class: pending.environment_class,
                health_url: registration.health_url.clone(),
                lowered_by: pending.requested_by,
                lowered_at: at,
                approved_by: Some(by),
            })
        }
    }

    /// The environment service's report of readiness and state; `None` when it changes
    /// nothing or arrived after a newer one.
    fn change_state(
        &self,
        ready: bool,
        state: String,
        by: Actor,
        at: DateTime<Utc>,
    ) -> Result<Option<EnvironmentEvent>, EnvironmentError> {
        if self.registration.is_none() {
            return Err(EnvironmentError::NotRegistered);
        }
        if self.ready == ready && self.state.as_deref() == Some(state.as_str()) {
            return Ok(None);
        }
        // A report observed before the one recorded arrived late: it is history.
        if self.state_observed_at.is_some_and(|newest| at < newest) {
            return Ok(None);
        }
        Ok(Some(EnvironmentEvent::EnvironmentStateChanged {
            ready,
            state,
            changed_by: by,
            changed_at: at,
        }))
    }
}

impl TenantOwned for Environment {
    fn tenant(&self) -> Option<&TenantId> {
        self.registration.as_ref().map(|r| &r.tenant_id)
    }
}

/// Stored with no upcasters yet: every event type is at its first version.
impl crate::StoredAggregate for Environment {}

impl Aggregate for Environment {
    const TYPE: &'static str = "Environment";
    type Command = EnvironmentCommand;
    type Event = EnvironmentEvent;
    type Error = EnvironmentError;
    type Services = ();

    async fn handle(
        &mut self,
        command: Self::Command,
        _services: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), Self::Error> {
        // What a console renders, checked when it arrives (stored events load as they are).
        match &command {
            EnvironmentCommand::Register(r) => {
                if let Some(url) = &r.health_url {
                    text::check_web_url("healthUrl", url)?;
                }
            }
            EnvironmentCommand::ChangeState { state, .. } => text::check_name("state", state)?,
            _ => {}
        }
        let event = match command {
            EnvironmentCommand::Register(r) => self.register(r, sink).await?,
            EnvironmentCommand::DecideClassLowering { approve, by, at } => {
                Some(self.decide_class_lowering(approve, by, at)?)
            }
            EnvironmentCommand::ChangeState {
                ready,
                state,
                by,
                at,
            } => self.change_state(ready, state, by, at)?,
        };
        if let Some(event) = event {
            sink.write(event, self).await;
        }
        Ok(())
    }

    fn apply(&mut self, event: Self::Event) {
        match event {
            EnvironmentEvent::EnvironmentClassLoweringRequested(pending) => {
                self.pending_lowering = Some(pending);
            }
            EnvironmentEvent::EnvironmentClassLoweringRefused { .. } => {
                self.pending_lowering = None;
            }
            EnvironmentEvent::EnvironmentRegistered(r) => self.registration = Some(*r),
            EnvironmentEvent::EnvironmentUpdated {
                environment_class,
                health_url,
                ..
            }
            | EnvironmentEvent::EnvironmentClassLowered {
                environment_class,
                health_url,
                ..
            } => {
                if let Some(r) = self.registration.as_mut() {
                    if r.environment_class != environment_class {
                        self.pending_lowering = None;
                    }
                    r.environment_class = environment_class;
                    r.health_url = health_url;
                }
            }
            EnvironmentEvent::EnvironmentSloChanged { slo, .. } => {
                if let Some(r) = self.registration.as_mut() {
                    r.slo = slo;
                }
            }
            EnvironmentEvent::EnvironmentStateChanged {
                ready,
                state,
                changed_at,
                ..
            } => {
                self.ready = ready;
                self.state = Some(state);
                self.state_observed_at = Some(changed_at);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cqrs_es::test::TestFramework;

    fn registration(class: EnvironmentClass) -> EnvironmentRegistration {
        EnvironmentRegistration {
            environment_id: EnvironmentId::parse("payments-prod").unwrap(),
            tenant_id: TenantId::parse("acme").unwrap(),
            environment_class: class,
            health_url: None,
            baseline_program: None,
            slo: None,
            recorded_by: Actor::parse("admin").unwrap(),
            recorded_at: DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
        }
    }

    #[test]
    fn first_registration_records_the_environment() {
        let r = registration(EnvironmentClass::Production);
        TestFramework::<Environment>::with(())
            .given_no_previous_events()
            .when(EnvironmentCommand::Register(Box::new(r.clone())))
            .then_expect_events(vec![EnvironmentEvent::EnvironmentRegistered(Box::new(r))]);
    }

    #[test]
    fn registering_again_is_idempotent_or_an_update() {
        let r = registration(EnvironmentClass::Staging);
        let given = vec![EnvironmentEvent::EnvironmentRegistered(Box::new(r.clone()))];
        TestFramework::<Environment>::with(())
            .given(given.clone())
            .when(EnvironmentCommand::Register(Box::new(r.clone())))
            .then_expect_events(vec![]);
        let changed = registration(EnvironmentClass::Production);
        TestFramework::<Environment>::with(())
            .given(given.clone())
            .when(EnvironmentCommand::Register(Box::new(changed.clone())))
            .then_expect_events(vec![EnvironmentEvent::EnvironmentUpdated {
                environment_class: EnvironmentClass::Production,
                health_url: None,
                recorded_by: changed.recorded_by,
                recorded_at: changed.recorded_at,
            }]);
    }

    #[test]
    fn the_objective_changes_in_an_event_of_its_own_committed_with_the_rest() {
        let r = registration(EnvironmentClass::Staging);
        let given = vec![EnvironmentEvent::EnvironmentRegistered(Box::new(r.clone()))];
        let objective = SloObjective {
            query: "sum(rate(errors[5m])) / sum(rate(requests[5m]))".to_string(),
            threshold: 0.01,
            bound: SloBound::AtMost,
        };
        let mut with_slo = r.clone();
        with_slo.slo = Some(objective.clone());
        TestFramework::<Environment>::with(())
            .given(given.clone())
            .when(EnvironmentCommand::Register(Box::new(with_slo.clone())))
            .then_expect_events(vec![EnvironmentEvent::EnvironmentSloChanged {
                slo: Some(objective.clone()),
                changed_by: r.recorded_by.clone(),
                changed_at: r.recorded_at,
            }]);
        let mut both = registration(EnvironmentClass::Production);
        both.slo = Some(objective.clone());
        TestFramework::<Environment>::with(())
            .given(given)
            .when(EnvironmentCommand::Register(Box::new(both.clone())))
            .then_expect_events(vec![
                EnvironmentEvent::EnvironmentSloChanged {
                    slo: Some(objective.clone()),
                    changed_by: both.recorded_by.clone(),
                    changed_at: both.recorded_at,
                },
                EnvironmentEvent::EnvironmentUpdated {
                    environment_class: EnvironmentClass::Production,
                    health_url: None,
                    recorded_by: both.recorded_by.clone(),
                    recorded_at: both.recorded_at,
                },
            ]);
        assert!(objective.met_by(0.01) && !objective.met_by(0.02));
        let availability = SloObjective {
            bound: SloBound::AtLeast,
            threshold: 0.99,
            ..objective
        };
        assert!(availability.met_by(0.995) && !availability.met_by(0.9));
        assert_eq!(availability.condition(), ">= 0.99");
    }

    #[test]
    fn state_changes_need_a_registered_environment() {
        let change = EnvironmentCommand::ChangeState {
            ready: true,
            state: "ready".to_string(),
            by: Actor::parse("system:inbound").unwrap(),
            at: DateTime::from_timestamp(1_700_000_100, 0).unwrap(),
        };
        TestFramework::<Environment>::with(())
            .given_no_previous_events()
            .when(change.clone())
            .then_expect_error(EnvironmentError::NotRegistered);
        let r = registration(EnvironmentClass::Test);
        let result = TestFramework::<Environment>::with(())
            .given(vec![EnvironmentEvent::EnvironmentRegistered(Box::new(r))])
            .when(change)
            .inspect_result()
            .unwrap();
        assert_eq!(result.len(), 1);
    }

    #[test]
    fn lowering_the_class_is_an_audited_event_of_its_own() {
        let staging = registration(EnvironmentClass::Staging);
        let mut lowered = registration(EnvironmentClass::Development);
        lowered.recorded_by = Actor::parse("svc-environments").unwrap();
        TestFramework::<Environment>::with(())
            .given(vec![EnvironmentEvent::EnvironmentRegistered(Box::new(
                staging,
            ))])
            .when(EnvironmentCommand::Register(Box::new(lowered.clone())))
            .then_expect_events(vec![EnvironmentEvent::EnvironmentClassLowered {
                previous_class: EnvironmentClass::Staging,
                environment_class: EnvironmentClass::Development,
                health_url: None,
                lowered_by: Actor::parse("svc-environments").unwrap(),
                lowered_at: lowered.recorded_at,
                approved_by: None,
            }]);
    }

    fn by(name: &str) -> Actor {
        Actor::parse(name).unwrap()
    }

    fn pending(requested_by: &str) -> PendingLowering {
        PendingLowering {
            previous_class: EnvironmentClass::Production,
            environment_class: EnvironmentClass::Development,
            requested_by: by(requested_by),
            requested_at: DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
        }
    }

    fn decide(approve: bool, who: &str) -> EnvironmentCommand {
        EnvironmentCommand::DecideClassLowering {
            approve,
            by: by(who),
            at: DateTime::from_timestamp(1_700_000_500, 0).unwrap(),
        }
    }

    /// Issue 37: a PlatformAdmin alone lowered production to development (and a service's
    /// `EnvironmentCreated` did the same). Lowering out of production is asked for; the
    /// class stays until a second person approves.
    #[test]
    fn lowering_out_of_production_waits_for_a_second_person() {
        let prod = vec![EnvironmentEvent::EnvironmentRegistered(Box::new(
            registration(EnvironmentClass::Production),
        ))];
        for who in ["admin", "svc-environments"] {
            let mut lowered = registration(EnvironmentClass::Development);
            lowered.recorded_by = by(who);
            TestFramework::<Environment>::with(())
                .given(prod.clone())
                .when(EnvironmentCommand::Register(Box::new(lowered)))
                .then_expect_events(vec![EnvironmentEvent::EnvironmentClassLoweringRequested(
                    pending(who),
                )]);
        }
        let asked = [
            prod.clone(),
            vec![EnvironmentEvent::EnvironmentClassLoweringRequested(
                pending("admin"),
            )],
        ]
        .concat();
        // The class holds meanwhile, and asking again changes nothing.
        let mut env = Environment::default();
        for e in asked.clone() {
            env.apply(e);
        }
        assert_eq!(env.class(), Some(EnvironmentClass::Production));
        assert_eq!(env.pending_lowering(), Some(&pending("admin")));
        let mut again = registration(EnvironmentClass::Development);
        again.recorded_by = by("Admin ");
        TestFramework::<Environment>::with(())
            .given(asked.clone())
            .when(EnvironmentCommand::Register(Box::new(again)))
            .then_expect_events(vec![]);
        // Its requester, under any spelling, cannot approve it.
        for spelling in ["admin", "ADMIN", "admin "] {
            TestFramework::<Environment>::with(())
                .given(asked.clone())
                .when(decide(true, spelling))
                .then_expect_error(EnvironmentError::LoweringApprovedByItsRequester(by(
                    "admin",
                )));
        }
        // A second person lowers it.
        TestFramework::<Environment>::with(())
            .given(asked.clone())
            .when(decide(true, "carol"))
            .then_expect_events(vec![EnvironmentEvent::EnvironmentClassLowered {
                previous_class: EnvironmentClass::Production,
                environment_class: EnvironmentClass::Development,
                health_url: None,
                lowered_by: by("admin"),
                lowered_at: DateTime::from_timestamp(1_700_000_500, 0).unwrap(),
                approved_by: Some(by("carol")),
            }]);
        // Or refuses it (its requester may withdraw it too).
        TestFramework::<Environment>::with(())
            .given(asked.clone())
            .when(decide(false, "admin"))
            .then_expect_events(vec![EnvironmentEvent::EnvironmentClassLoweringRefused {
                refused_by: by("admin"),
                refused_at: DateTime::from_timestamp(1_700_000_500, 0).unwrap(),
            }]);
        // Registering production again withdraws it.
        let prod_again = registration(EnvironmentClass::Production);
        TestFramework::<Environment>::with(())
            .given(asked)
            .when(EnvironmentCommand::Register(Box::new(prod_again.clone())))
            .then_expect_events(vec![EnvironmentEvent::EnvironmentClassLoweringRefused {
                refused_by: prod_again.recorded_by,
                refused_at: prod_again.recorded_at,
            }]);
        // Nothing to decide without a request.
        TestFramework::<Environment>::with(())
            .given(prod)
            .when(decide(true, "carol"))
            .then_expect_error(EnvironmentError::NoPendingLowering);
    }

    #[test]
    fn a_lowering_stored_before_approvals_still_loads() {
        let stored = serde_json::json!({"EnvironmentClassLowered": {
            "previousClass": "production", "environmentClass": "development",
            "loweredBy": "admin", "loweredAt": "2026-12-01T10:00:00Z"}});
        let event: EnvironmentEvent = serde_json::from_value(stored).unwrap();
        assert!(matches!(
            event,
            EnvironmentEvent::EnvironmentClassLowered {
                approved_by: None,
                ..
            }
        ));
    }

    #[test]
    fn an_older_state_report_never_overwrites_a_newer_one() {
        let r = registration(EnvironmentClass::Test);
        let by = Actor::parse("system:inbound").unwrap();
        let newer = EnvironmentEvent::EnvironmentStateChanged {
            ready: true,
            state: "ready".to_string(),
            changed_by: by.clone(),
            changed_at: DateTime::from_timestamp(1_700_000_200, 0).unwrap(),
        };
        let older = EnvironmentCommand::ChangeState {
            ready: false,
            state: "degraded".to_string(),
            by: by.clone(),
            at: DateTime::from_timestamp(1_700_000_100, 0).unwrap(),
        };
        let given = vec![EnvironmentEvent::EnvironmentRegistered(Box::new(r)), newer];
        TestFramework::<Environment>::with(())
            .given(given.clone())
            .when(older)
            .then_expect_events(vec![]);
        let later = EnvironmentCommand::ChangeState {
            ready: false,
            state: "degraded".to_string(),
            by: by.clone(),
            at: DateTime::from_timestamp(1_700_000_300, 0).unwrap(),
        };
        TestFramework::<Environment>::with(())
            .given(given)
            .when(later)
            .then_expect_events(vec![EnvironmentEvent::EnvironmentStateChanged {
                ready: false,
                state: "degraded".to_string(),
                changed_by: by,
                changed_at: DateTime::from_timestamp(1_700_000_300, 0).unwrap(),
            }]);
    }
}

//! Drift ignore rules: the differences a team accepts in one environment, so that the GitOps
//! reconciler neither repairs nor proposes them.
//!
//! A rule names a resource (its URN), or one property of it (a property path as the plan
//! names its differences). Each is added and removed with a reason, by the actor of a
//! verified token, as events of the environment's `DriftIgnoreRules` aggregate, so the record
//! of who accepted what, and why, is kept like every other decision.
//!
//! [`triage`] applies the rules to a reconciliation plan. A difference is left out only when
//! the apply can honestly leave it alone: a resource rule leaves the whole resource out; a
//! property rule leaves a resource out only when every property that differs is covered
//! (an update of the other properties would overwrite the ignored one, so such a difference
//! stays in the plan, with a note saying why). What is left out is listed on the plan
//! receipt with the rules that left it out, and the runner is told to leave those resources
//! alone.

use crate::ids::{Actor, EnvironmentId, IgnoreRuleId, TenantId};
use crate::receipts::{IgnoredDifference, PlannedResource, ResourceOp};
use crate::values::{PropertyPath, ResourceUrn};
use crate::{EventType, TenantOwned};
use chrono::{DateTime, Utc};
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, DomainEvent};
use serde::{Deserialize, Serialize};

/// The longest reason kept.
pub const MAX_REASON: usize = crate::text::MAX_REASON;

/// One accepted difference.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IgnoreRule {
    /// The rule.
    pub rule_id: IgnoreRuleId,
    /// The resource whose differences are accepted.
    pub urn: ResourceUrn,
    /// Only this property of it (and what is under it); the whole resource when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub property: Option<PropertyPath>,
    /// Why the team accepts it.
    pub reason: String,
    /// Who added it (from the verified token).
    pub added_by: Actor,
    /// When.
    pub added_at: DateTime<Utc>,
}

impl IgnoreRule {
    /// Whether this rule covers a difference of `property` of `urn`.
    fn covers(&self, urn: &str, property: &str) -> bool {
        self.urn.as_str() == urn
            && self.property.as_ref().is_some_and(|p| {
                let p = p.as_str();
                property == p
                    || property
                        .strip_prefix(p)
                        .is_some_and(|rest| rest.starts_with('.'))
            })
    }

    /// Whether this rule covers the whole resource `urn`.
    fn covers_resource(&self, urn: &str) -> bool {
        self.urn.as_str() == urn && self.property.is_none()
    }
}

/// Commands on an environment's ignore rules.
#[derive(Debug, Clone, PartialEq)]
pub enum DriftRulesCommand {
    /// Accept a difference.
    Add {
        /// The tenant (from the token).
        tenant_id: TenantId,
        /// The environment.
        environment_id: EnvironmentId,
        /// The rule.
        rule: IgnoreRule,
    },
    /// Stop accepting it.
    Remove {
        /// The rule.
        rule_id: IgnoreRuleId,
        /// Why (required).
        reason: String,
        /// Who (from the token).
        by: Actor,
        /// When.
        at: DateTime<Utc>,
    },
}

/// Events of an environment's ignore rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[allow(clippy::large_enum_variant)]
pub enum DriftRulesEvent {
    /// A difference is accepted from now on.
    #[serde(rename_all = "camelCase")]
    DriftIgnoreRuleAdded {
        /// The tenant.
        tenant_id: TenantId,
        /// The environment.
        environment_id: EnvironmentId,
        /// The rule.
        rule: IgnoreRule,
    },
    /// A rule no longer applies.
    #[serde(rename_all = "camelCase")]
    DriftIgnoreRuleRemoved {
        /// The rule.
        rule_id: IgnoreRuleId,
        /// Why.
        reason: String,
        /// Who.
        removed_by: Actor,
        /// When.
        removed_at: DateTime<Utc>,
    },
}

impl DriftRulesEvent {
    /// The name and version this event is stored under (see [`crate::event_type`]).
    pub fn stored_type(&self) -> EventType {
        match self {
            Self::DriftIgnoreRuleAdded { .. } => EventType::first("DriftIgnoreRuleAdded"),
            Self::DriftIgnoreRuleRemoved { .. } => EventType::first("DriftIgnoreRuleRemoved"),
        }
    }
}

impl DomainEvent for DriftRulesEvent {
    fn event_type(&self) -> String {
        self.stored_type().name.to_string()
    }
    fn event_version(&self) -> String {
        self.stored_type().version.to_string()
    }
}

/// Rules an ignore-rule command can break.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriftRulesError {
    /// A rule without a reason (or with one too long).
    #[error("a reason of 1 to {MAX_REASON} characters is required")]
    Reason,
    /// The same resource, or the same property of it, is ignored already.
    #[error("rule {0} ignores this already")]
    Duplicate(IgnoreRuleId),
    /// A rule id used before.
    #[error("rule {0} exists already")]
    RuleExists(IgnoreRuleId),
    /// A reason a console could not render faithfully (control or invisible characters).
    #[error(transparent)]
    InvalidText(#[from] crate::text::InvalidText),
    /// No such rule here.
    #[error("no rule {0} in this environment")]
    UnknownRule(IgnoreRuleId),
    /// Removed before.
    #[error("rule {0} was removed already")]
    AlreadyRemoved(IgnoreRuleId),
    /// The command names another environment or tenant than the aggregate.
    #[error("the rule does not belong to this environment")]
    IdentityMismatch,
}

/// An environment's ignore rules, as recorded.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DriftIgnoreRules {
    tenant_id: Option<TenantId>,
    environment_id: Option<EnvironmentId>,
    active: Vec<IgnoreRule>,
    removed: Vec<IgnoreRuleId>,
}

impl DriftIgnoreRules {
    /// The aggregate id of an environment's rules.
    pub fn aggregate_id(tenant: &TenantId, environment: &EnvironmentId) -> String {
        format!("{tenant}/{environment}")
    }

    /// The rules in force, oldest first.
    pub fn active(&self) -> &[IgnoreRule] {
        &self.active
    }
}

fn check_reason(reason: &str) -> Result<(), DriftRulesError> {
    if reason.trim().is_empty() || reason.chars().count() > MAX_REASON {
        return Err(DriftRulesError::Reason);
    }
    Ok(crate::text::check_free_text("reason", reason)?)
}

impl TenantOwned for DriftIgnoreRules {
    fn tenant(&self) -> Option<&TenantId> {
        self.tenant_id.as_ref()
    }
}

/// Stored with no upcasters yet: every event type is at its first version.
impl crate::StoredAggregate for DriftIgnoreRules {}

impl Aggregate for DriftIgnoreRules {
    const TYPE: &'static str = "DriftIgnoreRules";
    type Command = DriftRulesCommand;
    type Event = DriftRulesEvent;
    type Error = DriftRulesError;
    type Services = ();

    async fn handle(
        &mut self,
        command: Self::Command,
        _services: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), Self::Error> {
        let event = match command {
            DriftRulesCommand::Add {
                tenant_id,
                environment_id,
                rule,
            } => {
                check_reason(&rule.reason)?;
                crate::text::check_name_within("urn", rule.urn.as_str(), 1024)?;
                if let Some(property) = &rule.property {
                    crate::text::check_name("property", property.as_str())?;
                }
                let mine = |t: &Option<TenantId>, e: &Option<EnvironmentId>| {
                    t.as_ref().is_none_or(|t| *t == tenant_id)
                        && e.as_ref().is_none_or(|e| *e == environment_id)
                };
                if !mine(&self.tenant_id, &self.environment_id) {
                    return Err(DriftRulesError::IdentityMismatch);
                }
                if self.active.iter().any(|r| r.rule_id == rule.rule_id)
                    || self.removed.contains(&rule.rule_id)
                {
                    return Err(DriftRulesError::RuleExists(rule.rule_id));
                }
                if let Some(same) = self
                    .active
                    .iter()
                    .find(|r| r.urn == rule.urn && r.property == rule.property)
                {
                    return Err(DriftRulesError::Duplicate(same.rule_id));
                }
                DriftRulesEvent::DriftIgnoreRuleAdded {
                    tenant_id,
                    environment_id,
                    rule,
                }
            }
            DriftRulesCommand::Remove {
                rule_id,
                reason,
                by,
                at,
            } => {
                check_reason(&reason)?;
                if self.removed.contains(&rule_id) {
                    return Err(DriftRulesError::AlreadyRemoved(rule_id));
                }
                if !self.active.iter().any(|r| r.rule_id == rule_id) {
                    return Err(DriftRulesError::UnknownRule(rule_id));
                }
                DriftRulesEvent::DriftIgnoreRuleRemoved {
                    rule_id,
                    reason,
                    removed_by: by,
                    removed_at: at,
                }
            }
        };
        sink.write(event, self).await;
        Ok(())
    }

    fn apply(&mut self, event: Self::Event) {
        match event {
            DriftRulesEvent::DriftIgnoreRuleAdded {
                tenant_id,
                environment_id,
                rule,
            } => {
                self.tenant_id = Some(tenant_id);
                self.environment_id = Some(environment_id);
                self.active.push(rule);
            }
            DriftRulesEvent::DriftIgnoreRuleRemoved { rule_id, .. } => {
                self.active.retain(|r| r.rule_id != rule_id);
                self.removed.push(rule_id);
            }
        }
    }
}

/// A plan's resources after the ignore rules.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Triage {
    /// What stays in the plan (unchanged resources included).
    pub kept: Vec<PlannedResource>,
    /// What the rules left out.
    pub ignored: Vec<IgnoredDifference>,
    /// Rules that matched a difference they could not leave out, and why (for the receipt's
    /// warnings).
    pub notes: Vec<String>,
}

impl Triage {
    /// Creates, updates, deletes and replaces left in the plan.
    pub fn counts(&self) -> (u32, u32, u32, u32) {
        let count = |op| self.kept.iter().filter(|r| r.op == op).count() as u32;
        (
            count(ResourceOp::Create),
            count(ResourceOp::Update),
            count(ResourceOp::Delete),
            count(ResourceOp::Replace),
        )
    }
}

/// Leaves out of `resources` the differences `rules` accept (see the module doc).
pub fn triage(rules: &[IgnoreRule], resources: Vec<PlannedResource>) -> Triage {
    let mut out = Triage::default();
    for resource in resources {
        if !resource.is_change() {
            out.kept.push(resource);
            continue;
        }
        let urn = resource.urn.as_str();
        let whole: Vec<IgnoreRuleId> = rules
            .iter()
            .filter(|r| r.covers_resource(urn))
            .map(|r| r.rule_id)
            .collect();
        if !whole.is_empty() {
            out.ignored.push(ignored(resource, whole));
            continue;
        }
        let by_property = matches!(resource.op, ResourceOp::Update | ResourceOp::Replace);
        // A create or delete changes the whole resource: a rule on one of its properties
        // matches but cannot leave it out.
        let matching: Vec<&IgnoreRule> = rules
            .iter()
            .filter(|r| {
                resource.properties.iter().any(|p| r.covers(urn, p))
                    || (!by_property && r.urn.as_str() == urn && r.property.is_some())
            })
            .collect();
        if matching.is_empty() {
            out.kept.push(resource);
            continue;
        }
        let uncovered: Vec<&str> = resource
            .properties
            .iter()
            .filter(|p| !matching.iter().any(|r| r.covers(urn, p)))
            .map(String::as_str)
            .collect();
        if by_property && uncovered.is_empty() {
            let ids = matching.iter().map(|r| r.rule_id).collect();
            out.ignored.push(ignored(resource, ids));
            continue;
        }
        for rule in matching {
            out.notes.push(format!(
                "ignore rule {} matches {} of {urn}, but the plan also changes {}: applying it would overwrite the ignored property too, so the difference is shown",
                rule.rule_id,
                rule.property.as_ref().map_or("", PropertyPath::as_str),
                if uncovered.is_empty() { "the whole resource".to_string() } else { uncovered.join(", ") },
            ));
        }
        out.kept.push(resource);
    }
    out
}

fn ignored(resource: PlannedResource, rule_ids: Vec<IgnoreRuleId>) -> IgnoredDifference {
    IgnoredDifference { resource, rule_ids }
}

#[cfg(test)]
mod tests;

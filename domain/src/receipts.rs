//! Plan and apply receipts: what a runner reported, kept verbatim and never changed.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a plan would do to one resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ResourceOp {
    /// Created.
    Create,
    /// Updated in place.
    Update,
    /// Deleted.
    Delete,
    /// Deleted and created again.
    Replace,
    /// Unchanged.
    Same,
    /// Read only (data sources).
    Read,
}

/// One resource of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlannedResource {
    /// The resource's URN.
    pub urn: String,
    /// The resource type token (e.g. `aws:s3/bucket:Bucket`).
    #[serde(rename = "type")]
    pub resource_type: String,
    /// What the plan does to it.
    pub op: ResourceOp,
    /// The properties whose difference causes the update or replacement, as the runner
    /// names them (its `diffReasons` and `replaceReasons`); empty for creates and deletes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub properties: Vec<String>,
}

impl PlannedResource {
    /// Whether the plan changes the resource (creates, updates, deletes or replaces it).
    pub fn is_change(&self) -> bool {
        !matches!(self.op, ResourceOp::Same | ResourceOp::Read)
    }
}

/// A difference the plan found and an environment's ignore rules left out: not counted, not
/// triaged and not applied (the runner is told to leave the resource alone).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IgnoredDifference {
    /// The resource and what the plan would have done to it.
    #[serde(flatten)]
    pub resource: PlannedResource,
    /// The rules that left it out.
    pub rule_ids: Vec<crate::IgnoreRuleId>,
}

/// The outcome of policy on a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PolicyOutcome {
    /// Policy allows the apply.
    Allow,
    /// A person must approve.
    RequireApproval,
    /// Never apply this plan.
    Deny,
}

/// A policy decision with the reasons kept as evidence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyDecision {
    /// The decision.
    pub decision: PolicyOutcome,
    /// Why, one line each; an allow without evidence does not authorise a production apply.
    pub evidence: Vec<String>,
}

/// The plan receipt (adds, changes, deletes, inputs hash, program version).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlanReceipt {
    /// Resources to create.
    pub adds: u32,
    /// Resources to update in place.
    pub changes: u32,
    /// Resources to delete.
    pub deletes: u32,
    /// Resources to replace.
    pub replaces: u32,
    /// Every resource the plan touches (differences ignore rules left out are in `ignored`).
    pub resources: Vec<PlannedResource>,
    /// Differences the environment's ignore rules left out of this plan (reconciliation
    /// runs only); the apply leaves these resources alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ignored: Vec<IgnoredDifference>,
    /// sha256 over program version, resolved configuration and secret reference versions.
    pub inputs_hash: String,
    /// The commit that was planned.
    pub program_version: String,
    /// Which runner made the plan (`pulumi`, `simulated`, `http`).
    pub runner: String,
    /// The runner's version.
    pub runner_version: String,
    /// The policy decision on this plan, if policy was evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyDecision>,
    /// Warnings, e.g. configuration served from the last known good values.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl PlanReceipt {
    /// True when the plan removes anything (deletes or replaces).
    pub fn is_destructive(&self) -> bool {
        self.deletes > 0 || self.replaces > 0
    }

    /// How many resources it would create, update, delete or replace (0: nothing to do).
    pub fn change_count(&self) -> u32 {
        self.adds + self.changes + self.deletes + self.replaces
    }

    /// How `now` (the same program planned again, just before the apply) differs from this
    /// plan, if it does: an approval covers exactly the plan it was shown, so a target that
    /// changed since (drift, a hand edit) makes the plan stale. Compares what each changes
    /// (resource, operation, properties), leaving out the resources this plan ignores.
    pub fn differs_from(&self, now: &[PlannedResource]) -> Option<String> {
        use std::collections::BTreeSet;
        let excluded: BTreeSet<&str> = self
            .ignored
            .iter()
            .map(|d| d.resource.urn.as_str())
            .collect();
        let changes = |resources: &[PlannedResource]| -> BTreeSet<String> {
            resources
                .iter()
                .filter(|r| r.is_change() && !excluded.contains(r.urn.as_str()))
                .map(|r| {
                    let mut properties = r.properties.clone();
                    properties.sort();
                    // The serde name (`update`), as receipts show it.
                    let op = format!("{:?}", r.op).to_lowercase();
                    if properties.is_empty() {
                        format!("{op} {}", r.urn)
                    } else {
                        format!("{op} {} ({})", r.urn, properties.join(", "))
                    }
                })
                .collect()
        };
        let planned = changes(&self.resources);
        let current = changes(now);
        if planned == current {
            return None;
        }
        let list = |set: Vec<&String>| {
            if set.is_empty() {
                "nothing".to_string()
            } else {
                set.into_iter().cloned().collect::<Vec<_>>().join("; ")
            }
        };
        Some(format!(
            "the target changed after the plan: it would now {} instead of {}",
            list(current.difference(&planned).collect()),
            list(planned.difference(&current).collect()),
        ))
    }

    /// The resources the apply must leave alone (those of `ignored`).
    pub fn excluded_urns(&self) -> Vec<String> {
        self.ignored
            .iter()
            .map(|d| d.resource.urn.clone())
            .collect()
    }
}

/// How an apply ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ApplyResult {
    /// Every resource reached its desired state.
    Succeeded,
    /// The runner failed; the infrastructure may be partly changed.
    Failed,
}

/// The apply receipt (outputs, duration, result, runner version).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApplyReceipt {
    /// The program's outputs after the apply.
    pub outputs: BTreeMap<String, serde_json::Value>,
    /// Wall-clock duration of the apply, in seconds.
    pub duration_seconds: f64,
    /// How it ended.
    pub result: ApplyResult,
    /// The runner's version.
    pub runner_version: String,
    /// The resource that failed, where the runner names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failing_resource: Option<String>,
}

//! Diffs the evaluated program (desired) against the simulated cloud (stored) and renders
//! the result as a `pulumi preview --json` document.

use super::cloud::{mint_id, CloudState, StoredResource};
use super::eval::{evaluate, EvaluatedResource, Val};
use super::program::Program;
use crate::preview::{PreviewDocument, PreviewStep, StepState};
use ferry_domain::ports::runner::{RunnerError, RunnerInput};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// What happens to one resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOp {
    /// Not in the cloud yet.
    Create,
    /// Inputs changed; updated in place.
    Update,
    /// A `replaceOnChanges` input changed.
    Replace,
    /// Nothing changed.
    Same,
    /// In the cloud, no longer in the program.
    Delete,
}

impl StepOp {
    fn as_str(self) -> &'static str {
        match self {
            StepOp::Create => "create",
            StepOp::Update => "update",
            StepOp::Replace => "replace",
            StepOp::Same => "same",
            StepOp::Delete => "delete",
        }
    }
}

/// One planned step.
#[derive(Debug, Clone)]
pub struct Change {
    /// The operation.
    pub op: StepOp,
    /// The resource's URN.
    pub urn: String,
    /// The desired resource (absent for deletes).
    pub desired: Option<EvaluatedResource>,
    /// The stored resource (absent for creates).
    pub stored: Option<StoredResource>,
    /// Changed top-level inputs.
    pub diff_reasons: Vec<String>,
    /// Changed inputs that force a replacement.
    pub replace_reasons: Vec<String>,
}

/// A full plan: steps (creates/updates/replaces/sames in dependency order, then deletes)
/// and the evaluated outputs.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The steps.
    pub changes: Vec<Change>,
    /// The program outputs.
    pub outputs: BTreeMap<String, Val>,
}

/// Decides the operation for a desired resource given what is stored under its URN.
fn decide(
    stored: Option<&StoredResource>,
    desired: &EvaluatedResource,
) -> (StepOp, Vec<String>, Vec<String>) {
    let Some(stored) = stored else {
        return (StepOp::Create, Vec::new(), Vec::new());
    };
    let changed = changed_keys(&stored.inputs, &desired.inputs.masked);
    if changed.is_empty() {
        return (StepOp::Same, changed, Vec::new());
    }
    let replace: Vec<String> = changed
        .iter()
        .filter(|k| {
            desired
                .replace_on_changes
                .iter()
                .any(|r| r == *k || r == "*")
        })
        .cloned()
        .collect();
    if replace.is_empty() {
        (StepOp::Update, changed, replace)
    } else {
        (StepOp::Replace, changed, replace)
    }
}

/// Top-level keys whose values differ (a non-object input counts as one key, "").
fn changed_keys(old: &Value, new: &Value) -> Vec<String> {
    let empty = serde_json::Map::new();
    let (o, n) = match (old.as_object(), new.as_object()) {
        (Some(o), Some(n)) => (o, n),
        _ if old == new => (&empty, &empty),
        _ => return vec![String::new()],
    };
    let keys: BTreeSet<&String> = o.keys().chain(n.keys()).collect();
    keys.into_iter()
        .filter(|k| o.get(*k) != n.get(*k))
        .map(|k| k.to_string())
        .collect()
}

/// Plans `program` for `input` against `state`. Deleting or replacing a protected
/// resource fails the plan, naming the resource.
pub fn plan(
    program: &Program,
    input: &RunnerInput,
    state: &CloudState,
) -> Result<Plan, RunnerError> {
    let evaluation = evaluate(program, input, |res| {
        let stored = state.resources.get(&res.urn);
        match (decide(stored, res).0, stored) {
            (StepOp::Same | StepOp::Update, Some(s)) => s.id.clone(),
            _ => mint_id(&res.name, &res.urn, &res.inputs.masked),
        }
    })?;
    let mut changes = Vec::new();
    let desired_urns: BTreeSet<&str> = evaluation
        .resources
        .iter()
        .map(|r| r.urn.as_str())
        .collect();
    for res in &evaluation.resources {
        let stored = state.resources.get(&res.urn);
        let (op, diff_reasons, replace_reasons) = decide(stored, res);
        if op == StepOp::Replace && stored.is_some_and(|s| s.protect) {
            return Err(protected(&res.urn, "replaced"));
        }
        changes.push(Change {
            op,
            urn: res.urn.clone(),
            desired: Some(res.clone()),
            stored: stored.cloned(),
            diff_reasons,
            replace_reasons,
        });
    }
    let deletes: Vec<(&String, &StoredResource)> = state
        .resources
        .iter()
        .filter(|(urn, _)| !desired_urns.contains(urn.as_str()))
        .collect();
    for (urn, stored) in delete_order(deletes) {
        if stored.protect {
            return Err(protected(urn, "deleted"));
        }
        changes.push(Change {
            op: StepOp::Delete,
            urn: urn.clone(),
            desired: None,
            stored: Some(stored.clone()),
            diff_reasons: Vec::new(),
            replace_reasons: Vec::new(),
        });
    }
    Ok(Plan {
        changes,
        outputs: evaluation.outputs,
    })
}

/// Orders deletes so that a resource goes before the resources it depends on (as recorded
/// in state); ties, and cycles from hand-edited state, fall back to URN order.
fn delete_order<'a>(
    mut pending: Vec<(&'a String, &'a StoredResource)>,
) -> Vec<(&'a String, &'a StoredResource)> {
    let mut order = Vec::new();
    while !pending.is_empty() {
        let needed: BTreeSet<&str> = pending
            .iter()
            .flat_map(|(_, s)| s.dependencies.iter().map(String::as_str))
            .collect();
        let next = pending
            .iter()
            .position(|(urn, _)| !needed.contains(urn.as_str()))
            .unwrap_or(0);
        order.push(pending.remove(next));
    }
    order
}

fn protected(urn: &str, what: &str) -> RunnerError {
    let name = urn.rsplit("::").next().unwrap_or(urn);
    RunnerError::ProgramFailed {
        reason: format!(
            "resource '{name}' ({urn}) is protected and would be {what}; remove `protect` first"
        ),
        resource: Some(urn.to_string()),
        log: String::new(),
    }
}

/// The resource as the cloud will store it (masked values only).
pub fn stored_form(res: &EvaluatedResource) -> StoredResource {
    let mut outputs = res.inputs.masked.as_object().cloned().unwrap_or_default();
    outputs.insert("id".into(), Value::from(res.id.clone()));
    StoredResource {
        resource_type: res.resource_type.clone(),
        id: res.id.clone(),
        inputs: res.inputs.masked.clone(),
        outputs: Value::Object(outputs),
        protect: res.protect,
        dependencies: res.dependencies.clone(),
    }
}

fn state_of(urn: &str, s: &StoredResource) -> StepState {
    StepState {
        urn: urn.to_string(),
        resource_type: s.resource_type.clone(),
        custom: true,
        id: Some(s.id.clone()),
        protect: s.protect,
        inputs: Some(s.inputs.clone()),
        outputs: Some(s.outputs.clone()),
    }
}

/// Renders the plan in the shape `pulumi preview --json` prints.
pub fn to_document(plan: &Plan) -> PreviewDocument {
    let mut doc = PreviewDocument::default();
    for c in &plan.changes {
        doc.steps.push(PreviewStep {
            op: c.op.as_str().to_string(),
            urn: c.urn.clone(),
            old_state: c.stored.as_ref().map(|s| state_of(&c.urn, s)),
            new_state: c
                .desired
                .as_ref()
                .map(|d| state_of(&c.urn, &stored_form(d))),
            diff_reasons: c.diff_reasons.clone(),
            replace_reasons: c.replace_reasons.clone(),
        });
        *doc.change_summary
            .entry(c.op.as_str().to_string())
            .or_insert(0) += 1;
    }
    doc
}

//! The `pulumi preview --json` document: its shape (shared by every runner, the simulated
//! one emits it too) and [`parse_preview`], the one parser that turns it into a
//! [`PlanSummary`].

use ferry_domain::ports::runner::{PlanSummary, RunnerError};
use ferry_domain::receipts::{PlannedResource, ResourceOp};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};

/// The document `pulumi preview --json` prints (only the fields Ferry reads or writes;
/// unknown fields are ignored when reading).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreviewDocument {
    /// The stack configuration as Pulumi prints it (secrets blinded).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub config: BTreeMap<String, serde_json::Value>,
    /// One entry per step the engine would take.
    #[serde(default)]
    pub steps: Vec<PreviewStep>,
    /// Diagnostics (errors and warnings) the engine reported.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub diagnostics: Vec<serde_json::Value>,
    /// Counts by operation, e.g. `{"create": 16}`.
    #[serde(default)]
    pub change_summary: BTreeMap<String, u32>,
}

/// One step of a preview.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreviewStep {
    /// `create`, `update`, `delete`, `replace`, `same`, `read`, ...
    pub op: String,
    /// The resource's URN.
    pub urn: String,
    /// The state before the step (absent for creates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_state: Option<StepState>,
    /// The state after the step (absent for deletes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_state: Option<StepState>,
    /// Top-level properties whose change causes an update.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub diff_reasons: Vec<String>,
    /// Top-level properties whose change forces a replacement.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replace_reasons: Vec<String>,
}

/// A resource state inside a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepState {
    /// The resource's URN.
    #[serde(default)]
    pub urn: String,
    /// The type token.
    #[serde(rename = "type", default)]
    pub resource_type: String,
    /// Whether this is a custom (provider-managed) resource.
    #[serde(default)]
    pub custom: bool,
    /// The provider-assigned id, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Whether the resource is protected from deletion.
    #[serde(default)]
    pub protect: bool,
    /// Input properties.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inputs: Option<serde_json::Value>,
    /// Output properties.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs: Option<serde_json::Value>,
}

/// Parses a `pulumi preview --json` document into counts and the resource list.
///
/// `create`/`update`/`delete`/`replace` are counted; a `create-replacement` and
/// `delete-replaced` pair (and any `replace` step) on one URN is one replace, counted once;
/// `same`, `read` and `refresh` steps are listed but not counted.
pub fn parse_preview(json: &[u8]) -> Result<PlanSummary, RunnerError> {
    let doc: PreviewDocument = serde_json::from_slice(json).map_err(|e| {
        RunnerError::BadOutput(format!(
            "preview output is not a pulumi preview JSON document: {e}"
        ))
    })?;
    summarize(&doc)
}

/// Turns an already parsed document into a [`PlanSummary`] (see [`parse_preview`]).
pub fn summarize(doc: &PreviewDocument) -> Result<PlanSummary, RunnerError> {
    let mut plan = PlanSummary::default();
    let mut replaced: HashSet<&str> = HashSet::new();
    for step in &doc.steps {
        if step.urn.is_empty() {
            return Err(RunnerError::BadOutput(format!(
                "preview step with op '{}' has no urn",
                step.op
            )));
        }
        let op = match step.op.as_str() {
            "create" | "import" => ResourceOp::Create,
            "update" => ResourceOp::Update,
            "delete" | "discard" => ResourceOp::Delete,
            "replace" | "create-replacement" | "delete-replaced" | "import-replacement"
            | "read-replacement" => ResourceOp::Replace,
            "same" => ResourceOp::Same,
            "read" | "refresh" | "read-discard" | "remove-pending-replace" => ResourceOp::Read,
            other => {
                return Err(RunnerError::BadOutput(format!(
                    "preview step for {} has unknown op '{other}'",
                    step.urn
                )))
            }
        };
        // The pair of steps of one replacement is listed and counted once.
        if op == ResourceOp::Replace && !replaced.insert(step.urn.as_str()) {
            continue;
        }
        match op {
            ResourceOp::Create => plan.adds += 1,
            ResourceOp::Update => plan.changes += 1,
            ResourceOp::Delete => plan.deletes += 1,
            ResourceOp::Replace => plan.replaces += 1,
            ResourceOp::Same | ResourceOp::Read => {}
        }
        let mut properties: Vec<String> = step
            .diff_reasons
            .iter()
            .chain(&step.replace_reasons)
            .cloned()
            .collect();
        properties.sort();
        properties.dedup();
        plan.resources.push(PlannedResource {
            urn: step.urn.clone(),
            resource_type: step_type(step)?,
            op,
            properties,
        });
    }
    check_change_summary(doc, &plan);
    Ok(plan)
}

/// The type of a step: from its new or old state, else from its URN.
fn step_type(step: &PreviewStep) -> Result<String, RunnerError> {
    let from_state = [&step.new_state, &step.old_state]
        .into_iter()
        .flatten()
        .map(|s| s.resource_type.as_str())
        .find(|t| !t.is_empty());
    match from_state {
        Some(t) => Ok(t.to_string()),
        None => type_from_urn(&step.urn).ok_or_else(|| {
            RunnerError::BadOutput(format!("cannot tell the resource type of '{}'", step.urn))
        }),
    }
}

/// The type token of a URN: `urn:pulumi:stack::project::parent$type::name` → `type`.
pub fn type_from_urn(urn: &str) -> Option<String> {
    if !urn.starts_with("urn:pulumi:") {
        return None;
    }
    let qualified = urn.split("::").nth(2)?;
    let last = qualified.rsplit('$').next()?;
    (!last.is_empty()).then(|| last.to_string())
}

/// Logs (does not fail) when the counts disagree with the document's own `changeSummary`:
/// the step list is the authority, but a disagreement is worth seeing.
fn check_change_summary(doc: &PreviewDocument, plan: &PlanSummary) {
    if doc.change_summary.is_empty() {
        return;
    }
    let get = |k: &str| doc.change_summary.get(k).copied().unwrap_or(0);
    let expected = (get("create"), get("update"), get("delete"), get("replace"));
    let actual = (plan.adds, plan.changes, plan.deletes, plan.replaces);
    if expected != actual {
        tracing::warn!(
            ?expected,
            ?actual,
            "preview steps disagree with its changeSummary"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/tests/fixtures/pulumi/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("fixture {path}: {e}"))
    }

    fn summary_of(bytes: &[u8]) -> BTreeMap<String, u32> {
        let doc: PreviewDocument = serde_json::from_slice(bytes).unwrap();
        doc.change_summary
    }

    #[test]
    fn creates_fixture() {
        let bytes = fixture("preview-creates.json");
        let plan = parse_preview(&bytes).unwrap();
        assert_eq!(
            (plan.adds, plan.changes, plan.deletes, plan.replaces),
            (16, 0, 0, 0)
        );
        assert_eq!(plan.resources.len(), 16);
        assert!(plan.resources.iter().all(|r| r.op == ResourceOp::Create));
        assert_eq!(
            plan.resources[0],
            PlannedResource {
                urn: "urn:pulumi:dev::sample::pulumi:pulumi:Stack::sample-dev".into(),
                resource_type: "pulumi:pulumi:Stack".into(),
                op: ResourceOp::Create,
                properties: Vec::new(),
            }
        );
        assert_eq!(
            plan.resources[1],
            PlannedResource {
                urn: "urn:pulumi:dev::sample::aws:s3/bucket:Bucket::docs".into(),
                resource_type: "aws:s3/bucket:Bucket".into(),
                op: ResourceOp::Create,
                properties: Vec::new(),
            }
        );
        assert_eq!(
            plan.resources[13],
            PlannedResource {
                urn: "urn:pulumi:dev::sample::aws:s3/bucket:Bucket$aws:s3:BucketEventSubscription$aws:lambda/function:Function::docsHandler".into(),
                resource_type: "aws:lambda/function:Function".into(),
                op: ResourceOp::Create,
                properties: Vec::new(),
            }
        );
        let cs = summary_of(&bytes);
        assert_eq!(cs.get("create").copied(), Some(plan.adds));
        assert_eq!(cs.len(), 1);
    }

    #[test]
    fn update_fixture() {
        let bytes = fixture("preview-update.json");
        let plan = parse_preview(&bytes).unwrap();
        assert_eq!(
            (plan.adds, plan.changes, plan.deletes, plan.replaces),
            (0, 1, 0, 0)
        );
        assert_eq!(plan.resources.len(), 16);
        let same = plan
            .resources
            .iter()
            .filter(|r| r.op == ResourceOp::Same)
            .count();
        assert_eq!(same, 15);
        let updated: Vec<_> = plan
            .resources
            .iter()
            .filter(|r| r.op == ResourceOp::Update)
            .collect();
        assert_eq!(
            updated,
            vec![&PlannedResource {
                urn: "urn:pulumi:dev::sample::aws:s3/bucket:Bucket$aws:s3:BucketEventSubscription$aws:lambda/function:Function::docsHandler".into(),
                resource_type: "aws:lambda/function:Function".into(),
                op: ResourceOp::Update,
                // The real document's `diffReasons`: what an ignore rule can name.
                properties: vec!["code".to_string()],
            }]
        );
        let cs = summary_of(&bytes);
        assert_eq!(cs.get("same").copied(), Some(same as u32));
        assert_eq!(cs.get("update").copied(), Some(plan.changes));
    }

    #[test]
    fn replacement_pair_counts_once_and_types_come_from_urn() {
        let json = br#"{"steps":[
            {"op":"create-replacement","urn":"urn:pulumi:s::p::aws:s3/bucket:Bucket::b"},
            {"op":"replace","urn":"urn:pulumi:s::p::aws:s3/bucket:Bucket::b"},
            {"op":"delete-replaced","urn":"urn:pulumi:s::p::aws:s3/bucket:Bucket::b"},
            {"op":"delete","urn":"urn:pulumi:s::p::my:mod:Parent$aws:iam/role:Role::r"},
            {"op":"read","urn":"urn:pulumi:s::p::aws:ec2/vpc:Vpc::v"},
            {"op":"refresh","urn":"urn:pulumi:s::p::aws:ec2/vpc:Vpc::w"}
        ],"changeSummary":{"replace":1,"delete":1}}"#;
        let plan = parse_preview(json).unwrap();
        assert_eq!(
            (plan.adds, plan.changes, plan.deletes, plan.replaces),
            (0, 0, 1, 1)
        );
        assert_eq!(plan.resources.len(), 4);
        assert_eq!(plan.resources[0].op, ResourceOp::Replace);
        assert_eq!(plan.resources[0].resource_type, "aws:s3/bucket:Bucket");
        assert_eq!(plan.resources[1].resource_type, "aws:iam/role:Role");
        assert_eq!(plan.resources[2].op, ResourceOp::Read);
        assert_eq!(plan.resources[3].op, ResourceOp::Read);
    }

    #[test]
    fn urn_type_parsing() {
        assert_eq!(
            type_from_urn("urn:pulumi:dev::sample::a:b:C$d:e:F::name").as_deref(),
            Some("d:e:F")
        );
        assert_eq!(type_from_urn("not-a-urn"), None);
        assert_eq!(type_from_urn("urn:pulumi:dev::sample"), None);
    }

    #[test]
    fn bad_input_is_bad_output() {
        for bad in [
            &b"garbage"[..],
            b"",
            b"[1,2]",
            br#"{"steps":[{"op":"create"}]}"#,
        ] {
            match parse_preview(bad) {
                Err(RunnerError::BadOutput(reason)) => assert!(!reason.is_empty()),
                other => panic!("expected BadOutput for {bad:?}, got {other:?}"),
            }
        }
        let unknown = br#"{"steps":[{"op":"explode","urn":"urn:pulumi:s::p::t:t:T::n"}]}"#;
        match parse_preview(unknown) {
            Err(RunnerError::BadOutput(reason)) => assert!(reason.contains("explode")),
            other => panic!("got {other:?}"),
        }
        let untyped = br#"{"steps":[{"op":"create","urn":"weird"}]}"#;
        assert!(matches!(
            parse_preview(untyped),
            Err(RunnerError::BadOutput(_))
        ));
    }
}

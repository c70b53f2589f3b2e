//! The gates' rules: from the evidence gathered for a promotion to each gate's result. Pure,
//! so that every path that evaluates gates (a request, a queued promotion, a rollback) gets
//! the same answer from the same evidence, and the evidence is what the result keeps.

use super::{GateKind, GateOutcome, GateResult, Hotfix};
use crate::ids::{EnvironmentId, PromotionId};
use crate::ports::sources::DeploymentDecision;
use crate::receipts::PolicyOutcome;
use crate::release::{PipelineOutcome, ReleaseRecord};
use crate::values::EnvironmentClass;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The environment classes a release goes through, in order (`PromotionPath`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "Vec<EnvironmentClass>", into = "Vec<EnvironmentClass>")]
pub struct PromotionPath(Vec<EnvironmentClass>);

/// Why a promotion path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// No class at all.
    #[error("must name at least one environment class")]
    Empty,
    /// A class named twice.
    #[error("names {0:?} twice")]
    Duplicate(EnvironmentClass),
}

impl PromotionPath {
    /// Validates a path: at least one class, none twice.
    pub fn parse(classes: Vec<EnvironmentClass>) -> Result<Self, PathError> {
        if classes.is_empty() {
            return Err(PathError::Empty);
        }
        for (i, class) in classes.iter().enumerate() {
            if classes[..i].contains(class) {
                return Err(PathError::Duplicate(*class));
            }
        }
        Ok(Self(classes))
    }

    /// The classes, in order.
    pub fn classes(&self) -> &[EnvironmentClass] {
        &self.0
    }

    /// Where `class` stands: `Ok(None)` for the first class, `Ok(Some(prior))` after it,
    /// `Err(())` when the path does not name it.
    fn prior(&self, class: EnvironmentClass) -> Result<Option<EnvironmentClass>, ()> {
        let at = self.0.iter().position(|c| *c == class).ok_or(())?;
        Ok(at.checked_sub(1).map(|i| self.0[i]))
    }

    fn describe(&self) -> String {
        self.0
            .iter()
            .map(|c| class_name(*c))
            .collect::<Vec<_>>()
            .join(" → ")
    }
}

impl Default for PromotionPath {
    fn default() -> Self {
        Self(vec![
            EnvironmentClass::Development,
            EnvironmentClass::Test,
            EnvironmentClass::Staging,
            EnvironmentClass::Production,
        ])
    }
}

impl TryFrom<Vec<EnvironmentClass>> for PromotionPath {
    type Error = PathError;
    fn try_from(classes: Vec<EnvironmentClass>) -> Result<Self, PathError> {
        Self::parse(classes)
    }
}

impl From<PromotionPath> for Vec<EnvironmentClass> {
    fn from(path: PromotionPath) -> Self {
        path.0
    }
}

fn class_name(class: EnvironmentClass) -> &'static str {
    match class {
        EnvironmentClass::Development => "development",
        EnvironmentClass::Test => "test",
        EnvironmentClass::Staging => "staging",
        EnvironmentClass::Production => "production",
    }
}

fn result(
    kind: GateKind,
    outcome: GateOutcome,
    reasons: Vec<String>,
    evidence: serde_json::Value,
    at: DateTime<Utc>,
) -> GateResult {
    GateResult {
        kind,
        outcome,
        reasons,
        evidence,
        evaluated_at: at,
    }
}

/// (1) Every pipeline stage passed, and the release is not withdrawn.
pub fn pipeline_results(record: &ReleaseRecord, withdrawn: bool, at: DateTime<Utc>) -> GateResult {
    let failed: Vec<&str> = record
        .pipeline
        .iter()
        .filter(|stage| stage.result == PipelineOutcome::Failed)
        .map(|stage| stage.name.as_str())
        .collect();
    let mut reasons = Vec::new();
    if withdrawn {
        reasons.push(format!("release {} was withdrawn", record.version));
    }
    if record.pipeline.is_empty() {
        reasons.push(format!(
            "release {} reports no pipeline results",
            record.version
        ));
    }
    if !failed.is_empty() {
        reasons.push(format!("pipeline stages failed: {}", failed.join(", ")));
    }
    if let Some(problem) = &record.program_problem {
        reasons.push(format!(
            "release {}'s program cannot be deployed: {problem}",
            record.version
        ));
    }
    let evidence = json!({"pipeline": record.pipeline, "withdrawn": withdrawn,
                          "programProblem": record.program_problem});
    if reasons.is_empty() {
        let passed = vec![format!(
            "all {} pipeline stages passed",
            record.pipeline.len()
        )];
        result(
            GateKind::PipelineResults,
            GateOutcome::Passed,
            passed,
            evidence,
            at,
        )
    } else {
        result(
            GateKind::PipelineResults,
            GateOutcome::Failed,
            reasons,
            evidence,
            at,
        )
    }
}

/// (2) The deployment-domain policy: deny fails the gate; require approval passes it and
/// asks for an approval (the second value); allow passes.
pub fn policy(decision: &DeploymentDecision, at: DateTime<Utc>) -> (GateResult, bool) {
    let d = &decision.decision;
    let evidence = json!({
        "decision": match d.decision {
            PolicyOutcome::Allow => "allow",
            PolicyOutcome::RequireApproval => "require_approval",
            PolicyOutcome::Deny => "deny",
        },
        "evidence": d.evidence,
        "hotfix": decision.hotfix_allowed,
    });
    let outcome = if d.decision == PolicyOutcome::Deny {
        GateOutcome::Failed
    } else {
        GateOutcome::Passed
    };
    (
        result(GateKind::Policy, outcome, d.evidence.clone(), evidence, at),
        d.decision == PolicyOutcome::RequireApproval,
    )
}

/// A promotion of the release that completed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Completion {
    /// The environment it completed in.
    pub environment_id: EnvironmentId,
    /// That environment's class.
    pub environment_class: EnvironmentClass,
    /// The promotion.
    pub promotion_id: PromotionId,
    /// When.
    pub completed_at: DateTime<Utc>,
}

/// (3) The release completed in the prior class of the path, unless a hotfix that policy
/// allows skips it (with the reason and policy's words as evidence).
pub fn prior_environment(
    path: &PromotionPath,
    class: EnvironmentClass,
    completions: &[Completion],
    hotfix: Option<&Hotfix>,
    hotfix_allowed: &[String],
    at: DateTime<Utc>,
) -> GateResult {
    let kind = GateKind::PriorEnvironment;
    let prior = match path.prior(class) {
        Ok(None) => {
            return result(
                kind,
                GateOutcome::NotApplicable,
                vec![format!(
                    "{} is the first class of the promotion path {}",
                    class_name(class),
                    path.describe()
                )],
                json!({"path": path.classes()}),
                at,
            )
        }
        Ok(Some(prior)) => prior,
        Err(()) => {
            return result(
                kind,
                GateOutcome::Failed,
                vec![format!(
                    "{} is not on the promotion path {}",
                    class_name(class),
                    path.describe()
                )],
                json!({"path": path.classes()}),
                at,
            )
        }
    };
    if let Some(done) = completions.iter().find(|c| c.environment_class == prior) {
        return result(
            kind,
            GateOutcome::Passed,
            vec![format!(
                "the release completed in {} environment {}",
                class_name(prior),
                done.environment_id
            )],
            json!({"path": path.classes(), "prior": prior, "completion": done}),
            at,
        );
    }
    match hotfix {
        Some(hotfix) if !hotfix_allowed.is_empty() => {
            let mut reasons = vec![format!(
                "hotfix skips {} ({}): allowed by policy",
                class_name(prior),
                hotfix.reason
            )];
            reasons.extend(hotfix_allowed.iter().cloned());
            result(
                kind,
                GateOutcome::Passed,
                reasons,
                json!({"path": path.classes(), "prior": prior, "hotfix": hotfix, "policy": hotfix_allowed}),
                at,
            )
        }
        _ => {
            let mut reasons = vec![format!(
                "the release has not completed in a {} environment, the class before {} on the promotion path {}",
                class_name(prior),
                class_name(class),
                path.describe()
            )];
            if hotfix.is_some() {
                reasons.push("policy does not allow this hotfix to skip the path".to_string());
            }
            result(
                kind,
                GateOutcome::Failed,
                reasons,
                json!({"path": path.classes(), "prior": prior, "hotfix": hotfix, "completions": completions}),
                at,
            )
        }
    }
}

/// What is known of an environment's readiness.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", tag = "source")]
pub enum Readiness {
    /// The environment service reported it.
    #[serde(rename_all = "camelCase")]
    Reported {
        /// Ready to receive changes.
        ready: bool,
        /// The state it named.
        state: String,
        /// When it observed it.
        observed_at: Option<DateTime<Utc>>,
    },
    /// No report: Ferry probed the health URL.
    #[serde(rename_all = "camelCase")]
    Probed {
        /// The URL.
        url: String,
        /// The HTTP status, when it answered.
        status: Option<u16>,
        /// Why it did not answer.
        error: Option<String>,
    },
    /// Nothing to go on.
    #[serde(rename_all = "camelCase")]
    Unknown {
        /// Why.
        reason: String,
    },
}

/// (4) The environment is ready: reported so, or its health URL answered 2xx.
pub fn environment_ready(
    environment: &EnvironmentId,
    readiness: &Readiness,
    at: DateTime<Utc>,
) -> GateResult {
    let kind = GateKind::EnvironmentReady;
    let evidence = json!(readiness);
    let (outcome, reason) = match readiness {
        Readiness::Reported {
            ready: true, state, ..
        } => (
            GateOutcome::Passed,
            format!("environment {environment} reported {state}"),
        ),
        Readiness::Reported {
            ready: false,
            state,
            ..
        } => (
            GateOutcome::Failed,
            format!("environment {environment} is not ready (it reported {state})"),
        ),
        Readiness::Probed {
            url,
            status: Some(status),
            ..
        } if (200..300).contains(status) => (
            GateOutcome::Passed,
            format!("the health URL {url} answered {status}"),
        ),
        Readiness::Probed {
            url,
            status: Some(status),
            ..
        } => (
            GateOutcome::Failed,
            format!("the health URL {url} answered {status}"),
        ),
        Readiness::Probed { url, error, .. } => (
            GateOutcome::Failed,
            format!(
                "the health URL {url} did not answer: {}",
                error.as_deref().unwrap_or("no response")
            ),
        ),
        Readiness::Unknown { reason } => (
            GateOutcome::Failed,
            format!("environment {environment} readiness is unknown: {reason}"),
        ),
    };
    result(kind, outcome, vec![reason], evidence, at)
}

/// (5) Agent-generated assets carry passing evaluation evidence.
pub fn evaluation_evidence(record: &ReleaseRecord, at: DateTime<Utc>) -> GateResult {
    let kind = GateKind::EvaluationEvidence;
    let evidence = json!({
        "hasAgentGeneratedAssets": record.has_agent_generated_assets,
        "evaluationEvidence": record.evaluation_evidence,
    });
    let (outcome, reason) = match (
        &record.has_agent_generated_assets,
        &record.evaluation_evidence,
    ) {
        (false, _) => (
            GateOutcome::NotApplicable,
            "the release carries no agent-generated assets".to_string(),
        ),
        (true, None) => (
            GateOutcome::Failed,
            "the release carries agent-generated assets but no evaluation evidence".to_string(),
        ),
        (true, Some(e)) if !e.passed => (
            GateOutcome::Failed,
            format!(
                "the evaluation of its agent-generated assets failed{}",
                e.summary
                    .as_deref()
                    .map(|s| format!(": {s}"))
                    .unwrap_or_default()
            ),
        ),
        (true, Some(_)) => (
            GateOutcome::Passed,
            "the evaluation of its agent-generated assets passed".to_string(),
        ),
    };
    result(kind, outcome, vec![reason], evidence, at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Actor, ProjectId, ReleaseId, TenantId};
    use crate::receipts::PolicyDecision;
    use crate::release::{EvaluationEvidence, PipelineResult, ReleaseVersion};
    use crate::values::{ProgramRef, ProgramVersion};

    fn at() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap_or_default()
    }

    fn record(stages: &[(&str, PipelineOutcome)]) -> ReleaseRecord {
        ReleaseRecord {
            release_id: ReleaseId::from_uuid(uuid::Uuid::from_u128(5)),
            tenant_id: TenantId::parse("acme").unwrap(),
            project_id: ProjectId::parse("payments").unwrap(),
            version: ReleaseVersion::parse("2.3.0").unwrap(),
            program_ref: ProgramRef::parse("https://git.example.com/p.git").unwrap(),
            program_version: ProgramVersion::parse("3f2a9c1").unwrap(),
            pipeline: stages
                .iter()
                .map(|(name, result)| PipelineResult {
                    name: name.to_string(),
                    result: *result,
                    url: None,
                })
                .collect(),
            has_agent_generated_assets: false,
            evaluation_evidence: None,
            smoke_checks: Vec::new(),
            program_problem: None,
            recorded_by: Actor::parse("ci").unwrap(),
            recorded_at: at(),
        }
    }

    fn completion(class: EnvironmentClass) -> Completion {
        Completion {
            environment_id: EnvironmentId::parse("payments-staging").unwrap(),
            environment_class: class,
            promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(3)),
            completed_at: at(),
        }
    }

    #[test]
    fn a_path_names_each_class_once() {
        assert!(PromotionPath::parse(vec![]).is_err());
        assert_eq!(
            PromotionPath::parse(vec![EnvironmentClass::Test, EnvironmentClass::Test]),
            Err(PathError::Duplicate(EnvironmentClass::Test))
        );
        let path: PromotionPath =
            serde_json::from_str(r#"["development","staging","production"]"#).unwrap();
        assert_eq!(
            path.prior(EnvironmentClass::Production),
            Ok(Some(EnvironmentClass::Staging))
        );
        assert_eq!(path.prior(EnvironmentClass::Development), Ok(None));
        assert_eq!(path.prior(EnvironmentClass::Test), Err(()));
    }

    #[test]
    fn the_pipeline_gate_names_the_failed_stages_and_a_withdrawal() {
        let ok = record(&[
            ("unit", PipelineOutcome::Passed),
            ("e2e", PipelineOutcome::Passed),
        ]);
        assert_eq!(
            pipeline_results(&ok, false, at()).outcome,
            GateOutcome::Passed
        );
        let bad = record(&[
            ("unit", PipelineOutcome::Passed),
            ("e2e", PipelineOutcome::Failed),
        ]);
        let gate = pipeline_results(&bad, true, at());
        assert_eq!(gate.outcome, GateOutcome::Failed);
        assert_eq!(
            gate.reasons,
            vec!["release 2.3.0 was withdrawn", "pipeline stages failed: e2e"]
        );
        assert_eq!(
            pipeline_results(&record(&[]), false, at()).outcome,
            GateOutcome::Failed
        );
    }

    #[test]
    fn the_policy_gate_fails_on_deny_and_asks_for_approval_on_require_approval() {
        let decide = |decision| DeploymentDecision {
            decision: PolicyDecision {
                decision,
                evidence: vec!["said so".to_string()],
            },
            hotfix_allowed: vec![],
        };
        let (gate, approval) = policy(&decide(PolicyOutcome::Deny), at());
        assert_eq!((gate.outcome, approval), (GateOutcome::Failed, false));
        let (gate, approval) = policy(&decide(PolicyOutcome::RequireApproval), at());
        assert_eq!((gate.outcome, approval), (GateOutcome::Passed, true));
        let (gate, approval) = policy(&decide(PolicyOutcome::Allow), at());
        assert_eq!((gate.outcome, approval), (GateOutcome::Passed, false));
        assert_eq!(gate.evidence["decision"], "allow");
    }

    #[test]
    fn the_prior_class_must_have_been_completed_unless_a_hotfix_is_allowed() {
        let path = PromotionPath::default();
        let prod = EnvironmentClass::Production;
        let gate = prior_environment(
            &path,
            prod,
            &[completion(EnvironmentClass::Test)],
            None,
            &[],
            at(),
        );
        assert_eq!(gate.outcome, GateOutcome::Failed);
        assert_eq!(
            gate.reasons[0],
            "the release has not completed in a staging environment, the class before production on the promotion path development → test → staging → production"
        );
        let passed = prior_environment(
            &path,
            prod,
            &[completion(EnvironmentClass::Staging)],
            None,
            &[],
            at(),
        );
        assert_eq!(passed.outcome, GateOutcome::Passed);
        assert_eq!(
            passed.evidence["completion"]["environmentId"],
            "payments-staging"
        );
        let hotfix = Hotfix {
            reason: "CVE-2026-1".to_string(),
        };
        let refused = prior_environment(&path, prod, &[], Some(&hotfix), &[], at());
        assert_eq!(refused.outcome, GateOutcome::Failed);
        assert_eq!(
            refused.reasons[1],
            "policy does not allow this hotfix to skip the path"
        );
        let allowed = prior_environment(
            &path,
            prod,
            &[],
            Some(&hotfix),
            &["team allows hotfixes".to_string()],
            at(),
        );
        assert_eq!(allowed.outcome, GateOutcome::Passed);
        assert_eq!(allowed.evidence["hotfix"]["reason"], "CVE-2026-1");
        let first = prior_environment(&path, EnvironmentClass::Development, &[], None, &[], at());
        assert_eq!(first.outcome, GateOutcome::NotApplicable);
    }

    #[test]
    fn readiness_is_reported_or_probed() {
        let env = EnvironmentId::parse("payments-prod").unwrap();
        let reported = |ready| Readiness::Reported {
            ready,
            state: if ready { "Ready" } else { "Degraded" }.to_string(),
            observed_at: None,
        };
        assert_eq!(
            environment_ready(&env, &reported(true), at()).outcome,
            GateOutcome::Passed
        );
        assert_eq!(
            environment_ready(&env, &reported(false), at()).outcome,
            GateOutcome::Failed
        );
        let probed = |status: Option<u16>| Readiness::Probed {
            url: "http://127.0.0.1:1/healthz".to_string(),
            status,
            error: status.is_none().then(|| "connection refused".to_string()),
        };
        assert_eq!(
            environment_ready(&env, &probed(Some(204)), at()).outcome,
            GateOutcome::Passed
        );
        assert_eq!(
            environment_ready(&env, &probed(Some(503)), at()).outcome,
            GateOutcome::Failed
        );
        let refused = environment_ready(&env, &probed(None), at());
        assert_eq!(refused.outcome, GateOutcome::Failed);
        assert!(refused.reasons[0].contains("connection refused"));
        assert_eq!(refused.evidence["source"], "probed");
    }

    #[test]
    fn agent_generated_assets_need_passing_evidence() {
        let mut r = record(&[("unit", PipelineOutcome::Passed)]);
        assert_eq!(
            evaluation_evidence(&r, at()).outcome,
            GateOutcome::NotApplicable
        );
        r.has_agent_generated_assets = true;
        assert_eq!(evaluation_evidence(&r, at()).outcome, GateOutcome::Failed);
        r.evaluation_evidence = Some(EvaluationEvidence {
            passed: false,
            reference: None,
            summary: Some("hallucinated API".to_string()),
        });
        let failed = evaluation_evidence(&r, at());
        assert_eq!(
            failed.reasons[0],
            "the evaluation of its agent-generated assets failed: hallucinated API"
        );
        r.evaluation_evidence = Some(EvaluationEvidence {
            passed: true,
            reference: Some("https://evals.example.com/7".to_string()),
            summary: None,
        });
        assert_eq!(evaluation_evidence(&r, at()).outcome, GateOutcome::Passed);
    }
}

//! Policy on every plan: OPA Rego evaluated with `regorus`.
//!
//! The engine holds Ferry's built-in policy set (`adapters/policies/*.rego`, embedded in
//! the binary) plus every `.rego` file of the configured folder (not its sub-folders), in
//! file-name order. A plan's [`PolicyInput`] is the Rego `input` (camelCase fields:
//! `environmentId`, `environmentClass` — `null` when unknown —, `kind`,
//! `hasPromotionApproval`, `rollback`, `adds`, `changes`, `deletes`, `replaces`, `resources` with
//! `urn`, `type`, `op`).
//!
//! # How policies combine
//!
//! Policies take part by adding one-line reasons to three partial sets of
//! `package ferry.policy`: `deny`, `require_approval` and `allow`. Files in other packages
//! may hold helpers but decide nothing. One query reads the package, and:
//!
//! 1. any `deny` reason → **deny**;
//! 2. else any `require_approval` reason → **require_approval**;
//! 3. else any `allow` reason → **allow**;
//! 4. else (nothing allowed the plan) → **require_approval**, failing safe.
//!
//! The evidence is every reason, the deciding ones first, each prefixed with its set
//! (`deny: …`, `require_approval: …`, `allow: …`), so an allow always carries evidence and a
//! denial shows what else was said. A custom policy can therefore tighten the defaults
//! (deny, require approval) but never loosen them: an `allow` does not outweigh a built-in
//! `require_approval`.
//!
//! # The built-in policy set
//!
//! * Production (and an unknown class, which counts as production): a plan with deletes or
//!   replaces always requires approval; a release or decommission requires the promotion's
//!   approval; with that approval, or for a baseline or reconciliation, a non-destructive
//!   plan is allowed with evidence. A rollback's run (`rollback`: it restores the previous
//!   release under the rollback's own authority) is allowed, deletes included.
//! * Development, test and staging: allowed, with the plan's counts as the reason.
//!
//! # Promotions: `package ferry.deployment`
//!
//! The policy gate of a promotion evaluates `package ferry.deployment` with a
//! [`DeploymentPolicyInput`] (`environmentId`, `environmentClass` — absent when unknown —,
//! `projectId`, `releaseId`,
//! `releaseVersion`, `hotfix` — the reason, absent unless a hotfix —, `rollback`,
//! `hasAgentGeneratedAssets`). Its `deny`, `require_approval` and `allow` sets combine as
//! above; its `hotfix` set lists why a hotfix may skip the prior environment class of the
//! promotion path, and an empty set means it may not. Built in: production (or an unknown
//! class) requires an approval except for a rollback; other classes are allowed; no hotfix
//! is allowed (a team allows them in its own policy).
//!
//! A policy file that does not parse or compile fails [`RegoPolicy::load`] with the file
//! name and the line.

use ferry_domain::ports::sources::{
    DeploymentDecision, DeploymentPolicy, DeploymentPolicyInput, PolicyEngine, PolicyError,
    PolicyInput,
};
use ferry_domain::receipts::{PlannedResource, PolicyDecision, PolicyOutcome, ResourceOp};
use ferry_domain::values::ProvisioningKind;
use std::path::{Path, PathBuf};

/// The built-in policy set, by file name.
const BUILT_IN: [(&str, &str); 4] = [
    (
        "builtin/deployment.rego",
        include_str!("../policies/deployment.rego"),
    ),
    (
        "builtin/common.rego",
        include_str!("../policies/common.rego"),
    ),
    (
        "builtin/production.rego",
        include_str!("../policies/production.rego"),
    ),
    (
        "builtin/non_production.rego",
        include_str!("../policies/non_production.rego"),
    ),
];

/// The package whose `deny`, `require_approval` and `allow` sets decide.
const DECISION_QUERY: &str = "data.ferry.policy";
/// The package whose `deny`, `require_approval`, `allow` and `hotfix` sets decide promotions.
const DEPLOYMENT_QUERY: &str = "data.ferry.deployment";

/// Why the policies could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyLoadError {
    /// The policy folder could not be read.
    #[error("policy folder {folder}: {reason}")]
    Folder {
        /// The folder.
        folder: PathBuf,
        /// Why.
        reason: String,
    },
    /// A policy file does not parse or compile.
    #[error(
        "policy file {file}{} does not compile: {message}",
        line.map(|l| format!(" line {l}")).unwrap_or_default()
    )]
    Compile {
        /// The file.
        file: String,
        /// The line, when regorus names one.
        line: Option<u32>,
        /// regorus's message (it shows the offending line and column).
        message: String,
    },
}

/// Rego policies evaluated on every plan.
#[derive(Debug, Clone)]
pub struct RegoPolicy {
    engine: regorus::Engine,
    files: Vec<String>,
}

impl RegoPolicy {
    /// The built-in policy set plus every `.rego` file in `folder`.
    pub fn load(folder: Option<&Path>) -> Result<Self, PolicyLoadError> {
        let mut engine = regorus::Engine::new();
        let mut files = Vec::new();
        for (name, text) in BUILT_IN {
            add(&mut engine, name, text.to_string())?;
            files.push(name.to_string());
        }
        if let Some(folder) = folder {
            for path in rego_files(folder)? {
                let file = path.display().to_string();
                let text = std::fs::read_to_string(&path).map_err(|e| PolicyLoadError::Folder {
                    folder: folder.to_path_buf(),
                    reason: format!("cannot read {file}: {e}"),
                })?;
                add(&mut engine, &file, text)?;
                files.push(file);
            }
        }
        // Some mistakes (an unknown function, an unsafe variable) only show when the
        // policies are compiled for evaluation: do that now, on a sample plan, so that a
        // broken folder fails at start-up and not on the first production plan. Evaluating
        // on the kept engine also leaves it prepared, so its clones need not compile again.
        decide_with(&mut engine, &sample_input())
            .and_then(|_| decide_deployment_with(&mut engine, &sample_promotion()).map(|_| ()))
            .map(|_| ())
            .map_err(|e| {
                let (file, line) = located(&e.0).unwrap_or_else(|| (files.join(", "), None));
                PolicyLoadError::Compile {
                    file,
                    line,
                    message: e.0,
                }
            })?;
        tracing::info!(files = ?files, "policies loaded");
        Ok(Self { engine, files })
    }

    /// The files the engine holds (built-in ones first).
    pub fn files(&self) -> &[String] {
        &self.files
    }
}

/// Evaluates the decision package with `input` as the Rego input.
fn decide_with(
    engine: &mut regorus::Engine,
    input: &PolicyInput,
) -> Result<PolicyDecision, PolicyError> {
    let package = evaluate_package(engine, DECISION_QUERY, input)?;
    Ok(combine(
        reasons(&package, "deny")?,
        reasons(&package, "require_approval")?,
        reasons(&package, "allow")?,
    ))
}

/// Evaluates the deployment package with `input` as the Rego input. Nothing allowing a
/// promotion requires an approval, as for plans; `hotfix` lists why a hotfix may skip the
/// promotion path (none: it may not).
fn decide_deployment_with(
    engine: &mut regorus::Engine,
    input: &DeploymentPolicyInput,
) -> Result<DeploymentDecision, PolicyError> {
    let package = evaluate_package(engine, DEPLOYMENT_QUERY, input)?;
    Ok(DeploymentDecision {
        decision: combine(
            reasons(&package, "deny")?,
            reasons(&package, "require_approval")?,
            reasons(&package, "allow")?,
        ),
        hotfix_allowed: reasons(&package, "hotfix")?,
    })
}

/// The value of `query` (a package) with `input` as the Rego input.
fn evaluate_package<I: serde::Serialize>(
    engine: &mut regorus::Engine,
    query: &str,
    input: &I,
) -> Result<serde_json::Value, PolicyError> {
    let json = serde_json::to_string(input)
        .map_err(|e| PolicyError(format!("cannot encode the input: {e}")))?;
    let value = regorus::Value::from_json_str(&json)
        .map_err(|e| PolicyError(format!("cannot encode the input: {e}")))?;
    engine.set_input(value);
    let results = engine
        .eval_query(query.to_string(), false)
        .map_err(|e| PolicyError(e.to_string()))?;
    Ok(
        match results.result.first().and_then(|r| r.expressions.first()) {
            Some(expression) => {
                let text = expression
                    .value
                    .to_json_str()
                    .map_err(|e| PolicyError(format!("cannot read the result: {e}")))?;
                serde_json::from_str::<serde_json::Value>(&text)
                    .map_err(|e| PolicyError(format!("cannot read the result: {e}")))?
            }
            None => serde_json::Value::Null,
        },
    )
}

impl DeploymentPolicy for RegoPolicy {
    fn evaluate_promotion(
        &self,
        input: &DeploymentPolicyInput,
    ) -> Result<DeploymentDecision, PolicyError> {
        let mut engine = self.engine.clone();
        let decision = decide_deployment_with(&mut engine, input)?;
        tracing::info!(
            environment_id = %input.environment_id,
            release_id = %input.release_id,
            decision = ?decision.decision.decision,
            evidence = ?decision.decision.evidence,
            hotfix_allowed = ?decision.hotfix_allowed,
            "deployment policy decided"
        );
        Ok(decision)
    }
}

impl PolicyEngine for RegoPolicy {
    fn evaluate(&self, input: &PolicyInput) -> Result<PolicyDecision, PolicyError> {
        // Cloning shares the compiled modules; each evaluation gets its own input and state.
        let mut engine = self.engine.clone();
        let decision = decide_with(&mut engine, input)?;
        tracing::info!(
            environment_id = %input.environment_id,
            kind = input.kind.as_str(),
            decision = ?decision.decision,
            evidence = ?decision.evidence,
            "policy decided"
        );
        Ok(decision)
    }
}

fn add(engine: &mut regorus::Engine, file: &str, text: String) -> Result<(), PolicyLoadError> {
    engine
        .add_policy(file.to_string(), text)
        .map(|_package| ())
        .map_err(|e| {
            let message = e.to_string();
            let line = located(&message).and_then(|(_, line)| line);
            PolicyLoadError::Compile {
                file: file.to_string(),
                line,
                message,
            }
        })
}

/// The file and line of a regorus message (`--> file:line:column`).
fn located(message: &str) -> Option<(String, Option<u32>)> {
    let location = message
        .lines()
        .find_map(|l| l.trim().strip_prefix("--> "))?;
    // file:line:column, where the file itself may contain ':'.
    let mut parts = location.rsplitn(3, ':');
    let _column = parts.next()?;
    let line = parts.next()?.parse::<u32>().ok()?;
    let file = parts.next()?;
    Some((file.to_string(), Some(line)))
}

/// The `.rego` files of `folder`, sorted so that loading is repeatable.
fn rego_files(folder: &Path) -> Result<Vec<PathBuf>, PolicyLoadError> {
    let folder_err = |reason: String| PolicyLoadError::Folder {
        folder: folder.to_path_buf(),
        reason,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(folder).map_err(|e| folder_err(e.to_string()))? {
        let path = entry.map_err(|e| folder_err(e.to_string()))?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == "rego") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The reasons in one set of the package's result; a missing set has none.
fn reasons(package: &serde_json::Value, set: &str) -> Result<Vec<String>, PolicyError> {
    match package.get(set) {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => Ok(items
            .iter()
            .map(|item| match item {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .collect()),
        Some(other) => Err(PolicyError(format!(
            "data.ferry.policy.{set} must be a set of reasons, not {other}"
        ))),
    }
}

/// Any deny wins, then any require_approval, then allow; nothing at all fails safe.
fn combine(deny: Vec<String>, require_approval: Vec<String>, allow: Vec<String>) -> PolicyDecision {
    let decision = if !deny.is_empty() {
        PolicyOutcome::Deny
    } else if !require_approval.is_empty() {
        PolicyOutcome::RequireApproval
    } else if !allow.is_empty() {
        PolicyOutcome::Allow
    } else {
        PolicyOutcome::RequireApproval
    };
    let mut evidence: Vec<String> = deny
        .into_iter()
        .map(|r| format!("deny: {r}"))
        .chain(
            require_approval
                .into_iter()
                .map(|r| format!("require_approval: {r}")),
        )
        .chain(allow.into_iter().map(|r| format!("allow: {r}")))
        .collect();
    if evidence.is_empty() {
        evidence.push("require_approval: no policy allowed this plan".to_string());
    }
    PolicyDecision { decision, evidence }
}

/// A promotion that touches the deployment rules, to compile them at load.
fn sample_promotion() -> DeploymentPolicyInput {
    DeploymentPolicyInput {
        environment_id: "policy-load-check".to_string(),
        environment_class: None,
        project_id: "check".to_string(),
        release_id: "00000000-0000-0000-0000-000000000000".to_string(),
        release_version: "0.0.0".to_string(),
        hotfix: Some("load check".to_string()),
        rollback: false,
        has_agent_generated_assets: true,
    }
}

/// A plan that touches every rule of the built-in set, to compile the policies at load.
fn sample_input() -> PolicyInput {
    PolicyInput {
        environment_id: "policy-load-check".to_string(),
        environment_class: None,
        kind: ProvisioningKind::Reconciliation,
        has_promotion_approval: false,
        rollback: false,
        adds: 1,
        changes: 1,
        deletes: 0,
        replaces: 1,
        resources: vec![PlannedResource {
            urn: "urn:pulumi:check::check::test:index:Resource::r".to_string(),
            resource_type: "test:index:Resource".to_string(),
            op: ResourceOp::Replace,
            properties: Vec::new(),
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_domain::values::EnvironmentClass;

    fn input(
        class: Option<EnvironmentClass>,
        kind: ProvisioningKind,
        approved: bool,
    ) -> PolicyInput {
        PolicyInput {
            environment_id: "env-1".into(),
            environment_class: class,
            kind,
            has_promotion_approval: approved,
            rollback: false,
            adds: 2,
            changes: 1,
            deletes: 0,
            replaces: 0,
            resources: vec![PlannedResource {
                urn: "urn:pulumi:prod::web::aws:s3/bucket:Bucket::logs".into(),
                resource_type: "aws:s3/bucket:Bucket".into(),
                op: ResourceOp::Create,
                properties: Vec::new(),
            }],
        }
    }

    fn promotion(
        class: Option<EnvironmentClass>,
        hotfix: Option<&str>,
        rollback: bool,
    ) -> DeploymentPolicyInput {
        DeploymentPolicyInput {
            environment_id: "payments-prod".into(),
            environment_class: class,
            project_id: "payments".into(),
            release_id: "00000000-0000-0000-0000-000000000002".into(),
            release_version: "2.3.0".into(),
            hotfix: hotfix.map(str::to_string),
            rollback,
            has_agent_generated_assets: false,
        }
    }

    #[test]
    fn a_rollback_in_production_is_allowed_under_its_authority_even_when_it_deletes() {
        let policy = RegoPolicy::load(None).unwrap();
        let mut rollback = input(
            Some(EnvironmentClass::Production),
            ProvisioningKind::Release,
            false,
        );
        rollback.rollback = true;
        rollback.deletes = 1;
        rollback.resources[0].op = ResourceOp::Delete;
        let d = policy.evaluate(&rollback).unwrap();
        assert_eq!(d.decision, PolicyOutcome::Allow, "{d:?}");
        assert!(d.evidence[0].contains("rollback's authority"), "{d:?}");
        // Without the rollback's authority the same plan waits for a person.
        rollback.rollback = false;
        let d = policy.evaluate(&rollback).unwrap();
        assert_eq!(d.decision, PolicyOutcome::RequireApproval, "{d:?}");
        // A team's policy may still deny it.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("no_rollback_deletes.rego"),
            "package ferry.policy\n\nimport rego.v1\n\ndeny contains \"no deletes, even in a rollback\" if {\n\tinput.rollback\n\tinput.deletes > 0\n}\n",
        )
        .unwrap();
        rollback.rollback = true;
        let team = RegoPolicy::load(Some(dir.path())).unwrap();
        let d = team.evaluate(&rollback).unwrap();
        assert_eq!(d.decision, PolicyOutcome::Deny, "{d:?}");
    }

    #[test]
    fn production_promotions_need_an_approval_and_others_are_allowed() {
        let policy = RegoPolicy::load(None).unwrap();
        for class in [None, Some(EnvironmentClass::Production)] {
            let d = policy
                .evaluate_promotion(&promotion(class, None, false))
                .unwrap();
            assert_eq!(d.decision.decision, PolicyOutcome::RequireApproval, "{d:?}");
            assert!(d.decision.evidence[0].contains("needs an approval of class production"));
        }
        let rollback = policy
            .evaluate_promotion(&promotion(Some(EnvironmentClass::Production), None, true))
            .unwrap();
        assert_eq!(
            rollback.decision.decision,
            PolicyOutcome::Allow,
            "{rollback:?}"
        );
        let staging = policy
            .evaluate_promotion(&promotion(Some(EnvironmentClass::Staging), None, false))
            .unwrap();
        assert_eq!(staging.decision.decision, PolicyOutcome::Allow);
        assert_eq!(
            staging.decision.evidence,
            vec!["allow: release 2.3.0 of payments into staging environment payments-prod"]
        );
    }

    #[test]
    fn hotfixes_skip_the_path_only_where_a_team_policy_allows_them() {
        let built_in = RegoPolicy::load(None).unwrap();
        let d = built_in
            .evaluate_promotion(&promotion(
                Some(EnvironmentClass::Production),
                Some("CVE"),
                false,
            ))
            .unwrap();
        assert!(d.hotfix_allowed.is_empty(), "{d:?}");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("hotfix.rego"),
            "package ferry.deployment\n\nimport rego.v1\n\nhotfix contains msg if {\n\tinput.hotfix\n\tmsg := sprintf(\"hotfixes may skip the path (%s)\", [input.hotfix])\n}\n",
        )
        .unwrap();
        let team = RegoPolicy::load(Some(dir.path())).unwrap();
        let d = team
            .evaluate_promotion(&promotion(
                Some(EnvironmentClass::Production),
                Some("CVE"),
                false,
            ))
            .unwrap();
        assert_eq!(d.hotfix_allowed, vec!["hotfixes may skip the path (CVE)"]);
        // The approval still applies.
        assert_eq!(d.decision.decision, PolicyOutcome::RequireApproval);
        let d = team
            .evaluate_promotion(&promotion(Some(EnvironmentClass::Production), None, false))
            .unwrap();
        assert!(d.hotfix_allowed.is_empty());
    }

    fn with_delete(mut i: PolicyInput) -> PolicyInput {
        i.deletes = 1;
        i.resources.push(PlannedResource {
            urn: "urn:pulumi:prod::web::aws:s3/bucket:Bucket::old".into(),
            resource_type: "aws:s3/bucket:Bucket".into(),
            op: ResourceOp::Delete,
            properties: Vec::new(),
        });
        i
    }

    fn defaults() -> RegoPolicy {
        RegoPolicy::load(None).unwrap()
    }

    const PROD: Option<EnvironmentClass> = Some(EnvironmentClass::Production);

    #[test]
    fn production_release_needs_the_promotion_approval() {
        let p = defaults();
        let d = p
            .evaluate(&input(PROD, ProvisioningKind::Release, false))
            .unwrap();
        assert_eq!(d.decision, PolicyOutcome::RequireApproval, "{d:?}");
        assert!(
            d.evidence[0].contains("needs the promotion's approval"),
            "{d:?}"
        );

        let d = p
            .evaluate(&input(PROD, ProvisioningKind::Release, true))
            .unwrap();
        assert_eq!(d.decision, PolicyOutcome::Allow, "{d:?}");
        assert!(
            d.evidence
                .iter()
                .any(|e| e.contains("carries the promotion's approval")),
            "{d:?}"
        );
    }

    #[test]
    fn production_baseline_and_reconciliation_allowed_with_evidence_when_non_destructive() {
        let p = defaults();
        for kind in [ProvisioningKind::Baseline, ProvisioningKind::Reconciliation] {
            let d = p.evaluate(&input(PROD, kind, false)).unwrap();
            assert_eq!(d.decision, PolicyOutcome::Allow, "{kind:?}: {d:?}");
            assert!(!d.evidence.is_empty());
            assert!(d.evidence[0].starts_with("allow: "), "{d:?}");
            assert!(
                d.evidence[0].contains("non-destructive (2 adds, 1 changes"),
                "{d:?}"
            );
        }
    }

    #[test]
    fn destructive_production_plans_are_never_automatic() {
        let p = defaults();
        for (kind, approved) in [
            (ProvisioningKind::Reconciliation, false),
            (ProvisioningKind::Baseline, false),
            (ProvisioningKind::Release, true),
        ] {
            let d = p
                .evaluate(&with_delete(input(PROD, kind, approved)))
                .unwrap();
            assert_eq!(
                d.decision,
                PolicyOutcome::RequireApproval,
                "{kind:?}: {d:?}"
            );
            assert!(
                d.evidence
                    .iter()
                    .any(|e| e.contains("deletes 1 and replaces 0")),
                "{d:?}"
            );
            assert!(!d.evidence.iter().any(|e| e.starts_with("allow")), "{d:?}");
        }
        // A replace counts as destructive too, even when only the resource list shows it.
        let mut i = input(PROD, ProvisioningKind::Reconciliation, false);
        i.resources[0].op = ResourceOp::Replace;
        let d = p.evaluate(&i).unwrap();
        assert_eq!(d.decision, PolicyOutcome::RequireApproval, "{d:?}");
    }

    #[test]
    fn unknown_class_counts_as_production() {
        let p = defaults();
        let d = p
            .evaluate(&input(None, ProvisioningKind::Release, false))
            .unwrap();
        assert_eq!(d.decision, PolicyOutcome::RequireApproval, "{d:?}");
        assert!(
            d.evidence[0].contains("unknown (treated as production)"),
            "{d:?}"
        );
        let d = p
            .evaluate(&with_delete(input(
                None,
                ProvisioningKind::Reconciliation,
                false,
            )))
            .unwrap();
        assert_eq!(d.decision, PolicyOutcome::RequireApproval, "{d:?}");
    }

    #[test]
    fn outside_production_allowed_with_a_reason() {
        let p = defaults();
        for class in [
            EnvironmentClass::Development,
            EnvironmentClass::Test,
            EnvironmentClass::Staging,
        ] {
            let d = p
                .evaluate(&with_delete(input(
                    Some(class),
                    ProvisioningKind::Release,
                    false,
                )))
                .unwrap();
            assert_eq!(d.decision, PolicyOutcome::Allow, "{class:?}: {d:?}");
            assert_eq!(d.evidence.len(), 1, "{d:?}");
            assert!(
                d.evidence[0].contains("plan allowed (2 adds, 1 changes, 1 deletes"),
                "{d:?}"
            );
        }
    }

    #[test]
    fn a_custom_folder_policy_can_deny_a_resource_type() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("no_public_buckets.rego"),
            r#"package ferry.policy

import rego.v1

deny contains msg if {
	some r in input.resources
	r.type == "aws:s3/bucket:Bucket"
	r.op == "create"
	msg := sprintf("%s: new S3 buckets are not allowed", [r.urn])
}
"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("README.md"), "not a policy").unwrap();
        let p = RegoPolicy::load(Some(dir.path())).unwrap();
        assert_eq!(p.files().len(), BUILT_IN.len() + 1);

        let d = p
            .evaluate(&input(
                Some(EnvironmentClass::Development),
                ProvisioningKind::Release,
                false,
            ))
            .unwrap();
        assert_eq!(d.decision, PolicyOutcome::Deny, "{d:?}");
        assert!(
            d.evidence[0].starts_with("deny: urn:pulumi:prod::web::aws:s3/bucket:Bucket::logs"),
            "{d:?}"
        );
        assert!(
            d.evidence.iter().any(|e| e.starts_with("allow: ")),
            "other reasons kept: {d:?}"
        );

        let mut other = input(
            Some(EnvironmentClass::Development),
            ProvisioningKind::Release,
            false,
        );
        other.resources[0].resource_type = "aws:sqs/queue:Queue".into();
        assert_eq!(p.evaluate(&other).unwrap().decision, PolicyOutcome::Allow);
    }

    #[test]
    fn a_policy_that_does_not_compile_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("broken.rego"),
            "package ferry.policy\n\nimport rego.v1\n\ndeny contains msg if {\n\tmsg := \n}\n",
        )
        .unwrap();
        let err = RegoPolicy::load(Some(dir.path())).unwrap_err();
        let text = err.to_string();
        match &err {
            PolicyLoadError::Compile { file, line, .. } => {
                assert!(file.ends_with("broken.rego"), "{err:?}");
                assert_eq!(*line, Some(6), "{err:?}");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            text.contains("broken.rego line 6 does not compile"),
            "{text}"
        );
    }

    #[test]
    fn a_policy_with_an_unsafe_variable_fails_at_load() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("unsafe.rego"),
            "package ferry.policy\n\nimport rego.v1\n\ndeny contains msg if {\n\tmsg := undefined_function(input.kind)\n}\n",
        )
        .unwrap();
        let err = RegoPolicy::load(Some(dir.path())).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("unsafe.rego line 6 does not compile"),
            "{text}"
        );
        assert!(text.contains("undefined_function"), "{text}");
    }

    #[test]
    fn a_missing_folder_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = RegoPolicy::load(Some(&dir.path().join("nope"))).unwrap_err();
        assert!(matches!(err, PolicyLoadError::Folder { .. }), "{err:?}");
    }

    #[test]
    fn locations_are_read_from_messages() {
        assert_eq!(
            located("\n--> /p/a:b.rego:12:3\n  |\nerror: x"),
            Some(("/p/a:b.rego".to_string(), Some(12)))
        );
        assert_eq!(located("no location"), None);
    }

    #[test]
    fn combining_fails_safe() {
        let d = combine(vec![], vec![], vec![]);
        assert_eq!(d.decision, PolicyOutcome::RequireApproval);
        assert!(!d.evidence.is_empty());
        let d = combine(vec![], vec!["r".into()], vec!["a".into()]);
        assert_eq!(d.decision, PolicyOutcome::RequireApproval);
        assert_eq!(d.evidence, vec!["require_approval: r", "allow: a"]);
    }
}

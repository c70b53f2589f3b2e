//! Given/when/then tests for every transition of the run, legal and illegal.

use super::*;
use crate::receipts::{PlannedResource, PolicyDecision, ResourceOp};
use cqrs_es::test::TestFramework;
use std::collections::BTreeMap;

type Fixture = TestFramework<ProvisioningRun>;

fn at(seconds: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_700_000_000 + seconds, 0).unwrap()
}

fn actor(name: &str) -> Actor {
    Actor::parse(name).unwrap()
}

fn request(class: Option<EnvironmentClass>, kind: ProvisioningKind) -> RunRequest {
    RunRequest {
        provisioning_run_id: ProvisioningRunId::from_uuid(uuid::Uuid::from_u128(7)),
        tenant_id: TenantId::parse("acme").unwrap(),
        project_id: ProjectId::parse("payments").unwrap(),
        environment_id: EnvironmentId::parse("payments-prod").unwrap(),
        environment_class: class,
        specification_id: SpecificationId::from_uuid(uuid::Uuid::from_u128(9)),
        specification_version: 3,
        kind,
        promotion_id: None,
        approval_id: None,
        follows_failed_apply: None,
        requested_by: actor("alice"),
        requested_at: at(0),
    }
}

fn prod_release() -> RunRequest {
    request(
        Some(EnvironmentClass::Production),
        ProvisioningKind::Release,
    )
}

fn receipt(deletes: u32, policy: Option<PolicyDecision>) -> PlanReceipt {
    PlanReceipt {
        ignored: Vec::new(),
        adds: 1,
        changes: 0,
        deletes,
        replaces: 0,
        resources: vec![PlannedResource {
            urn: "urn:pulumi:prod::web::aws:s3/bucket:Bucket::site".to_string(),
            resource_type: "aws:s3/bucket:Bucket".to_string(),
            op: ResourceOp::Create,
            properties: Vec::new(),
        }],
        inputs_hash: "ab".repeat(32),
        program_version: "aaaaaaa".to_string(),
        runner: "simulated".to_string(),
        runner_version: "1".to_string(),
        policy,
        warnings: vec![],
    }
}

fn allow(evidence: &[&str]) -> Option<PolicyDecision> {
    Some(PolicyDecision {
        decision: PolicyOutcome::Allow,
        evidence: evidence.iter().map(|e| e.to_string()).collect(),
    })
}

fn apply_receipt(result: ApplyResult) -> ApplyReceipt {
    ApplyReceipt {
        outputs: BTreeMap::from([("url".to_string(), serde_json::json!("https://x"))]),
        duration_seconds: 1.5,
        result,
        runner_version: "1".to_string(),
        failing_resource: (result == ApplyResult::Failed).then(|| "site".to_string()),
    }
}

fn requested(r: RunRequest) -> RunEvent {
    RunEvent::ProvisioningRequested(Box::new(r))
}

fn planned(p: PlanReceipt) -> RunEvent {
    RunEvent::ProvisioningPlanned {
        plan_receipt: Box::new(p),
        logs_ref: None,
        planned_at: at(1),
    }
}

fn approval_required() -> RunEvent {
    RunEvent::ApprovalRequired {
        reason: "production".to_string(),
        required_at: at(2),
    }
}

fn started(authorization: ApplyAuthorization) -> RunEvent {
    RunEvent::ApplyStarted {
        authorization,
        started_at: at(3),
    }
}

fn record(decision: Decision, by: &str) -> ApprovalRecord {
    ApprovalRecord {
        decision,
        approval_id: None,
        decided_by: actor(by),
        reason: Some("looks right".to_string()),
        decided_at: at(4),
    }
}

fn decide(decision: Decision, by: &str) -> RunCommand {
    RunCommand::DecideApproval {
        decision,
        decided_by: actor(by),
        reason: Some("looks right".to_string()),
        approval_id: None,
        at: at(4),
    }
}

fn record_plan(p: PlanReceipt) -> RunCommand {
    RunCommand::RecordPlan {
        receipt: Box::new(p),
        logs_ref: None,
        at: at(1),
    }
}

fn cancel() -> RunCommand {
    RunCommand::Cancel {
        cancelled_by: actor("bob"),
        reason: Some("not today".to_string()),
        at: at(5),
    }
}

fn cancelled() -> RunEvent {
    RunEvent::ProvisioningCancelled {
        cancelled_by: actor("bob"),
        reason: Some("not today".to_string()),
        cancelled_at: at(5),
    }
}

fn succeeded_cmd() -> RunCommand {
    RunCommand::RecordApplySucceeded {
        receipt: Box::new(apply_receipt(ApplyResult::Succeeded)),
        logs_ref: Some("runs/7/apply.log".to_string()),
        at: at(6),
    }
}

fn failed_cmd() -> RunCommand {
    RunCommand::RecordApplyFailed {
        receipt: Box::new(apply_receipt(ApplyResult::Failed)),
        reason: "site: access denied".to_string(),
        logs_ref: None,
        at: at(6),
    }
}

fn supersede() -> RunCommand {
    RunCommand::Supersede {
        reason: "another run applied first".to_string(),
        at: at(7),
    }
}

fn fail_planning() -> RunCommand {
    RunCommand::FailPlanning {
        reason: "commit deadbeef not found in /srv/infra".to_string(),
        at: at(1),
    }
}

/// A history that leaves a non-production run in each state.
fn history(state: ProvisioningState) -> Vec<RunEvent> {
    let dev = request(
        Some(EnvironmentClass::Development),
        ProvisioningKind::Release,
    );
    let base = vec![requested(dev), planned(receipt(0, None))];
    let applying = [base.clone(), vec![started(ApplyAuthorization::NotRequired)]].concat();
    let awaiting = [base.clone(), vec![approval_required()]].concat();
    match state {
        S::Requested => base[..1].to_vec(),
        S::Planned => base,
        S::AwaitingApproval => awaiting,
        S::Applying => applying,
        S::Applied => [
            applying,
            vec![RunEvent::ProvisioningApplied {
                apply_receipt: Box::new(apply_receipt(ApplyResult::Succeeded)),
                logs_ref: None,
                applied_at: at(6),
            }],
        ]
        .concat(),
        S::Failed => [
            base[..1].to_vec(),
            vec![RunEvent::ProvisioningFailed {
                stage: FailureStage::Plan,
                reason: "x".to_string(),
                apply_receipt: None,
                logs_ref: None,
                failed_at: at(1),
            }],
        ]
        .concat(),
        S::Rejected => [
            awaiting,
            vec![RunEvent::ApprovalRejected(record(Decision::Reject, "bob"))],
        ]
        .concat(),
        S::Cancelled => [base[..1].to_vec(), vec![cancelled()]].concat(),
        S::Superseded => [
            base,
            vec![RunEvent::ProvisioningSuperseded {
                reason: "x".to_string(),
                superseded_at: at(7),
            }],
        ]
        .concat(),
        S::InSync => vec![
            requested(reconciliation(EnvironmentClass::Development)),
            planned(no_change()),
            RunEvent::ReconciliationInSync { in_sync_at: at(2) },
        ],
    }
}

fn reconciliation(class: EnvironmentClass) -> RunRequest {
    request(Some(class), ProvisioningKind::Reconciliation)
}

fn no_change() -> PlanReceipt {
    PlanReceipt {
        ignored: Vec::new(),
        adds: 0,
        resources: Vec::new(),
        ..receipt(0, None)
    }
}

#[test]
fn a_reconciliation_whose_plan_changes_nothing_is_in_sync_and_nothing_else_is() {
    let dev = EnvironmentClass::Development;
    Fixture::with(())
        .given(vec![requested(reconciliation(dev)), planned(no_change())])
        .when(RunCommand::RecordInSync { at: at(2) })
        .then_expect_events(vec![RunEvent::ReconciliationInSync { in_sync_at: at(2) }]);
    // A plan with a difference, or a run of another kind, is not "in sync".
    Fixture::with(())
        .given(vec![
            requested(reconciliation(dev)),
            planned(receipt(0, None)),
        ])
        .when(RunCommand::RecordInSync { at: at(2) })
        .then_expect_error(RunError::NotInSync);
    Fixture::with(())
        .given(vec![
            requested(request(Some(dev), ProvisioningKind::Baseline)),
            planned(no_change()),
        ])
        .when(RunCommand::RecordInSync { at: at(2) })
        .then_expect_error(RunError::NotInSync);
    // Nothing happens to a run in sync.
    Fixture::with(())
        .given(history(S::InSync))
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::InvalidTransition {
            command: "StartApply",
            state: S::InSync,
        });
}

#[test]
fn reconciliation_drift_that_deletes_or_replaces_is_a_proposal_in_every_class() {
    for class in [EnvironmentClass::Development, EnvironmentClass::Production] {
        Fixture::with(())
            .given(vec![
                requested(reconciliation(class)),
                planned(receipt(1, allow(&["baseline drift"]))),
            ])
            .when(RunCommand::StartApply { at: at(3) })
            .then_expect_error(RunError::ApprovalRequired(
                "a reconciliation that deletes or replaces resources is a proposal: an Operator approves exactly this plan"
                    .to_string(),
            ));
    }
    // Adds and in-place changes outside production apply.
    Fixture::with(())
        .given(vec![
            requested(reconciliation(EnvironmentClass::Development)),
            planned(receipt(0, None)),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_events(vec![started(ApplyAuthorization::NotRequired)]);
}

#[test]
fn the_fix_after_a_failed_apply_is_a_proposal_even_when_harmless() {
    let failed = ProvisioningRunId::from_uuid(uuid::Uuid::from_u128(7));
    let after_failure = RunRequest {
        follows_failed_apply: Some(failed),
        ..reconciliation(EnvironmentClass::Development)
    };
    Fixture::with(())
        .given(vec![requested(after_failure), planned(receipt(0, None))])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::ApprovalRequired(format!(
            "the last apply here (run {failed}) failed and left the environment partly changed: the fix is a proposal an Operator approves exactly as planned"
        )));
}

#[test]
fn request_records_the_run_in_requested() {
    let r = prod_release();
    Fixture::with(())
        .given_no_previous_events()
        .when(RunCommand::Request(Box::new(r.clone())))
        .then_expect_events(vec![requested(r)]);
}

#[test]
fn a_run_is_requested_once() {
    Fixture::with(())
        .given(vec![requested(prod_release())])
        .when(RunCommand::Request(Box::new(prod_release())))
        .then_expect_error(RunError::AlreadyRequested);
}

#[test]
fn commands_on_a_missing_run_are_refused() {
    for command in [
        record_plan(receipt(0, None)),
        cancel(),
        supersede(),
        fail_planning(),
    ] {
        Fixture::with(())
            .given_no_previous_events()
            .when(command)
            .then_expect_error(RunError::NotRequested);
    }
}

#[test]
fn the_planner_records_the_plan() {
    Fixture::with(())
        .given(vec![requested(prod_release())])
        .when(record_plan(receipt(0, None)))
        .then_expect_events(vec![planned(receipt(0, None))]);
}

#[test]
fn planning_can_fail_with_the_reference_in_the_reason() {
    Fixture::with(())
        .given(vec![requested(prod_release())])
        .when(fail_planning())
        .then_expect_events(vec![RunEvent::ProvisioningFailed {
            stage: FailureStage::Plan,
            reason: "commit deadbeef not found in /srv/infra".to_string(),
            apply_receipt: None,
            logs_ref: None,
            failed_at: at(1),
        }]);
}

#[test]
fn a_plan_is_recorded_before_any_apply() {
    Fixture::with(())
        .given(vec![requested(request(
            Some(EnvironmentClass::Development),
            ProvisioningKind::Release,
        ))])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::InvalidTransition {
            command: "StartApply",
            state: S::Requested,
        });
}

#[test]
fn the_plan_receipt_is_immutable() {
    Fixture::with(())
        .given(history(S::Planned))
        .when(record_plan(receipt(5, None)))
        .then_expect_error(RunError::PlanReceiptAlreadyRecorded);
    Fixture::with(())
        .given(history(S::Applied))
        .when(record_plan(receipt(5, None)))
        .then_expect_error(RunError::PlanReceiptAlreadyRecorded);
}

#[test]
fn outside_production_a_plan_applies_without_approval() {
    Fixture::with(())
        .given(history(S::Planned))
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_events(vec![started(ApplyAuthorization::NotRequired)]);
}

#[test]
fn policy_can_ask_for_approval_outside_production() {
    let dev = request(Some(EnvironmentClass::Test), ProvisioningKind::Release);
    let wants = Some(PolicyDecision {
        decision: PolicyOutcome::RequireApproval,
        evidence: vec!["touches shared network".to_string()],
    });
    Fixture::with(())
        .given(vec![requested(dev), planned(receipt(0, wants))])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::ApprovalRequired(
            "policy requires approval for this plan".to_string(),
        ));
}

#[test]
fn a_production_release_needs_the_promotions_approval() {
    Fixture::with(())
        .given(vec![requested(prod_release()), planned(receipt(0, None))])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::ApprovalRequired(
            "a production release apply needs the promotion's approval".to_string(),
        ));

    let (carried, record) = handed_over();
    Fixture::with(())
        .given(vec![
            requested(carried),
            RunEvent::PromotionApprovalVerified(record),
            planned(receipt(0, None)),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_events(vec![started(ApplyAuthorization::PromotionApproval {
            promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(1)),
            approval_id: ApprovalId::from_uuid(uuid::Uuid::from_u128(2)),
        })]);
}

/// A release run handed over by promotion 1 with its approval 2, and that approval.
fn handed_over() -> (RunRequest, PromotionApprovalRecord) {
    let mut carried = prod_release();
    carried.promotion_id = Some(PromotionId::from_uuid(uuid::Uuid::from_u128(1)));
    carried.approval_id = Some(ApprovalId::from_uuid(uuid::Uuid::from_u128(2)));
    let record = PromotionApprovalRecord {
        promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(1)),
        approval_id: ApprovalId::from_uuid(uuid::Uuid::from_u128(2)),
        tenant_id: carried.tenant_id.clone(),
        environment_id: carried.environment_id.clone(),
        approved_by: actor("bob"),
        approved_at: at(0),
    };
    (carried, record)
}

#[test]
fn a_caller_cannot_attach_a_promotions_approval_to_a_run() {
    // Built without the API: the domain itself refuses an approval it did not verify.
    let (forged, _) = handed_over();
    Fixture::with(())
        .given_no_previous_events()
        .when(RunCommand::Request(Box::new(forged.clone())))
        .then_expect_error(RunError::UnverifiedPromotionApproval);

    // A run stored with the ids but without the verified approval (recorded before this
    // rule, or by a bug) still waits for a person in production.
    Fixture::with(())
        .given(vec![requested(forged), planned(receipt(0, None))])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::ApprovalRequired(
            "a production release apply needs the promotion's approval".to_string(),
        ));
}

#[test]
fn a_promotions_hand_off_records_its_verified_approval() {
    let (carried, record) = handed_over();
    Fixture::with(())
        .given_no_previous_events()
        .when(RunCommand::RequestForPromotion {
            request: Box::new(carried.clone()),
            approval: Box::new(VerifiedPromotionApproval::new(record.clone())),
        })
        .then_expect_events(vec![
            requested(carried.clone()),
            RunEvent::PromotionApprovalVerified(record.clone()),
        ]);

    // The approval must be for exactly this tenant, environment, promotion and approval.
    type Change = fn(&mut PromotionApprovalRecord);
    let cases: [(&str, Change); 4] = [
        ("tenant", |r| {
            r.tenant_id = TenantId::parse("globex").unwrap()
        }),
        ("environment", |r| {
            r.environment_id = EnvironmentId::parse("other-prod").unwrap()
        }),
        ("promotion", |r| {
            r.promotion_id = PromotionId::from_uuid(uuid::Uuid::from_u128(99))
        }),
        ("approval", |r| {
            r.approval_id = ApprovalId::from_uuid(uuid::Uuid::from_u128(99))
        }),
    ];
    for (what, change) in cases {
        let mut other = record.clone();
        change(&mut other);
        Fixture::with(())
            .given_no_previous_events()
            .when(RunCommand::RequestForPromotion {
                request: Box::new(carried.clone()),
                approval: Box::new(VerifiedPromotionApproval::new(other)),
            })
            .then_expect_error(RunError::PromotionApprovalMismatch(what));
    }
}

fn rollback_authority(request: &RunRequest) -> RollbackAuthorityRecord {
    RollbackAuthorityRecord {
        promotion_id: request.promotion_id.unwrap(),
        rolls_back: PromotionId::from_uuid(uuid::Uuid::from_u128(41)),
        release_id: ReleaseId::from_uuid(uuid::Uuid::from_u128(42)),
        tenant_id: request.tenant_id.clone(),
        environment_id: request.environment_id.clone(),
        automatic: true,
        authorised_by: actor("system:verifier"),
        reason: "verification failed".to_string(),
    }
}

#[test]
fn a_rollback_applies_in_production_under_its_own_authority_unless_policy_denies() {
    let mut run = prod_release();
    run.promotion_id = Some(PromotionId::from_uuid(uuid::Uuid::from_u128(40)));
    let record = rollback_authority(&run);
    Fixture::with(())
        .given_no_previous_events()
        .when(RunCommand::RequestForRollback {
            request: Box::new(run.clone()),
            authority: Box::new(VerifiedRollback::new(record.clone())),
        })
        .then_expect_events(vec![
            requested(run.clone()),
            RunEvent::RollbackAuthorityVerified(record.clone()),
        ]);
    // Deleting what the failed release added, with policy asking for a person: it applies.
    let wants_approval = Some(PolicyDecision {
        decision: PolicyOutcome::RequireApproval,
        evidence: vec!["require_approval: destructive".to_string()],
    });
    Fixture::with(())
        .given(vec![
            requested(run.clone()),
            RunEvent::RollbackAuthorityVerified(record.clone()),
            planned(receipt(1, wants_approval)),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_events(vec![RunEvent::ApplyStarted {
            authorization: ApplyAuthorization::Rollback {
                promotion_id: record.promotion_id,
                rolls_back: record.rolls_back,
                automatic: true,
                authorised_by: actor("system:verifier"),
            },
            started_at: at(3),
        }]);
    // A team's policy may still deny it.
    let denied = Some(PolicyDecision {
        decision: PolicyOutcome::Deny,
        evidence: vec!["deny: no deletes".to_string()],
    });
    Fixture::with(())
        .given(vec![
            requested(run.clone()),
            RunEvent::RollbackAuthorityVerified(record.clone()),
            planned(receipt(1, denied)),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::PolicyDenied("deny: no deletes".to_string()));
    // The authority names exactly this tenant, environment and promotion.
    type Change = fn(&mut RollbackAuthorityRecord);
    let cases: [(&str, Change); 3] = [
        ("tenant", |r| {
            r.tenant_id = TenantId::parse("globex").unwrap()
        }),
        ("environment", |r| {
            r.environment_id = EnvironmentId::parse("other-prod").unwrap()
        }),
        ("promotion", |r| {
            r.promotion_id = PromotionId::from_uuid(uuid::Uuid::from_u128(99))
        }),
    ];
    for (what, change) in cases {
        let mut other = record.clone();
        change(&mut other);
        Fixture::with(())
            .given_no_previous_events()
            .when(RunCommand::RequestForRollback {
                request: Box::new(run.clone()),
                authority: Box::new(VerifiedRollback::new(other)),
            })
            .then_expect_error(RunError::PromotionApprovalMismatch(what));
    }
}

#[test]
fn an_unknown_environment_class_is_production_and_the_reason_says_so() {
    let unknown = request(None, ProvisioningKind::Release);
    Fixture::with(())
        .given(vec![requested(unknown), planned(receipt(0, None))])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::ApprovalRequired(
            "environment payments-prod is not recorded, so it is treated as production (record it with PUT /factory/environments/payments-prod or the environment service's EnvironmentCreated): a production release apply needs the promotion's approval".to_string(),
        ));
}

#[test]
fn a_production_baseline_needs_a_policy_allow_with_evidence() {
    let baseline = request(
        Some(EnvironmentClass::Production),
        ProvisioningKind::Baseline,
    );
    Fixture::with(())
        .given(vec![
            requested(baseline.clone()),
            planned(receipt(0, allow(&[]))),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::ApprovalRequired(
            "a production Baseline apply needs a policy allow with evidence".to_string(),
        ));
    Fixture::with(())
        .given(vec![
            requested(baseline),
            planned(receipt(
                0,
                allow(&["baseline matches the approved template"]),
            )),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_events(vec![started(ApplyAuthorization::PolicyAllow {
            evidence: vec!["baseline matches the approved template".to_string()],
        })]);
}

#[test]
fn a_destructive_production_reconciliation_is_never_applied_automatically() {
    let reconcile = request(
        Some(EnvironmentClass::Production),
        ProvisioningKind::Reconciliation,
    );
    Fixture::with(())
        .given(vec![
            requested(reconcile),
            planned(receipt(2, allow(&["drift"]))),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::ApprovalRequired(
            "a reconciliation that deletes or replaces resources is a proposal: an Operator approves exactly this plan"
                .to_string(),
        ));
    // Not even a policy allow applies drift in production: it is a proposal.
    Fixture::with(())
        .given(vec![
            requested(request(
                Some(EnvironmentClass::Production),
                ProvisioningKind::Reconciliation,
            )),
            planned(receipt(0, allow(&["drift"]))),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::ApprovalRequired(
            "drift in production is a proposal: an Operator approves exactly this plan".to_string(),
        ));
}

#[test]
fn a_denied_plan_is_never_applied() {
    let deny = Some(PolicyDecision {
        decision: PolicyOutcome::Deny,
        evidence: vec!["public bucket".to_string()],
    });
    let dev = request(
        Some(EnvironmentClass::Development),
        ProvisioningKind::Release,
    );
    Fixture::with(())
        .given(vec![
            requested(dev.clone()),
            planned(receipt(0, deny.clone())),
        ])
        .when(RunCommand::StartApply { at: at(3) })
        .then_expect_error(RunError::PolicyDenied("public bucket".to_string()));
    Fixture::with(())
        .given(vec![
            requested(dev),
            planned(receipt(0, deny)),
            approval_required(),
        ])
        .when(decide(Decision::Approve, "bob"))
        .then_expect_error(RunError::PolicyDenied("public bucket".to_string()));
}

#[test]
fn a_production_run_without_approval_waits() {
    Fixture::with(())
        .given(vec![requested(prod_release()), planned(receipt(0, None))])
        .when(RunCommand::RequireApproval {
            reason: "production".to_string(),
            at: at(2),
        })
        .then_expect_events(vec![approval_required()]);
}

#[test]
fn the_requester_cannot_approve() {
    Fixture::with(())
        .given(history(S::AwaitingApproval))
        .when(decide(Decision::Approve, "alice"))
        .then_expect_error(RunError::ApproverIsRequester(actor("alice")));
}

/// Issue 37: tokens for `Alice`, `alice ` (and `alice` with a zero-width space, which a
/// token can no longer carry) each approved alice's production run.
#[test]
fn the_requester_cannot_approve_under_another_spelling() {
    for spelling in ["Alice", "alice ", " ALICE", "ａｌｉｃｅ"] {
        Fixture::with(())
            .given(history(S::AwaitingApproval))
            .when(decide(Decision::Approve, spelling))
            .then_expect_error(RunError::ApproverIsRequester(actor(spelling)));
    }
    // A requester's name stored with a hidden character (before such names were refused)
    // is still the same person.
    let mut dev = request(
        Some(EnvironmentClass::Development),
        ProvisioningKind::Release,
    );
    dev.requested_by = serde_json::from_str("\"alice\\u200b\"").unwrap();
    Fixture::with(())
        .given(vec![
            requested(dev),
            planned(receipt(0, None)),
            approval_required(),
        ])
        .when(decide(Decision::Approve, "Alice"))
        .then_expect_error(RunError::ApproverIsRequester(actor("alice")));
}

#[test]
fn a_promotion_s_run_is_approved_only_with_the_promotion_s_verified_approval_of_its_plan() {
    let promotion = PromotionId::from_uuid(uuid::Uuid::from_u128(11));
    let mut handed = request(
        Some(EnvironmentClass::Production),
        ProvisioningKind::Release,
    );
    handed.promotion_id = Some(promotion);
    let given = vec![
        requested(handed),
        planned(receipt(0, None)),
        approval_required(),
    ];
    // Not by a person on the run, whoever they are, with or without an approval id.
    Fixture::with(())
        .given(given.clone())
        .when(decide(Decision::Approve, "bob"))
        .then_expect_error(RunError::PromotionApprovalRequired(promotion));
    Fixture::with(())
        .given(given.clone())
        .when(RunCommand::DecideApproval {
            decision: Decision::Approve,
            decided_by: actor("bob"),
            reason: None,
            approval_id: Some(ApprovalId::from_uuid(uuid::Uuid::from_u128(12))),
            at: at(4),
        })
        .then_expect_error(RunError::PromotionApprovalRequired(promotion));
    // With the promotion's verified approval of exactly this plan.
    let record = PromotionApprovalRecord {
        promotion_id: promotion,
        approval_id: ApprovalId::from_uuid(uuid::Uuid::from_u128(12)),
        tenant_id: TenantId::parse("acme").unwrap(),
        environment_id: EnvironmentId::parse("payments-prod").unwrap(),
        approved_by: actor("bob"),
        approved_at: at(3),
    };
    let approve = |hash: String| RunCommand::ApproveForPromotion {
        approval: Box::new(VerifiedPromotionApproval::new(record.clone())),
        plan_inputs_hash: hash,
        at: at(4),
    };
    Fixture::with(())
        .given(given.clone())
        .when(approve("cd".repeat(32)))
        .then_expect_error(RunError::PromotionApprovalMismatch(
            "plan (the approval was asked for another plan)",
        ));
    Fixture::with(())
        .given(given.clone())
        .when(approve("ab".repeat(32)))
        .then_expect_events(vec![
            RunEvent::PromotionApprovalVerified(record.clone()),
            RunEvent::ApprovalGranted(ApprovalRecord {
                decision: Decision::Approve,
                approval_id: Some(record.approval_id),
                decided_by: actor("bob"),
                reason: Some(format!("promotion {promotion} approved")),
                decided_at: at(4),
            }),
        ]);
    // Refusing stays open to anyone allowed to decide: it only stops the apply.
    Fixture::with(())
        .given(given)
        .when(decide(Decision::Reject, "bob"))
        .then_expect_events(vec![RunEvent::ApprovalRejected(record_of(
            Decision::Reject,
            "bob",
        ))]);
}

fn record_of(decision: Decision, by: &str) -> ApprovalRecord {
    record(decision, by)
}

#[test]
fn another_identity_approves_and_the_run_applies() {
    Fixture::with(())
        .given(history(S::AwaitingApproval))
        .when(decide(Decision::Approve, "bob"))
        .then_expect_events(vec![RunEvent::ApprovalGranted(record(
            Decision::Approve,
            "bob",
        ))]);
    let mut run = ProvisioningRun::default();
    for e in history(S::AwaitingApproval) {
        run.apply(e);
    }
    run.apply(RunEvent::ApprovalGranted(record(Decision::Approve, "bob")));
    assert_eq!(run.state(), Some(S::Applying));
    assert_eq!(
        run.authorization(),
        Some(&ApplyAuthorization::Approval {
            approved_by: actor("bob"),
            approval_id: None
        })
    );
}

#[test]
fn a_rejection_ends_the_run() {
    Fixture::with(())
        .given(history(S::AwaitingApproval))
        .when(decide(Decision::Reject, "alice"))
        .then_expect_events(vec![RunEvent::ApprovalRejected(record(
            Decision::Reject,
            "alice",
        ))]);
}

#[test]
fn an_apply_ends_applied_or_failed_with_its_receipt() {
    Fixture::with(())
        .given(history(S::Applying))
        .when(succeeded_cmd())
        .then_expect_events(vec![RunEvent::ProvisioningApplied {
            apply_receipt: Box::new(apply_receipt(ApplyResult::Succeeded)),
            logs_ref: Some("runs/7/apply.log".to_string()),
            applied_at: at(6),
        }]);
    Fixture::with(())
        .given(history(S::Applying))
        .when(failed_cmd())
        .then_expect_events(vec![RunEvent::ProvisioningFailed {
            stage: FailureStage::Apply,
            reason: "site: access denied".to_string(),
            apply_receipt: Some(Box::new(apply_receipt(ApplyResult::Failed))),
            logs_ref: None,
            failed_at: at(6),
        }]);
}

#[test]
fn a_receipt_must_agree_with_the_outcome() {
    Fixture::with(())
        .given(history(S::Applying))
        .when(RunCommand::RecordApplySucceeded {
            receipt: Box::new(apply_receipt(ApplyResult::Failed)),
            logs_ref: None,
            at: at(6),
        })
        .then_expect_error(RunError::ReceiptResultMismatch {
            expected: ApplyResult::Succeeded,
            found: ApplyResult::Failed,
        });
}

#[test]
fn the_apply_receipt_is_immutable() {
    Fixture::with(())
        .given(history(S::Applied))
        .when(succeeded_cmd())
        .then_expect_error(RunError::ApplyReceiptAlreadyRecorded);
    Fixture::with(())
        .given(history(S::Applied))
        .when(failed_cmd())
        .then_expect_error(RunError::ApplyReceiptAlreadyRecorded);
}

#[test]
fn cancel_only_before_apply() {
    for state in [S::Requested, S::Planned, S::AwaitingApproval] {
        Fixture::with(())
            .given(history(state))
            .when(cancel())
            .then_expect_events(vec![cancelled()]);
    }
    for state in [
        S::Applying,
        S::Applied,
        S::Failed,
        S::Rejected,
        S::Cancelled,
        S::Superseded,
    ] {
        Fixture::with(())
            .given(history(state))
            .when(cancel())
            .then_expect_error(RunError::InvalidTransition {
                command: "Cancel",
                state,
            });
    }
}

#[test]
fn only_an_unapplied_plan_can_be_superseded() {
    for state in [S::Planned, S::AwaitingApproval, S::Applying] {
        Fixture::with(())
            .given(history(state))
            .when(supersede())
            .then_expect_events(vec![RunEvent::ProvisioningSuperseded {
                reason: "another run applied first".to_string(),
                superseded_at: at(7),
            }]);
    }
    Fixture::with(())
        .given(history(S::Requested))
        .when(supersede())
        .then_expect_error(RunError::InvalidTransition {
            command: "Supersede",
            state: S::Requested,
        });
}

#[test]
fn reasons_are_required_where_they_are_the_record() {
    Fixture::with(())
        .given(history(S::Requested))
        .when(RunCommand::FailPlanning {
            reason: " ".to_string(),
            at: at(1),
        })
        .then_expect_error(RunError::ReasonRequired);
}

#[test]
fn a_person_s_reason_is_checked_and_a_program_s_output_made_inert() {
    let mut escaped = cancel();
    if let RunCommand::Cancel { reason, .. } = &mut escaped {
        *reason = Some("ok\u{1b}[8mhidden".to_string());
    }
    assert!(matches!(
        Fixture::with(())
            .given(history(S::Requested))
            .when(escaped)
            .inspect_result(),
        Err(RunError::InvalidText(crate::text::InvalidText { ref field, .. })) if field == "reason"
    ));
    let mut long = decide(Decision::Reject, "bob");
    if let RunCommand::DecideApproval { reason, .. } = &mut long {
        *reason = Some("x".repeat(250_000));
    }
    assert!(matches!(
        Fixture::with(())
            .given(history(S::AwaitingApproval))
            .when(long)
            .inspect_result(),
        Err(RunError::InvalidText(_))
    ));
    // What the runner reports (the program's output may hold escapes and be long) is kept,
    // inert and bounded: refusing it would leave the run planning for ever.
    let events = Fixture::with(())
        .given(history(S::Requested))
        .when(RunCommand::FailPlanning {
            reason: format!("\u{1b}[31merror\u{1b}[0m: {}", "y".repeat(5000)),
            at: at(1),
        })
        .inspect_result()
        .unwrap();
    let Some(RunEvent::ProvisioningFailed { reason, .. }) = events.first() else {
        panic!("{events:?}");
    };
    assert!(
        reason.starts_with("\u{FFFD}[31merror\u{FFFD}[0m: yyy"),
        "{reason}"
    );
    assert_eq!(reason.chars().count(), crate::text::MAX_REASON);
}

/// Every command in every state: either the one legal outcome or a typed refusal.
#[test]
fn every_command_in_every_state() {
    let legal: &[(&str, &[ProvisioningState])] = &[
        ("RecordPlan", &[S::Requested]),
        ("FailPlanning", &[S::Requested]),
        ("RequireApproval", &[S::Planned]),
        ("DecideApproval", &[S::AwaitingApproval]),
        ("StartApply", &[S::Planned]),
        ("RecordApplySucceeded", &[S::Applying]),
        ("RecordApplyFailed", &[S::Applying]),
        ("Cancel", &[S::Requested, S::Planned, S::AwaitingApproval]),
        ("Supersede", &[S::Planned, S::AwaitingApproval, S::Applying]),
        ("RejectByPolicy", &[S::Planned]),
    ];
    for state in ProvisioningState::ALL {
        let commands = [
            record_plan(receipt(0, None)),
            fail_planning(),
            RunCommand::RequireApproval {
                reason: "p".to_string(),
                at: at(2),
            },
            decide(Decision::Approve, "bob"),
            RunCommand::StartApply { at: at(3) },
            succeeded_cmd(),
            failed_cmd(),
            cancel(),
            supersede(),
            RunCommand::RejectByPolicy {
                evidence: vec!["public bucket".to_string()],
                at: at(8),
            },
            RunCommand::Request(Box::new(prod_release())),
        ];
        for command in commands {
            let name = command.name();
            let allowed = legal
                .iter()
                .find(|(n, _)| *n == name)
                .is_some_and(|(_, states)| states.contains(&state));
            let result = Fixture::with(())
                .given(history(state))
                .when(command)
                .inspect_result();
            match result {
                Ok(events) => {
                    assert!(
                        allowed,
                        "{name} in {state} should be refused, got {events:?}"
                    );
                    assert_eq!(events.len(), 1);
                }
                Err(error) => {
                    assert!(!allowed, "{name} in {state} should succeed, got {error}");
                    assert!(
                        matches!(
                            error,
                            RunError::InvalidTransition { .. }
                                | RunError::AlreadyRequested
                                | RunError::PlanReceiptAlreadyRecorded
                                | RunError::ApplyReceiptAlreadyRecorded
                        ),
                        "{name} in {state}: unexpected {error:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn events_have_stable_types_and_round_trip() {
    let event = requested(prod_release());
    assert_eq!(event.event_type(), "ProvisioningRequested");
    assert_eq!(event.event_version(), "1.0");
    let json = serde_json::to_value(&event).unwrap();
    assert_eq!(
        json["ProvisioningRequested"]["environmentId"],
        "payments-prod"
    );
    let back: RunEvent = serde_json::from_value(json).unwrap();
    assert_eq!(back, event);
}

#[test]
fn each_event_is_stored_under_its_variant_name_at_the_first_version() {
    // The store decodes a stored event by its serde tag and then checks that the decoded
    // event names the stored type: the two must agree for every variant.
    for state in ProvisioningState::ALL {
        for event in history(state) {
            let json = serde_json::to_value(&event).unwrap();
            let tag = json.as_object().unwrap().keys().next().unwrap().clone();
            let stored = event.stored_type();
            assert_eq!(tag, stored.name, "{event:?}");
            assert_eq!(stored.version, crate::event_type::FIRST_VERSION);
            assert_eq!(event.event_type(), stored.name);
            assert_eq!(event.event_version(), stored.version);
        }
    }
}

#[test]
fn a_policy_deny_rejects_the_run_with_its_evidence() {
    Fixture::with(())
        .given(history(S::Planned))
        .when(RunCommand::RejectByPolicy {
            evidence: vec!["public bucket".to_string()],
            at: at(8),
        })
        .then_expect_events(vec![RunEvent::PolicyDenied {
            evidence: vec!["public bucket".to_string()],
            denied_at: at(8),
        }]);
    Fixture::with(())
        .given(history(S::Planned))
        .when(RunCommand::RejectByPolicy {
            evidence: vec![],
            at: at(8),
        })
        .then_expect_error(RunError::ReasonRequired);
}

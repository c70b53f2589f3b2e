//! Given/when/then tests for every transition of the promotion, and every refusal.

use super::*;
use cqrs_es::test::TestFramework;
use serde_json::json;

type Fixture = TestFramework<Promotion>;

fn at(seconds: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_700_000_000 + seconds, 0).unwrap_or_default()
}

fn actor(name: &str) -> Actor {
    Actor::parse(name).unwrap()
}

fn release(n: u128) -> ReleaseId {
    ReleaseId::from_uuid(uuid::Uuid::from_u128(n))
}

fn run(n: u128) -> ProvisioningRunId {
    ProvisioningRunId::from_uuid(uuid::Uuid::from_u128(n))
}

fn approval_id(n: u128) -> ApprovalId {
    ApprovalId::from_uuid(uuid::Uuid::from_u128(n))
}

fn request(class: EnvironmentClass) -> PromotionRequest {
    PromotionRequest {
        promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(1)),
        tenant_id: TenantId::parse("acme").unwrap(),
        project_id: ProjectId::parse("payments").unwrap(),
        release_id: release(2),
        environment_id: EnvironmentId::parse("payments-prod").unwrap(),
        environment_class: class,
        strategy: Strategy::Canary,
        run_id: None,
        hotfix: None,
        receipt_ref: None,
        previous_release_id: Some(release(3)),
        rollback_of: None,
        requested_by: actor("alice"),
        requested_at: at(0),
    }
}

fn rollback_request() -> PromotionRequest {
    PromotionRequest {
        release_id: release(3),
        previous_release_id: Some(release(2)),
        rollback_of: Some(RollbackOf {
            promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(9)),
            release_id: release(2),
            automatic: true,
            reason: "verification failed".to_string(),
        }),
        ..request(EnvironmentClass::Production)
    }
}

fn gate(kind: GateKind, outcome: GateOutcome) -> GateResult {
    GateResult {
        kind,
        outcome,
        reasons: vec![format!("{} said so", kind.as_str())],
        evidence: json!({"gate": kind.as_str()}),
        evaluated_at: at(2),
    }
}

fn requested(class: EnvironmentClass) -> Vec<PromotionEvent> {
    vec![PromotionEvent::PromotionRequested(Box::new(request(class)))]
}

fn evaluating(class: EnvironmentClass) -> Vec<PromotionEvent> {
    let mut events = requested(class);
    events.push(PromotionEvent::GatesEvaluationStarted { started_at: at(1) });
    events
}

fn all_gates(class: EnvironmentClass) -> Vec<PromotionEvent> {
    let mut events = evaluating(class);
    for kind in GateKind::ORDER {
        events.push(PromotionEvent::GateEvaluated(Box::new(gate(
            kind,
            GateOutcome::Passed,
        ))));
    }
    events
}

fn awaiting() -> Vec<PromotionEvent> {
    let mut events = all_gates(EnvironmentClass::Production);
    events.push(PromotionEvent::GatesPassed {
        approval_required: true,
        passed_at: at(3),
    });
    events
}

fn approval() -> ApprovalRequest {
    ApprovalRequest {
        approval_id: approval_id(4),
        desired_state_ref: "spec@7".to_string(),
        provisioning_run_id: run(5),
        plan_inputs_hash: "ab".repeat(32),
        requested_at: at(4),
        expires_at: Some(at(4 + 3600)),
    }
}

fn approval_pending() -> Vec<PromotionEvent> {
    let mut events = awaiting();
    events.push(PromotionEvent::ApprovalRequested(Box::new(approval())));
    events
}

fn approved_production() -> Vec<PromotionEvent> {
    let mut events = approval_pending();
    events.push(PromotionEvent::ApprovalGranted {
        approval_id: approval_id(4),
        decided_by: actor("bob"),
        reason: None,
        decided_at: at(5),
    });
    events
}

fn approved_staging() -> Vec<PromotionEvent> {
    let mut events = all_gates(EnvironmentClass::Staging);
    events.push(PromotionEvent::GatesPassed {
        approval_required: false,
        passed_at: at(3),
    });
    events
}

fn handed_off() -> PromotionEvent {
    PromotionEvent::PromotionApproved {
        desired_state_ref: "spec@7".to_string(),
        provisioning_run_id: run(5),
        approval_id: Some(approval_id(4)),
        strategy: Strategy::Canary,
        approved_at: at(6),
    }
}

fn deploying() -> Vec<PromotionEvent> {
    let mut events = approved_production();
    events.push(handed_off());
    events
}

fn verifying() -> Vec<PromotionEvent> {
    let mut events = deploying();
    events.push(PromotionEvent::DeploymentApplied {
        provisioning_run_id: run(5),
        applied_at: at(7),
        verification_ends_at: at(67),
    });
    events
}

fn concluded(outcome: VerificationOutcome) -> PromotionEvent {
    PromotionEvent::VerificationConcluded {
        outcome,
        reason: "window closed".to_string(),
        concluded_by: None,
        concluded_at: at(67),
    }
}

fn verification_failed() -> Vec<PromotionEvent> {
    let mut events = verifying();
    events.push(concluded(VerificationOutcome::Failed));
    events
}

fn completed() -> Vec<PromotionEvent> {
    let mut events = verifying();
    events.push(concluded(VerificationOutcome::Passed));
    events.push(PromotionEvent::PromotionCompleted {
        completed_at: at(67),
    });
    events
}

fn rollback_started(automatic: bool) -> PromotionEvent {
    PromotionEvent::RollbackStarted {
        rollback_promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(8)),
        restored_release_id: release(3),
        automatic,
        started_by: actor("system:verifier"),
        reason: "health check failed".to_string(),
        started_at: at(70),
    }
}

fn start_rollback(automatic: bool) -> PromotionCommand {
    PromotionCommand::StartRollback {
        rollback_promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(8)),
        restored_release_id: release(3),
        automatic,
        by: actor("system:verifier"),
        reason: "health check failed".to_string(),
        at: at(70),
    }
}

fn decide(by: &str, decision: Decision) -> PromotionCommand {
    PromotionCommand::DecideApproval {
        approval_id: None,
        decision,
        decided_by: actor(by),
        reason: Some("looks right".to_string()),
        at: at(5),
    }
}

fn state_after(events: Vec<PromotionEvent>) -> Option<PromotionState> {
    let mut promotion = Promotion::default();
    for e in events {
        promotion.apply(e);
    }
    promotion.state()
}

#[test]
fn a_promotion_is_requested_once() {
    Fixture::with(())
        .given_no_previous_events()
        .when(PromotionCommand::Request(Box::new(request(
            EnvironmentClass::Staging,
        ))))
        .then_expect_events(requested(EnvironmentClass::Staging));
    Fixture::with(())
        .given(requested(EnvironmentClass::Staging))
        .when(PromotionCommand::Request(Box::new(request(
            EnvironmentClass::Staging,
        ))))
        .then_expect_error(PromotionError::AlreadyRequested);
}

#[test]
fn nothing_but_a_request_happens_to_a_promotion_that_does_not_exist() {
    Fixture::with(())
        .given_no_previous_events()
        .when(PromotionCommand::StartGates { at: at(1) })
        .then_expect_error(PromotionError::NotRequested);
}

#[test]
fn gates_are_recorded_in_their_order() {
    Fixture::with(())
        .given(requested(EnvironmentClass::Staging))
        .when(PromotionCommand::StartGates { at: at(1) })
        .then_expect_events(vec![PromotionEvent::GatesEvaluationStarted {
            started_at: at(1),
        }]);
    Fixture::with(())
        .given(evaluating(EnvironmentClass::Staging))
        .when(PromotionCommand::RecordGate(Box::new(gate(
            GateKind::PipelineResults,
            GateOutcome::Passed,
        ))))
        .then_expect_events(vec![PromotionEvent::GateEvaluated(Box::new(gate(
            GateKind::PipelineResults,
            GateOutcome::Passed,
        )))]);
    Fixture::with(())
        .given(evaluating(EnvironmentClass::Staging))
        .when(PromotionCommand::RecordGate(Box::new(gate(
            GateKind::Policy,
            GateOutcome::Passed,
        ))))
        .then_expect_error(PromotionError::GateOutOfOrder {
            expected: GateKind::PipelineResults,
            got: GateKind::Policy,
        });
}

#[test]
fn the_first_failing_gate_rejects_the_promotion_and_is_named() {
    let mut given = evaluating(EnvironmentClass::Production);
    given.push(PromotionEvent::GateEvaluated(Box::new(gate(
        GateKind::PipelineResults,
        GateOutcome::Passed,
    ))));
    given.push(PromotionEvent::GateEvaluated(Box::new(gate(
        GateKind::Policy,
        GateOutcome::Passed,
    ))));
    let failing = gate(GateKind::PriorEnvironment, GateOutcome::Failed);
    Fixture::with(())
        .given(given.clone())
        .when(PromotionCommand::RecordGate(Box::new(failing.clone())))
        .then_expect_events(vec![
            PromotionEvent::GateEvaluated(Box::new(failing.clone())),
            PromotionEvent::PromotionRejected {
                reason: "gate PriorEnvironment failed: PriorEnvironment said so".to_string(),
                gate: Some(GateKind::PriorEnvironment),
                rejected_at: at(2),
            },
        ]);
    given.push(PromotionEvent::GateEvaluated(Box::new(failing)));
    given.push(PromotionEvent::PromotionRejected {
        reason: "x".to_string(),
        gate: Some(GateKind::PriorEnvironment),
        rejected_at: at(2),
    });
    assert_eq!(state_after(given), Some(PromotionState::Rejected));
}

#[test]
fn gates_pass_only_when_all_are_recorded() {
    let mut given = evaluating(EnvironmentClass::Staging);
    given.push(PromotionEvent::GateEvaluated(Box::new(gate(
        GateKind::PipelineResults,
        GateOutcome::Passed,
    ))));
    Fixture::with(())
        .given(given)
        .when(PromotionCommand::PassGates {
            policy_requires_approval: false,
            at: at(3),
        })
        .then_expect_error(PromotionError::GatesIncomplete(GateKind::Policy));
}

#[test]
fn not_applicable_gates_pass_and_staging_goes_ahead_without_approval() {
    let mut given = evaluating(EnvironmentClass::Staging);
    for kind in GateKind::ORDER {
        given.push(PromotionEvent::GateEvaluated(Box::new(gate(
            kind,
            GateOutcome::NotApplicable,
        ))));
    }
    Fixture::with(())
        .given(given)
        .when(PromotionCommand::PassGates {
            policy_requires_approval: false,
            at: at(3),
        })
        .then_expect_events(vec![PromotionEvent::GatesPassed {
            approval_required: false,
            passed_at: at(3),
        }]);
    assert_eq!(
        state_after(approved_staging()),
        Some(PromotionState::Approved)
    );
}

#[test]
fn production_always_needs_an_approval_and_policy_may_ask_for_one_elsewhere() {
    Fixture::with(())
        .given(all_gates(EnvironmentClass::Production))
        .when(PromotionCommand::PassGates {
            policy_requires_approval: false,
            at: at(3),
        })
        .then_expect_events(vec![PromotionEvent::GatesPassed {
            approval_required: true,
            passed_at: at(3),
        }]);
    Fixture::with(())
        .given(all_gates(EnvironmentClass::Test))
        .when(PromotionCommand::PassGates {
            policy_requires_approval: true,
            at: at(3),
        })
        .then_expect_events(vec![PromotionEvent::GatesPassed {
            approval_required: true,
            passed_at: at(3),
        }]);
    assert_eq!(
        state_after(awaiting()),
        Some(PromotionState::AwaitingApproval)
    );
}

#[test]
fn a_rollback_needs_no_approval_even_in_production() {
    let mut given = vec![
        PromotionEvent::PromotionRequested(Box::new(rollback_request())),
        PromotionEvent::GatesEvaluationStarted { started_at: at(1) },
    ];
    for kind in GateKind::ORDER {
        given.push(PromotionEvent::GateEvaluated(Box::new(gate(
            kind,
            GateOutcome::Passed,
        ))));
    }
    Fixture::with(())
        .given(given)
        .when(PromotionCommand::PassGates {
            policy_requires_approval: true,
            at: at(3),
        })
        .then_expect_events(vec![PromotionEvent::GatesPassed {
            approval_required: false,
            passed_at: at(3),
        }]);
}

#[test]
fn the_approval_is_asked_for_once_with_the_plan() {
    Fixture::with(())
        .given(awaiting())
        .when(PromotionCommand::RequestApproval(Box::new(approval())))
        .then_expect_events(vec![PromotionEvent::ApprovalRequested(
            Box::new(approval()),
        )]);
    Fixture::with(())
        .given(approval_pending())
        .when(PromotionCommand::RequestApproval(Box::new(approval())))
        .then_expect_error(PromotionError::WrongState {
            command: "ask a second approval for",
            state: PromotionState::AwaitingApproval,
        });
}

#[test]
fn nobody_decides_before_the_plan_is_attached() {
    Fixture::with(())
        .given(awaiting())
        .when(decide("bob", Decision::Approve))
        .then_expect_error(PromotionError::ApprovalNotPending(ApprovalStatus::Planning));
    let error = PromotionError::ApprovalNotPending(ApprovalStatus::Planning).to_string();
    assert!(error.starts_with("the approval is Planning"), "{error}");
}

#[test]
fn the_approval_says_where_it_stands() {
    let status = |events: Vec<PromotionEvent>| {
        let mut promotion = Promotion::default();
        for e in events {
            promotion.apply(e);
        }
        promotion.approval_status()
    };
    assert_eq!(status(requested(EnvironmentClass::Production)), None);
    assert_eq!(status(awaiting()), Some(ApprovalStatus::Planning));
    assert_eq!(status(approval_pending()), Some(ApprovalStatus::Pending));
    assert_eq!(
        status(approved_production()),
        Some(ApprovalStatus::Approved)
    );
    let mut expired = approval_pending();
    expired.push(PromotionEvent::ApprovalExpired {
        approval_id: Some(approval_id(4)),
        expired_at: at(9),
    });
    assert_eq!(status(expired), Some(ApprovalStatus::Expired));
    let mut voided = approval_pending();
    voided.push(PromotionEvent::ApprovalVoided {
        approval_id: approval_id(4),
        reason: "stale".to_string(),
        voided_at: at(9),
    });
    assert_eq!(status(voided.clone()), Some(ApprovalStatus::Voided));
    assert!(matches!(
        Fixture::with(())
            .given(voided)
            .when(decide("bob", Decision::Approve))
            .inspect_result(),
        Err(PromotionError::ApprovalNotPending(ApprovalStatus::Voided))
    ));
    // Outside production no approval is needed: no status.
    assert_eq!(status(approved_staging()), None);
}

/// Issue 37: a run-control decision naming `decidedBy: "alice "` completed alice's
/// production promotion.
#[test]
fn the_requester_cannot_decide_their_own_promotion_under_another_spelling() {
    for spelling in ["alice ", "Alice", "ALICE", "ａｌｉｃｅ"] {
        Fixture::with(())
            .given(approval_pending())
            .when(decide(spelling, Decision::Approve))
            .then_expect_error(PromotionError::SelfApproval(actor("alice")));
    }
    // A decider named with a hidden character (as stored) is alice too.
    Fixture::with(())
        .given(approval_pending())
        .when(PromotionCommand::DecideApproval {
            approval_id: None,
            decision: Decision::Approve,
            decided_by: serde_json::from_str("\"alice\\u2060\"").unwrap(),
            reason: None,
            at: at(5),
        })
        .then_expect_error(PromotionError::SelfApproval(actor("alice")));
}

#[test]
fn the_requester_cannot_decide_their_own_promotion() {
    Fixture::with(())
        .given(approval_pending())
        .when(decide("alice", Decision::Approve))
        .then_expect_error(PromotionError::SelfApproval(actor("alice")));
    Fixture::with(())
        .given(approval_pending())
        .when(decide("alice", Decision::Reject))
        .then_expect_error(PromotionError::SelfApproval(actor("alice")));
}

#[test]
fn a_decision_naming_another_approval_is_refused() {
    Fixture::with(())
        .given(approval_pending())
        .when(PromotionCommand::DecideApproval {
            approval_id: Some(approval_id(99)),
            decision: Decision::Approve,
            decided_by: actor("bob"),
            reason: None,
            at: at(5),
        })
        .then_expect_error(PromotionError::ApprovalMismatch(approval_id(99)));
}

#[test]
fn another_identity_approves() {
    Fixture::with(())
        .given(approval_pending())
        .when(decide("bob", Decision::Approve))
        .then_expect_events(vec![PromotionEvent::ApprovalGranted {
            approval_id: approval_id(4),
            decided_by: actor("bob"),
            reason: Some("looks right".to_string()),
            decided_at: at(5),
        }]);
    assert_eq!(
        state_after(approved_production()),
        Some(PromotionState::Approved)
    );
}

#[test]
fn a_rejection_or_an_expiry_rejects_the_promotion() {
    Fixture::with(())
        .given(approval_pending())
        .when(decide("bob", Decision::Reject))
        .then_expect_events(vec![
            PromotionEvent::ApprovalRejected {
                approval_id: approval_id(4),
                decided_by: actor("bob"),
                reason: Some("looks right".to_string()),
                decided_at: at(5),
            },
            PromotionEvent::PromotionRejected {
                reason: "the approval was rejected by bob: looks right".to_string(),
                gate: None,
                rejected_at: at(5),
            },
        ]);
    Fixture::with(())
        .given(approval_pending())
        .when(PromotionCommand::ExpireApproval { at: at(9999) })
        .then_expect_events(vec![
            PromotionEvent::ApprovalExpired {
                approval_id: Some(approval_id(4)),
                expired_at: at(9999),
            },
            PromotionEvent::PromotionRejected {
                reason: "the approval expired undecided".to_string(),
                gate: None,
                rejected_at: at(9999),
            },
        ]);
}

#[test]
fn a_stale_plan_voids_the_approval_and_a_new_plan_asks_anew() {
    let voided = PromotionEvent::ApprovalVoided {
        approval_id: approval_id(4),
        reason: "the plan went stale".to_string(),
        voided_at: at(6),
    };
    Fixture::with(())
        .given(approved_production())
        .when(PromotionCommand::VoidApproval {
            reason: "the plan went stale".to_string(),
            at: at(6),
        })
        .then_expect_events(vec![voided.clone()]);
    let mut given = approved_production();
    given.push(voided);
    assert_eq!(
        state_after(given.clone()),
        Some(PromotionState::AwaitingApproval)
    );
    // The old approval covers nothing: nothing to decide or hand off until a new plan.
    Fixture::with(())
        .given(given.clone())
        .when(decide("bob", Decision::Approve))
        .then_expect_error(PromotionError::ApprovalNotPending(ApprovalStatus::Voided));
    let fresh = ApprovalRequest {
        approval_id: approval_id(6),
        provisioning_run_id: run(7),
        ..approval()
    };
    Fixture::with(())
        .given(given)
        .when(PromotionCommand::RequestApproval(Box::new(fresh.clone())))
        .then_expect_events(vec![PromotionEvent::ApprovalRequested(Box::new(fresh))]);
}

#[test]
fn the_hand_off_must_name_the_approved_run() {
    Fixture::with(())
        .given(approved_production())
        .when(PromotionCommand::HandOff {
            desired_state_ref: "spec@8".to_string(),
            provisioning_run_id: run(42),
            at: at(6),
        })
        .then_expect_error(PromotionError::RunMismatch(run(42)));
    Fixture::with(())
        .given(approved_production())
        .when(PromotionCommand::HandOff {
            desired_state_ref: "spec@7".to_string(),
            provisioning_run_id: run(5),
            at: at(6),
        })
        .then_expect_events(vec![handed_off()]);
}

#[test]
fn without_an_approval_any_run_is_handed_off() {
    Fixture::with(())
        .given(approved_staging())
        .when(PromotionCommand::HandOff {
            desired_state_ref: "spec@2".to_string(),
            provisioning_run_id: run(11),
            at: at(6),
        })
        .then_expect_events(vec![PromotionEvent::PromotionApproved {
            desired_state_ref: "spec@2".to_string(),
            provisioning_run_id: run(11),
            approval_id: None,
            strategy: Strategy::Canary,
            approved_at: at(6),
        }]);
}

#[test]
fn provisioning_reports_move_a_deploying_promotion() {
    Fixture::with(())
        .given(deploying())
        .when(PromotionCommand::RecordApplied {
            provisioning_run_id: run(5),
            at: at(7),
            verification_ends_at: at(67),
        })
        .then_expect_events(vec![PromotionEvent::DeploymentApplied {
            provisioning_run_id: run(5),
            applied_at: at(7),
            verification_ends_at: at(67),
        }]);
    Fixture::with(())
        .given(deploying())
        .when(PromotionCommand::RecordApplied {
            provisioning_run_id: run(6),
            at: at(7),
            verification_ends_at: at(67),
        })
        .then_expect_error(PromotionError::RunMismatch(run(6)));
    Fixture::with(())
        .given(deploying())
        .when(PromotionCommand::RecordDeploymentFailed {
            provisioning_run_id: run(5),
            reason: "bucket quota".to_string(),
            at: at(7),
        })
        .then_expect_events(vec![
            PromotionEvent::DeploymentFailed {
                provisioning_run_id: run(5),
                reason: "bucket quota".to_string(),
                failed_at: at(7),
            },
            PromotionEvent::PromotionFailed {
                reason: "provisioning failed: bucket quota".to_string(),
                rolled_back: false,
                failed_at: at(7),
            },
        ]);
    assert_eq!(state_after(verifying()), Some(PromotionState::Verifying));
}

#[test]
fn verification_that_passes_completes_the_promotion() {
    let measurement = Measurement {
        kind: CheckKind::Health,
        name: "https://payments.example.com/healthz".to_string(),
        value: "200".to_string(),
        threshold: Some("200".to_string()),
        passed: Some(true),
        measured_at: at(10),
    };
    Fixture::with(())
        .given(verifying())
        .when(PromotionCommand::Measure(Box::new(measurement.clone())))
        .then_expect_events(vec![PromotionEvent::VerificationMeasured(Box::new(
            measurement,
        ))]);
    Fixture::with(())
        .given(verifying())
        .when(PromotionCommand::ConcludeVerification {
            outcome: VerificationOutcome::Passed,
            reason: "window closed".to_string(),
            by: None,
            at: at(67),
        })
        .then_expect_events(vec![
            concluded(VerificationOutcome::Passed),
            PromotionEvent::PromotionCompleted {
                completed_at: at(67),
            },
        ]);
    assert_eq!(state_after(completed()), Some(PromotionState::Completed));
}

#[test]
fn held_verification_is_decided_by_an_operator_with_a_reason() {
    let mut held = verifying();
    held.push(concluded(VerificationOutcome::Inconclusive));
    assert_eq!(state_after(held.clone()), Some(PromotionState::Verifying));
    // The verifier does not conclude twice.
    Fixture::with(())
        .given(held.clone())
        .when(PromotionCommand::ConcludeVerification {
            outcome: VerificationOutcome::Passed,
            reason: "again".to_string(),
            by: None,
            at: at(68),
        })
        .then_expect_error(PromotionError::VerificationClosed);
    Fixture::with(())
        .given(held.clone())
        .when(PromotionCommand::ConcludeVerification {
            outcome: VerificationOutcome::Passed,
            reason: " ".to_string(),
            by: Some(actor("carol")),
            at: at(68),
        })
        .then_expect_error(PromotionError::ReasonRequired);
    Fixture::with(())
        .given(held)
        .when(PromotionCommand::ConcludeVerification {
            outcome: VerificationOutcome::Passed,
            reason: "Prometheus was down; dashboards are green".to_string(),
            by: Some(actor("carol")),
            at: at(68),
        })
        .then_expect_events(vec![
            PromotionEvent::VerificationConcluded {
                outcome: VerificationOutcome::Passed,
                reason: "Prometheus was down; dashboards are green".to_string(),
                concluded_by: Some(actor("carol")),
                concluded_at: at(68),
            },
            PromotionEvent::PromotionCompleted {
                completed_at: at(68),
            },
        ]);
    // An Operator cannot cut an open verification short.
    Fixture::with(())
        .given(verifying())
        .when(PromotionCommand::ConcludeVerification {
            outcome: VerificationOutcome::Passed,
            reason: "trust me".to_string(),
            by: Some(actor("carol")),
            at: at(20),
        })
        .then_expect_error(PromotionError::NotHeld("still measuring"));
}

#[test]
fn failed_verification_rolls_back_and_the_promotion_ends_rolled_back() {
    Fixture::with(())
        .given(verification_failed())
        .when(start_rollback(true))
        .then_expect_events(vec![rollback_started(true)]);
    let mut rolling = verification_failed();
    rolling.push(rollback_started(true));
    Fixture::with(())
        .given(rolling.clone())
        .when(start_rollback(true))
        .then_expect_error(PromotionError::Rollback("a rollback is already under way"));
    Fixture::with(())
        .given(rolling.clone())
        .when(PromotionCommand::CompleteRollback { at: at(90) })
        .then_expect_events(vec![
            PromotionEvent::PromotionFailed {
                reason: "verification failed; the previous release was restored".to_string(),
                rolled_back: true,
                failed_at: at(90),
            },
            PromotionEvent::RollbackCompleted {
                restored_release_id: release(3),
                completed_at: at(90),
            },
        ]);
    rolling.push(PromotionEvent::PromotionFailed {
        reason: "x".to_string(),
        rolled_back: true,
        failed_at: at(90),
    });
    rolling.push(PromotionEvent::RollbackCompleted {
        restored_release_id: release(3),
        completed_at: at(90),
    });
    assert_eq!(state_after(rolling), Some(PromotionState::RolledBack));
}

#[test]
fn a_rollback_that_fails_leaves_the_promotion_failed() {
    let mut rolling = verification_failed();
    rolling.push(rollback_started(true));
    Fixture::with(())
        .given(rolling)
        .when(PromotionCommand::FailRollback {
            reason: "the previous release's plan failed".to_string(),
            at: at(90),
        })
        .then_expect_events(vec![
            PromotionEvent::RollbackFailed {
                reason: "the previous release's plan failed".to_string(),
                failed_at: at(90),
            },
            PromotionEvent::PromotionFailed {
                reason: "verification failed and the rollback failed: the previous release's plan failed".to_string(),
                rolled_back: false,
                failed_at: at(90),
            },
        ]);
}

#[test]
fn failed_verification_without_a_rollback_fails_the_promotion() {
    Fixture::with(())
        .given(verification_failed())
        .when(PromotionCommand::Fail {
            reason: "no previous release to restore".to_string(),
            at: at(70),
        })
        .then_expect_events(vec![PromotionEvent::PromotionFailed {
            reason: "no previous release to restore".to_string(),
            rolled_back: false,
            failed_at: at(70),
        }]);
    Fixture::with(())
        .given(verifying())
        .when(PromotionCommand::Fail {
            reason: "impatient".to_string(),
            at: at(20),
        })
        .then_expect_error(PromotionError::WrongState {
            command: "fail (verification has not failed)",
            state: PromotionState::Verifying,
        });
    Fixture::with(())
        .given(verifying())
        .when(start_rollback(true))
        .then_expect_error(PromotionError::WrongState {
            command: "roll back (verification has not failed)",
            state: PromotionState::Verifying,
        });
}

#[test]
fn a_completed_promotion_is_rolled_back_by_hand_with_a_reason() {
    Fixture::with(())
        .given(completed())
        .when(PromotionCommand::StartRollback {
            rollback_promotion_id: PromotionId::from_uuid(uuid::Uuid::from_u128(8)),
            restored_release_id: release(3),
            automatic: false,
            by: actor("carol"),
            reason: "".to_string(),
            at: at(70),
        })
        .then_expect_error(PromotionError::ReasonRequired);
    let mut rolling = completed();
    rolling.push(rollback_started(false));
    Fixture::with(())
        .given(rolling.clone())
        .when(PromotionCommand::CompleteRollback { at: at(200) })
        .then_expect_events(vec![PromotionEvent::RollbackCompleted {
            restored_release_id: release(3),
            completed_at: at(200),
        }]);
    // A failed manual rollback leaves the release completed.
    rolling.push(PromotionEvent::RollbackFailed {
        reason: "x".to_string(),
        failed_at: at(200),
    });
    assert_eq!(state_after(rolling), Some(PromotionState::Completed));
}

#[test]
fn a_promotion_is_rejected_before_deploying_and_not_after() {
    for given in [
        requested(EnvironmentClass::Staging),
        evaluating(EnvironmentClass::Staging),
        approval_pending(),
        approved_staging(),
    ] {
        Fixture::with(())
            .given(given)
            .when(PromotionCommand::Reject {
                reason: "release withdrawn".to_string(),
                at: at(8),
            })
            .then_expect_events(vec![PromotionEvent::PromotionRejected {
                reason: "release withdrawn".to_string(),
                gate: None,
                rejected_at: at(8),
            }]);
    }
    Fixture::with(())
        .given(deploying())
        .when(PromotionCommand::Reject {
            reason: "release withdrawn".to_string(),
            at: at(8),
        })
        .then_expect_error(PromotionError::WrongState {
            command: "reject",
            state: PromotionState::Deploying,
        });
}

/// Every command in every state: the ones that do not apply are a typed `WrongState`.
#[test]
fn every_command_in_a_state_it_does_not_apply_to_is_a_wrong_state() {
    let histories: Vec<(PromotionState, Vec<PromotionEvent>)> = vec![
        (
            PromotionState::Requested,
            requested(EnvironmentClass::Production),
        ),
        (
            PromotionState::GatesEvaluating,
            evaluating(EnvironmentClass::Production),
        ),
        (PromotionState::AwaitingApproval, approval_pending()),
        (PromotionState::Approved, approved_production()),
        (PromotionState::Deploying, deploying()),
        (PromotionState::Verifying, verifying()),
        (PromotionState::Completed, completed()),
    ];
    let commands: Vec<(&str, Vec<PromotionState>, PromotionCommand)> = vec![
        (
            "start",
            vec![PromotionState::Requested],
            PromotionCommand::StartGates { at: at(1) },
        ),
        (
            "hand off",
            vec![PromotionState::Approved],
            PromotionCommand::HandOff {
                desired_state_ref: "spec@7".to_string(),
                provisioning_run_id: run(5),
                at: at(6),
            },
        ),
        (
            "applied",
            vec![PromotionState::Deploying],
            PromotionCommand::RecordApplied {
                provisioning_run_id: run(5),
                at: at(7),
                verification_ends_at: at(67),
            },
        ),
        (
            "expire",
            vec![PromotionState::AwaitingApproval],
            PromotionCommand::ExpireApproval { at: at(9) },
        ),
    ];
    for (state, history) in &histories {
        assert_eq!(state_after(history.clone()), Some(*state));
        for (name, allowed, command) in &commands {
            if allowed.contains(state) {
                continue;
            }
            let error = Fixture::with(())
                .given(history.clone())
                .when(command.clone())
                .inspect_result()
                .err();
            assert!(
                matches!(error, Some(PromotionError::WrongState { state: s, .. }) if s == *state),
                "{name} in {state:?}: {error:?}"
            );
        }
    }
}

#[test]
fn people_s_reasons_are_checked_and_ferry_s_own_made_inert() {
    let mut escaped = decide("rita", Decision::Reject);
    if let PromotionCommand::DecideApproval { reason, .. } = &mut escaped {
        *reason = Some("no\u{202E}pe".to_string());
    }
    assert!(matches!(
        Fixture::with(())
            .given(approval_pending())
            .when(escaped)
            .inspect_result(),
        Err(PromotionError::InvalidText(_))
    ));
    let mut long = start_rollback(false);
    if let PromotionCommand::StartRollback { reason, .. } = &mut long {
        *reason = "r".repeat(250_000);
    }
    assert!(matches!(
        Fixture::with(())
            .given(completed())
            .when(long)
            .inspect_result(),
        Err(PromotionError::InvalidText(_))
    ));
    let mut hotfix = request(EnvironmentClass::Staging);
    hotfix.hotfix = Some(Hotfix {
        reason: "\u{1b}[2Jurgent".to_string(),
    });
    assert!(matches!(
        Fixture::with(())
            .given_no_previous_events()
            .when(PromotionCommand::Request(Box::new(hotfix)))
            .inspect_result(),
        Err(PromotionError::InvalidText(crate::text::InvalidText { ref field, .. }))
            if field == "hotfix.reason"
    ));
    // A rejection quoting a withdrawal's long reason is kept, bounded, never refused: the
    // driver writes it, and a refusal would hold the promotion for ever.
    let events = Fixture::with(())
        .given(requested(EnvironmentClass::Staging))
        .when(PromotionCommand::Reject {
            reason: format!("the release was withdrawn: {}", "w".repeat(5000)),
            at: at(3),
        })
        .inspect_result()
        .unwrap();
    let Some(PromotionEvent::PromotionRejected { reason, .. }) = events.first() else {
        panic!("{events:?}");
    };
    assert_eq!(reason.chars().count(), crate::text::MAX_REASON);
    assert!(reason.ends_with('…'));
}

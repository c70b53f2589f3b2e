//! `/runs/{id}`: one provisioning run's record. Its plan receipt (totals, each resource with
//! its operation and changed properties, what the ignore rules left out, the inputs hash,
//! the runner, the policy decision), its approval, what authorised the apply, its apply
//! receipt (result, outputs, duration), why it failed or was cancelled, and its log as text.
//! An Operator or PlatformAdmin other than the requester may approve or reject a run
//! awaiting approval (a production run or a drift proposal) from the page.

use super::layout::{self, short};
use super::session::Viewer;
use crate::contexts::provisioning::use_cases;
use crate::contexts::provisioning::views::RunView;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use ferry_api::extract::RequestIds;
use ferry_api::state::AppState;
use ferry_domain::receipts::{ApplyReceipt, PlanReceipt};
use ferry_domain::ProvisioningState;
use maud::{html, Markup};

/// Log bytes shown on the page at most (the rest is one request away over the API).
const LOG_BYTES: usize = 64 * 1024;

/// `GET /runs/{id}`.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant, run = %id))]
pub async fn page(
    viewer: Viewer,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Response {
    let run = match use_cases::run(&state, &viewer.caller, &id).await {
        Ok(run) => run,
        Err(error) => return layout::error_page(error).await,
    };
    // A run without a log yet (or whose log is gone) still shows its receipts.
    let log = use_cases::run_logs(&state, &viewer.caller, &id).await.ok();
    render(&viewer, &run, log.as_deref(), None).into_response()
}

/// `POST /runs/{id}/decide`: the run's approval decided through the API's use case.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant, run = %id))]
pub async fn decide(
    viewer: Viewer,
    State(state): State<AppState>,
    ids: RequestIds,
    Path(id): Path<String>,
    Form(form): Form<layout::DecideForm>,
) -> Response {
    if let Err(refused) = viewer.check_csrf(&form.csrf) {
        return refused.into_response();
    }
    let decision = match form.decision() {
        Ok(decision) => decision,
        Err(e) => return layout::error_page(e).await,
    };
    let body = use_cases::ApprovalRequest {
        decision,
        reason: Some(form.reason),
    };
    match use_cases::decide_approval(&state, &viewer.caller, ids, &id, body).await {
        Ok(run) => Redirect::to(&format!("/runs/{}", run.provisioning_run_id)).into_response(),
        Err(error) => {
            let (status, message) = layout::problem_of(error).await;
            match use_cases::run(&state, &viewer.caller, &id).await {
                Ok(run) => (status, render(&viewer, &run, None, Some(&message))).into_response(),
                Err(error) => layout::error_page(error).await,
            }
        }
    }
}

/// Whether the viewer may decide this run's approval now: an Operator or PlatformAdmin with
/// the apply scope who did not request it (people compared as people).
fn may_decide(viewer: &Viewer, run: &RunView) -> bool {
    run.state == ProvisioningState::AwaitingApproval
        && viewer.caller.require_apply().is_ok()
        && viewer.caller.actor.person_key() != run.requested_by.person_key()
}

fn render(viewer: &Viewer, run: &RunView, log: Option<&str>, error: Option<&str>) -> layout::Page {
    let title = format!("Run {}", short(&run.provisioning_run_id.to_string()));
    layout::page(
        viewer,
        &title,
        html! {
            h1 { (format!("{:?}", run.kind)) " run in " (run.environment_id.as_str()) }
            @if let Some(error) = error {
                p class="error" role="alert" { (error) }
            }
            dl class="facts" {
                dt { "State" } dd class="state" { (format!("{:?}", run.state)) }
                dt { "Run" } dd { code { (run.provisioning_run_id) } }
                dt { "Project" } dd { (run.project_id.as_str()) }
                dt { "Specification" } dd { code { (run.specification_id) } " version " (run.specification_version) }
                dt { "Requested by" } dd { (run.requested_by.as_str()) " at " (run.started_at.to_rfc3339()) }
                @if let Some(promotion) = run.promotion_id {
                    dt { "Promotion" } dd { a href={ "/promotions/" (promotion) } { (promotion) } }
                }
            }
            @if let Some(plan) = &run.plan_receipt { (plan_section(plan)) }
            @if let Some(approval) = &run.approval {
                section {
                    h2 { "Approval" }
                    @if let Some(reason) = &approval.required_reason { p { "Needed: " (reason) } }
                    @if let Some(d) = &approval.decision {
                        p class="decision" {
                            (format!("{:?}", d.decision)) " by " (d.decided_by.as_str()) " at " (d.decided_at.to_rfc3339())
                            @if let Some(reason) = &d.reason { ": " (reason) }
                        }
                    } @else {
                        p { "Waiting for an Operator or PlatformAdmin other than the requester." }
                    }
                    @if may_decide(viewer, run) {
                        (layout::decide_form(&format!("/runs/{}/decide", run.provisioning_run_id), &viewer.csrf))
                    }
                }
            }
            @if let Some(receipt) = &run.apply_receipt { (apply_section(receipt)) }
            @if let Some(failure) = &run.failure {
                section { h2 { "Failed" } p class="error" { (format!("{:?}", failure.stage)) ": " (failure.reason) } }
            }
            @if let Some(reason) = &run.superseded_reason {
                section { h2 { "Superseded" } p { (reason) } }
            }
            section {
                h2 { "Log" }
                @match log {
                    Some(log) => pre class="log" { (cut(log)) },
                    None => p class="empty" { "No log yet." },
                }
            }
        },
    )
}

fn plan_section(plan: &PlanReceipt) -> Markup {
    html! {
        section {
            h2 { "Plan" }
            p class="totals" {
                (plan.adds) " to add, " (plan.changes) " to change, "
                (plan.deletes) " to delete, " (plan.replaces) " to replace"
            }
            p {
                "Inputs hash " code { (plan.inputs_hash) } ", program " code { (plan.program_version) }
                ", runner " (plan.runner) " " (plan.runner_version)
            }
            @if let Some(policy) = &plan.policy {
                p { "Policy: " (format!("{:?}", policy.decision)) }
            }
            (layout::plan_table(&plan.resources))
            @if !plan.ignored.is_empty() {
                p { (plan.ignored.len()) " difference(s) left out by the environment's ignore rules." }
            }
            @for warning in &plan.warnings { p class="hint" { (warning) } }
        }
    }
}

fn apply_section(receipt: &ApplyReceipt) -> Markup {
    html! {
        section {
            h2 { "Apply" }
            p { (format!("{:?}", receipt.result)) " in " (format!("{:.1}", receipt.duration_seconds)) " s, runner " (receipt.runner_version) }
            @if let Some(resource) = &receipt.failing_resource { p class="error" { "Failing resource: " code { (resource) } } }
            @if !receipt.outputs.is_empty() {
                table class="outputs" {
                    thead { tr { th { "Output" } th { "Value" } } }
                    tbody {
                        @for (name, value) in &receipt.outputs {
                            tr { td { (name) } td { code { (value.to_string()) } } }
                        }
                    }
                }
            }
        }
    }
}

/// The log's first [`LOG_BYTES`], cut at a character boundary.
fn cut(log: &str) -> String {
    if log.len() <= LOG_BYTES {
        return log.to_string();
    }
    let mut end = LOG_BYTES;
    while !log.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}\n… (cut: the whole log is at GET /factory/provisioning/runs/{{id}}/logs)",
        &log[..end]
    )
}

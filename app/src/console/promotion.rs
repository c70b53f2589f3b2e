//! `/promotions/{id}`: one promotion's evidence. The gates in order with their reasons and
//! evidence; the approval with the plan it covers (each resource with its operation and
//! changed properties, the totals, the inputs hash, the plan log); Approve / Reject for a
//! viewer who may decide (never the requester; the use case refuses anyone else anyway);
//! the verification measurements as a small chart over the window; the rollback.

use super::layout::{self, short};
use super::session::Viewer;
use crate::contexts::promotions::use_cases::{self, DecideApprovalRequest, TimelineEntry};
use crate::contexts::promotions::views::{self as delivery, PromotionView};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use ferry_api::auth::Role;
use ferry_api::extract::RequestIds;
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::promotion::{ApprovalStatus, Measurement};
use ferry_domain::PromotionId;
use maud::{html, Markup};

fn promotion_id(raw: &str) -> Result<PromotionId, ApiError> {
    PromotionId::parse(raw).map_err(|e| ApiError::NotFound(format!("no promotion {raw:?}: {e}")))
}

/// `GET /promotions/{id}`.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant, promotion = %id))]
pub async fn page(
    viewer: Viewer,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Response {
    let found = match promotion_id(&id) {
        Ok(id) => use_cases::promotion(&state, &viewer.caller, id).await,
        Err(e) => Err(e),
    };
    match found {
        Ok(view) => {
            let timeline = use_cases::timeline(&state, &viewer.caller, view.promotion_id)
                .await
                .unwrap_or_default();
            let page = Page {
                view: &view,
                version: version(&state, &viewer, &view).await,
                timeline: &timeline,
            };
            render(&viewer, &page, None).into_response()
        }
        Err(error) => layout::error_page(error).await,
    }
}

/// `POST /promotions/{id}/decide`: the approval decided through the API's use case.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant, promotion = %id))]
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
    let id = match promotion_id(&id) {
        Ok(id) => id,
        Err(e) => return layout::error_page(e).await,
    };
    let body = DecideApprovalRequest {
        decision,
        reason: Some(form.reason),
    };
    match use_cases::decide_approval(&state, &viewer.caller, ids, id, body).await {
        // Back to the page, which now shows the decision (post/redirect/get).
        Ok(_) => Redirect::to(&format!("/promotions/{id}")).into_response(),
        Err(error) => {
            // The page again, saying why, with the API's status and words.
            let (status, message) = layout::problem_of(error).await;
            match use_cases::promotion(&state, &viewer.caller, id).await {
                Ok(view) => {
                    let page = Page {
                        version: version(&state, &viewer, &view).await,
                        view: &view,
                        timeline: &[],
                    };
                    (status, render(&viewer, &page, Some(&message))).into_response()
                }
                Err(error) => layout::error_page(error).await,
            }
        }
    }
}

/// `GET /promotions/{id}/plan-log`: the log of the plan the approval covers, as text.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant, promotion = %id))]
pub async fn plan_log(
    viewer: Viewer,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Response {
    let log = match promotion_id(&id) {
        Ok(id) => use_cases::approval_plan_log(&state, &viewer.caller, id).await,
        Err(e) => Err(e),
    };
    match log {
        Ok(log) => layout::page(
            &viewer,
            "Plan log",
            html! {
                h1 { "The plan log" }
                p { a href={ "/promotions/" (id) } { "Back to the promotion" } }
                pre class="log" { (log) }
            },
        )
        .into_response(),
        Err(error) => layout::error_page(error).await,
    }
}

/// Whether the viewer may decide this promotion's approval now: a Reviewer or
/// PlatformAdmin who is not the requester (people compared as people), while it is pending.
fn may_decide(viewer: &Viewer, view: &PromotionView) -> bool {
    let caller = &viewer.caller;
    view.approval_status == Some(ApprovalStatus::Pending)
        && (caller.has_role(Role::Reviewer) || caller.has_role(Role::PlatformAdmin))
        && caller.actor.person_key() != view.requested_by.person_key()
}

/// What the page shows: the promotion, its release's version, its history.
struct Page<'a> {
    view: &'a PromotionView,
    version: Option<String>,
    timeline: &'a [TimelineEntry],
}

/// The version of the promotion's release, as recorded.
async fn version(state: &AppState, viewer: &Viewer, view: &PromotionView) -> Option<String> {
    delivery::get_release(state.db(), &viewer.caller.tenant, view.release_id)
        .await
        .ok()
        .flatten()
        .map(|r| r.release.version.to_string())
}

fn render(viewer: &Viewer, page: &Page<'_>, error: Option<&str>) -> layout::Page {
    let (view, timeline) = (page.view, page.timeline);
    let title = format!("Promotion {}", short(&view.promotion_id.to_string()));
    layout::page(
        viewer,
        &title,
        html! {
            h1 { "Promotion to " (view.environment_id.as_str()) }
            @if let Some(error) = error {
                p class="error" role="alert" { (error) }
            }
            dl class="facts" {
                dt { "State" } dd class="state" { (view.state.as_str()) }
                dt { "Project" } dd { (view.project_id.as_str()) }
                dt { "Release" } dd {
                    @if let Some(version) = &page.version { strong { (version) } " " }
                    code { (view.release_id) }
                }
                dt { "Environment" } dd { (view.environment_id.as_str()) " (" (view.environment_class.as_str()) ")" }
                dt { "Requested by" } dd { (view.requested_by.as_str()) " at " (view.requested_at.to_rfc3339()) }
                dt { "Strategy" } dd { (view.strategy.as_str()) }
                @if let Some(hotfix) = &view.hotfix {
                    dt { "Hotfix" } dd { (hotfix.reason) }
                }
            }
            (gates(view))
            (approval(viewer, view))
            (verification(view))
            (ending(view))
            @if !timeline.is_empty() {
                section {
                    h2 { "Timeline" }
                    ol class="timeline" {
                        @for entry in timeline {
                            li {
                                time datetime=(entry.recorded_at.to_rfc3339()) { (entry.recorded_at.format("%Y-%m-%d %H:%M:%S")) }
                                " " strong { (entry.event) }
                                @if let Some(actor) = &entry.actor { " by " (actor) }
                            }
                        }
                    }
                }
            }
        },
    )
}

fn gates(view: &PromotionView) -> Markup {
    html! {
        section {
            h2 { "Gates" }
            @if view.gates.is_empty() {
                p class="empty" { "Not evaluated yet." }
            } @else {
                ol class="gates" {
                    @for gate in &view.gates {
                        li class={ "gate gate-" (format!("{:?}", gate.outcome)) } {
                            strong { (format!("{:?}", gate.kind)) } " — " (format!("{:?}", gate.outcome))
                            @for reason in &gate.reasons { div class="reason" { (reason) } }
                            details {
                                summary { "Evidence" }
                                pre { (serde_json::to_string_pretty(&gate.evidence).unwrap_or_default()) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn approval(viewer: &Viewer, view: &PromotionView) -> Markup {
    let Some(status) = view.approval_status else {
        return html! {};
    };
    html! {
        section id="approval" {
            h2 { "Approval" }
            p { "Status: " strong class="approval-status" { (format!("{status:?}")) } }
            @if let Some(by) = &view.approvable_by {
                p { "May be decided by " (by.roles.join(" or ")) ", except "
                    (by.except.iter().map(|a| a.as_str()).collect::<Vec<_>>().join(", ")) "." }
            }
            @if let Some(plan) = &view.approval_plan {
                h3 { "The plan it covers" }
                p class="totals" {
                    (plan.adds) " to add, " (plan.changes) " to change, "
                    (plan.deletes) " to delete, " (plan.replaces) " to replace"
                }
                p { "Inputs hash " code { (plan.inputs_hash) } ", program " code { (plan.program_version) } }
                (layout::plan_table(&plan.resources))
                p {
                    "Planned by run " a href={ "/runs/" (plan.provisioning_run_id) } { (short(&plan.provisioning_run_id.to_string())) }
                    " · " a href={ "/promotions/" (view.promotion_id) "/plan-log" } { "the plan log" }
                }
            }
            @if let Some(decision) = &view.approval_decision {
                p class="decision" {
                    (decision.decision) " by " (decision.decided_by.as_str()) " at " (decision.decided_at.to_rfc3339())
                    @if let Some(reason) = &decision.reason { ": " (reason) }
                }
            }
            @if may_decide(viewer, view) {
                (layout::decide_form(&format!("/promotions/{}/decide", view.promotion_id), &viewer.csrf))
            } @else if status == ApprovalStatus::Pending
                && viewer.caller.actor.person_key() == view.requested_by.person_key() {
                p class="hint" { "You asked for this promotion: someone else must decide its approval." }
            }
        }
    }
}

fn verification(view: &PromotionView) -> Markup {
    let v = &view.verification;
    if v.measurements.is_empty() && v.outcome.is_none() {
        return html! {};
    }
    html! {
        section {
            h2 { "Verification" }
            @if let Some(outcome) = &v.outcome {
                p { "Outcome: " strong { (format!("{outcome:?}")) }
                    @if let Some(reason) = &v.reason { " — " (reason) } }
            }
            (chart(&v.measurements))
            table class="measurements" {
                thead { tr { th { "When" } th { "Check" } th { "Value" } th { "Threshold" } th { "Passed" } } }
                tbody {
                    @for m in &v.measurements {
                        tr {
                            td { (m.measured_at.format("%H:%M:%S")) }
                            td { (m.name) }
                            td { (m.value) }
                            td { (m.threshold.as_deref().unwrap_or("")) }
                            td { (match m.passed { Some(true) => "yes", Some(false) => "no", None => "—" }) }
                        }
                    }
                }
            }
        }
    }
}

/// The measurements over the window as a small SVG chart: one mark per measurement, in
/// time order, high for a pass and low for a failure (numbers differ per check, passes do not).
fn chart(measurements: &[Measurement]) -> Markup {
    if measurements.is_empty() {
        return html! {};
    }
    let (width, height) = (600.0_f64, 60.0_f64);
    let first = measurements[0].measured_at.timestamp_millis() as f64;
    let last = measurements[measurements.len() - 1]
        .measured_at
        .timestamp_millis() as f64;
    let span = (last - first).max(1.0);
    html! {
        svg class="chart" viewBox={ "0 0 " (width) " " (height) } role="img"
            aria-label="Verification measurements over the window: high marks passed, low marks failed" {
            line x1="0" y1="30" x2=(width) y2="30" class="axis" {}
            @for m in measurements {
                @let x = 5.0 + (m.measured_at.timestamp_millis() as f64 - first) / span * (width - 10.0);
                @let (y, class) = match m.passed { Some(true) => (12.0, "pass"), Some(false) => (48.0, "fail"), None => (30.0, "unknown") };
                circle cx=(format!("{x:.1}")) cy=(y) r="4" class=(class) {
                    title { (m.name) ": " (m.value) }
                }
            }
        }
    }
}

fn ending(view: &PromotionView) -> Markup {
    html! {
        @if let Some(rollback) = &view.rollback {
            section {
                h2 { "Rollback" }
                p {
                    (format!("{:?}", rollback.outcome)) ": restoring release " (rollback.restored_release_id)
                    ", started by " (rollback.started_by.as_str())
                    @if rollback.automatic { " (automatically)" }
                    " — " (rollback.reason)
                }
                p { a href={ "/promotions/" (rollback.rollback_promotion_id) } { "The rollback promotion" } }
                @if let Some(failure) = &rollback.failure { p class="error" { (failure) } }
            }
        }
        @if let Some(r) = &view.rejection {
            section { h2 { "Rejected" } p { (r.reason) } }
        }
        @if let Some(f) = &view.failure {
            section { h2 { "Failed" } p { (f.reason) } }
        }
    }
}

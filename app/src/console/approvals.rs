//! `/approvals`: what waits for the viewer's decision. Promotions whose production approval
//! is pending and which the viewer may decide (a Reviewer or PlatformAdmin who did not ask
//! for them), and provisioning runs and drift proposals awaiting approval (which an Operator
//! or PlatformAdmin other than the requester decides on the run's page).

use super::layout::{self, short};
use super::session::Viewer;
use crate::contexts::promotions;
use crate::contexts::promotions::views::{self as delivery, PromotionFilter};
use crate::contexts::provisioning::use_cases::list_runs;
use crate::contexts::provisioning::views::RunFilter;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use ferry_api::auth::Role;
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::promotion::{ApprovalStatus, PromotionState};
use ferry_domain::ProvisioningState;
use maud::{html, Markup};

/// Items listed per kind, at most.
const LIMIT: u32 = 100;

/// `GET /approvals`.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant))]
pub async fn page(viewer: Viewer, State(state): State<AppState>) -> Response {
    match approvals(&state, &viewer).await {
        Ok(body) => layout::page(&viewer, "Approvals", body).into_response(),
        Err(error) => layout::error_page(error).await,
    }
}

async fn approvals(state: &AppState, viewer: &Viewer) -> Result<Markup, ApiError> {
    let caller = &viewer.caller;
    // Each list needs its context's read scope; a token with neither sees the refusal.
    let reads_delivery = caller.require_scope(promotions::READ).is_ok();
    let reads_runs = caller.require_read().is_ok();
    if !reads_delivery && !reads_runs {
        caller.require_scope(promotions::READ)?;
    }
    let me = caller.actor.person_key();
    let reviewer = caller.has_role(Role::Reviewer) || caller.has_role(Role::PlatformAdmin);
    let filter = PromotionFilter {
        state: Some(PromotionState::AwaitingApproval),
        ..PromotionFilter::default()
    };
    let mut promotions = Vec::new();
    if reads_delivery && reviewer {
        promotions = delivery::list_promotions(state.db(), &caller.tenant, &filter, LIMIT, None)
            .await?
            .items
            .into_iter()
            .filter(|p| {
                p.approval_status == Some(ApprovalStatus::Pending)
                    && p.requested_by.person_key() != me
            })
            .collect();
    }
    let mut runs = Vec::new();
    if reads_runs {
        let filter = RunFilter {
            state: Some(ProvisioningState::AwaitingApproval),
            ..RunFilter::default()
        };
        // Only those the viewer may decide: with the apply scope and an Operator's or
        // PlatformAdmin's role, and not their own.
        let decides = caller.require_apply().is_ok();
        runs = list_runs(state, caller, &filter, LIMIT, None)
            .await?
            .items
            .into_iter()
            .filter(|r| decides && r.requested_by.person_key() != me)
            .collect();
    }
    Ok(html! {
        h1 { "Waiting for your decision" }
        section {
            h2 { "Promotions" }
            @if promotions.is_empty() {
                p class="empty" { "No promotion waits for your approval." }
            } @else {
                ul class="approvals" {
                    @for p in &promotions {
                        li {
                            a href={ "/promotions/" (p.promotion_id) } {
                                (p.project_id.as_str()) " → " (p.environment_id.as_str())
                            }
                            " requested by " (p.requested_by.as_str())
                        }
                    }
                }
            }
        }
        section {
            h2 { "Provisioning runs and drift proposals" }
            @if runs.is_empty() {
                p class="empty" { "No run waits for your approval." }
            } @else {
                ul class="approvals" {
                    @for r in &runs {
                        li {
                            (format!("{:?}", r.kind)) " run "
                            a href={ "/runs/" (r.provisioning_run_id) } { (short(&r.provisioning_run_id.to_string())) }
                            " in " (r.environment_id.as_str())
                            @if let Some(plan) = &r.plan_receipt {
                                " — " (plan.adds) " to add, " (plan.changes) " to change, "
                                (plan.deletes) " to delete, " (plan.replaces) " to replace"
                            }
                        }
                    }
                }
            }
        }
    })
}

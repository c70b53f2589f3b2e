//! `/drift`: what the reconciler found. The open proposals (reconciliation runs waiting for
//! an Operator's approval, each with what it would change, linked to its run), and, for
//! each environment of the tenant, the ignore rules in force (the differences an Operator
//! accepted, which reconciliations leave out).

use super::layout::{self, short};
use super::session::Viewer;
use crate::contexts::promotions::environments;
use crate::contexts::provisioning::drift::ignore_rules;
use crate::contexts::provisioning::use_cases::list_runs;
use crate::contexts::provisioning::views::RunFilter;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::{ProvisioningKind, ProvisioningState};
use maud::{html, Markup};

/// Proposals and environments listed at most.
const LIMIT: u32 = 200;

/// `GET /drift`.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant))]
pub async fn page(viewer: Viewer, State(state): State<AppState>) -> Response {
    match drift(&state, &viewer).await {
        Ok(body) => layout::page(&viewer, "Drift", body).into_response(),
        Err(error) => layout::error_page(error).await,
    }
}

async fn drift(state: &AppState, viewer: &Viewer) -> Result<Markup, ApiError> {
    let caller = &viewer.caller;
    let filter = RunFilter {
        kind: Some(ProvisioningKind::Reconciliation),
        state: Some(ProvisioningState::AwaitingApproval),
        ..RunFilter::default()
    };
    let proposals = list_runs(state, caller, &filter, LIMIT, None).await?.items;
    // The environments come from the delivery read model; without its scope, only the
    // proposals' environments are known.
    let mut environment_ids: Vec<_> =
        match environments::environments(state, caller, None, LIMIT, None).await {
            Ok(page) => page.items.into_iter().map(|e| e.environment_id).collect(),
            Err(_) => proposals.iter().map(|p| p.environment_id.clone()).collect(),
        };
    environment_ids.sort();
    environment_ids.dedup();
    let mut rules = Vec::new();
    for environment in &environment_ids {
        let found = ignore_rules(state, caller, environment).await?;
        if !found.is_empty() {
            rules.push((environment, found));
        }
    }
    Ok(html! {
        h1 { "Drift" }
        section {
            h2 { "Proposals waiting for an Operator" }
            @if proposals.is_empty() {
                p class="empty" { "No reconciliation proposes a change." }
            } @else {
                ul class="proposals" {
                    @for p in &proposals {
                        li {
                            a href={ "/runs/" (p.provisioning_run_id) } { "Run " (short(&p.provisioning_run_id.to_string())) }
                            " in " (p.environment_id.as_str())
                            @if let Some(plan) = &p.plan_receipt {
                                " — " (plan.adds) " to add, " (plan.changes) " to change, "
                                (plan.deletes) " to delete, " (plan.replaces) " to replace"
                            }
                        }
                    }
                }
            }
        }
        section {
            h2 { "Ignore rules in force" }
            @if rules.is_empty() {
                p class="empty" { "No difference is accepted in any environment." }
            }
            @for (environment, found) in &rules {
                h3 { (environment.as_str()) }
                table class="rules" {
                    thead { tr { th { "Resource" } th { "Property" } th { "Why" } th { "Added by" } } }
                    tbody {
                        @for rule in found {
                            tr {
                                td { code { (rule.urn.as_str()) } }
                                td { (rule.property.as_ref().map(|p| p.as_str()).unwrap_or("(any)")) }
                                td { (rule.reason) }
                                td { (rule.added_by.as_str()) " at " (rule.added_at.to_rfc3339()) }
                            }
                        }
                    }
                }
            }
        }
    })
}

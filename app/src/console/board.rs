//! `/`: the board. Environments along the promotion path (development → production) as
//! columns, projects as rows; in each cell the release current there, the promotion in
//! flight and where it stands in words, and the releases quarantined there; under each
//! environment the drift proposals waiting. The script swaps in `/console/board` (the
//! board alone) whenever `/console/changes` says the tenant's stream moved, so it is live
//! without a reload.

use super::layout::{self, short};
use super::session::Viewer;
use crate::contexts::promotions::environments::{self, EnvironmentSummary};
use crate::contexts::promotions::views::{self as delivery, ReleaseFilter};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_domain::{EnvironmentClass, ProjectId, ReleaseId};
use maud::{html, Markup};
use std::collections::{BTreeSet, HashMap};

/// Environments shown at most (the board is for a tenant's path, not an inventory).
const ENVIRONMENTS: u32 = 200;

/// `GET /`.
#[tracing::instrument(skip_all, fields(tenant = %viewer.caller.tenant))]
pub async fn page(viewer: Viewer, State(state): State<AppState>) -> Response {
    match board(&state, &viewer).await {
        Ok(board) => layout::page(
            &viewer,
            "Board",
            html! {
                h1 { "Board" }
                div id="board" data-live="/console/board" { (board) }
            },
        )
        .into_response(),
        Err(error) => layout::error_page(error).await,
    }
}

/// `GET /console/board`: the board alone, for the live swap.
pub async fn fragment(viewer: Viewer, State(state): State<AppState>) -> Response {
    match board(&state, &viewer).await {
        Ok(board) => axum::response::Html(board.into_string()).into_response(),
        Err(error) => layout::error_page(error).await,
    }
}

/// Where a class sits on the promotion path.
fn path_rank(class: EnvironmentClass) -> u8 {
    match class {
        EnvironmentClass::Development => 0,
        EnvironmentClass::Test => 1,
        EnvironmentClass::Staging => 2,
        EnvironmentClass::Production => 3,
    }
}

/// What a promotion in this state is doing or waiting for, in words.
pub fn in_words(state: &str) -> &'static str {
    match state {
        "Requested" => "queued behind another promotion of the environment",
        "GatesEvaluating" => "evaluating its gates",
        "AwaitingApproval" => "waiting for a Reviewer's approval",
        "Approved" => "approved, about to deploy",
        "Deploying" => "deploying",
        "Verifying" => "verifying",
        _ => "finished",
    }
}

async fn board(state: &AppState, viewer: &Viewer) -> Result<Markup, ApiError> {
    let caller = &viewer.caller;
    let mut envs = environments::environments(state, caller, None, ENVIRONMENTS, None)
        .await?
        .items;
    envs.sort_by(|a, b| {
        (path_rank(a.environment_class), a.environment_id.as_str())
            .cmp(&(path_rank(b.environment_class), b.environment_id.as_str()))
    });
    let releases = delivery::list_releases(
        state.db(),
        &caller.tenant,
        &ReleaseFilter::default(),
        200,
        None,
    )
    .await?
    .items;
    let names: HashMap<ReleaseId, (ProjectId, String)> = releases
        .iter()
        .map(|r| {
            (
                r.release.release_id,
                (r.release.project_id.clone(), r.release.version.to_string()),
            )
        })
        .collect();
    let project_of = |id: &ReleaseId| names.get(id).map(|(p, _)| p.clone());
    let version_of = |id: &ReleaseId| {
        names
            .get(id)
            .map_or_else(|| short(&id.to_string()).to_string(), |(_, v)| v.clone())
    };
    let mut projects: BTreeSet<ProjectId> = BTreeSet::new();
    for env in &envs {
        projects.extend(env.current_releases.iter().map(|c| c.project_id.clone()));
        projects.extend(
            env.promotions_in_flight
                .iter()
                .filter_map(|p| project_of(&p.release_id)),
        );
        projects.extend(
            env.quarantines
                .iter()
                .filter_map(|q| project_of(&q.release_id)),
        );
    }
    Ok(html! {
        @if envs.is_empty() {
            p class="empty" { "No environment is recorded for this tenant yet." }
        } @else {
            table class="board" {
                thead {
                    tr {
                        th scope="col" { "Project" }
                        @for env in &envs { (environment_header(env)) }
                    }
                }
                tbody {
                    @for project in &projects {
                        tr {
                            th scope="row" { (project.as_str()) }
                            @for env in &envs {
                                td { (cell(env, project, &project_of, &version_of)) }
                            }
                        }
                    }
                }
            }
            @if projects.is_empty() {
                p class="empty" { "No release has been promoted yet." }
            }
        }
    })
}

fn environment_header(env: &EnvironmentSummary) -> Markup {
    html! {
        th scope="col" {
            div class="env" { (env.environment_id.as_str()) }
            div class="class" { (env.environment_class.as_str()) @if !env.ready { " · not ready" } }
            @if env.open_drift_proposals > 0 {
                div class="drift" { (env.open_drift_proposals) " drift proposal(s) waiting" }
            }
        }
    }
}

fn cell(
    env: &EnvironmentSummary,
    project: &ProjectId,
    project_of: &dyn Fn(&ReleaseId) -> Option<ProjectId>,
    version_of: &dyn Fn(&ReleaseId) -> String,
) -> Markup {
    let current = env
        .current_releases
        .iter()
        .find(|c| &c.project_id == project);
    let mine = |id: &ReleaseId| project_of(id).as_ref() == Some(project);
    html! {
        @if let Some(current) = current {
            div class="current" {
                a href={ "/promotions/" (current.promotion_id) } { (version_of(&current.release_id)) }
            }
        } @else {
            div class="none" { "—" }
        }
        @for p in env.promotions_in_flight.iter().filter(|p| mine(&p.release_id)) {
            div class={ "flight state-" (p.state) } {
                a href={ "/promotions/" (p.promotion_id) } { "→ " (version_of(&p.release_id)) }
                " " span class="why" { (in_words(&p.state)) }
            }
        }
        @for q in env.quarantines.iter().filter(|q| mine(&q.release_id)) {
            div class="quarantine" {
                a href={ "/promotions/" (q.promotion_id) } { (version_of(&q.release_id)) }
                " quarantined (rolled back)"
            }
        }
    }
}

//! The frame every console page shares: the head (the one stylesheet and script, nothing
//! inline), the navigation with who is signed in, and the page for a refusal.

use super::session::Viewer;
use axum::response::Html;
use axum::response::{IntoResponse, Response};
use ferry_api::problem::ApiError;
use maud::{html, Markup, DOCTYPE};

/// A page, ready to send.
pub type Page = Html<String>;

/// A page without navigation (sign-in, refusals).
pub fn bare(title: &str, body: Markup) -> Page {
    Html(frame(title, body).into_string())
}

fn frame(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Ferry" }
                link rel="stylesheet" href="/console/assets/console.css";
                script src="/console/assets/console.js" defer {}
            }
            body { (body) }
        }
    }
}

/// A page with the navigation, for `viewer`.
pub fn page(viewer: &Viewer, title: &str, body: Markup) -> Page {
    let caller = &viewer.caller;
    bare(
        title,
        html! {
            header class="top" {
                nav aria-label="Console" {
                    a href="/" { "Board" }
                    a href="/approvals" { "Approvals" }
                    a href="/drift" { "Drift" }
                    a href="/events" { "Events" }
                }
                div class="who" {
                    span { (caller.actor.as_str()) " · " (caller.tenant.as_str()) }
                    form method="post" action="/logout" class="inline" {
                        input type="hidden" name="csrf" value=(viewer.csrf);
                        button type="submit" class="link" { "Sign out" }
                    }
                }
            }
            main { (body) }
        },
    )
}

/// A page that says one thing (a refusal, a missing resource).
pub fn message_page(title: &str, message: &str) -> Page {
    bare(
        title,
        html! {
            main class="narrow" {
                h1 { (title) }
                p { (message) }
                p { a href="/" { "Back to the board" } }
            }
        },
    )
}

/// The status and words the API answers `error` with: its problem's detail and field
/// reasons (an unexpected error's details stay in the log).
pub async fn problem_of(error: ApiError) -> (axum::http::StatusCode, String) {
    let response = error.into_response();
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut message = problem["detail"].as_str().unwrap_or_default().to_string();
    for e in problem["errors"].as_array().into_iter().flatten() {
        let field = e["field"].as_str().unwrap_or_default();
        let reason = e["reason"].as_str().unwrap_or_default();
        message.push_str(&format!(" {field}: {reason}."));
    }
    if message.trim().is_empty() {
        message = "Ferry refused the request.".to_string();
    }
    (status, message.trim().to_string())
}

/// An API error as a page, with the API's status and words.
pub async fn error_page(error: ApiError) -> Response {
    let (status, message) = problem_of(error).await;
    let title = status.canonical_reason().unwrap_or("Error");
    (status, message_page(title, &message)).into_response()
}

/// A plan's resources: each with its operation, type and changed properties.
pub fn plan_table(resources: &[ferry_domain::receipts::PlannedResource]) -> Markup {
    html! {
        table class="plan" {
            thead { tr { th { "Operation" } th { "Resource" } th { "Type" } th { "Changed properties" } } }
            tbody {
                @for r in resources {
                    tr {
                        td { (format!("{:?}", r.op)) }
                        td { code { (r.urn) } }
                        td { (r.resource_type) }
                        td { (r.properties.join(", ")) }
                    }
                }
            }
        }
    }
}

/// An Approve / Reject form as posted (a promotion's or a run's approval).
#[derive(Debug, serde::Deserialize)]
pub struct DecideForm {
    /// The session's CSRF token.
    pub csrf: String,
    decision: String,
    /// Why.
    #[serde(default)]
    pub reason: String,
}

impl DecideForm {
    /// The button pressed.
    pub fn decision(&self) -> Result<ferry_domain::run::Decision, ApiError> {
        match self.decision.as_str() {
            "approve" => Ok(ferry_domain::run::Decision::Approve),
            "reject" => Ok(ferry_domain::run::Decision::Reject),
            _ => Err(ApiError::invalid_field("decision", "approve or reject")),
        }
    }
}

/// The Approve / Reject form posting to `action`, with a required reason.
pub fn decide_form(action: &str, csrf: &str) -> Markup {
    html! {
        form method="post" action=(action) class="decide" {
            input type="hidden" name="csrf" value=(csrf);
            label for="reason" { "Reason" }
            input type="text" id="reason" name="reason" required;
            button type="submit" name="decision" value="approve" { "Approve" }
            button type="submit" name="decision" value="reject" class="danger" { "Reject" }
        }
    }
}

/// A short form of a UUID-like id for tables (the full id is in the link).
pub fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

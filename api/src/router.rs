//! The router: the process's own routes (events in and out, and the operational endpoints
//! `/healthz`, `/readyz`, `/metrics`, `/openapi.json`), merged with every bounded context's
//! routes into the router and the OpenAPI document ([`Api`]), with the request-id, tracing
//! and problem+json layers.

use crate::events;
use crate::extract::{RequestIds, MAX_BODY};
use crate::openapi::{Doc, PUBLISH, READ};
use crate::problem::ApiError;
use crate::state::AppState;
use aide::axum::routing::{get_with, post_with};
use aide::axum::ApiRouter;
use aide::openapi::OpenApi;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use ferry_store::stream;
use serde_json::json;
use tower_http::trace::TraceLayer;

async fn request_ids(mut request: Request, next: Next) -> Response {
    let ids = RequestIds::from_headers(request.headers());
    request.extensions_mut().insert(ids);
    let span = tracing::info_span!("request", request_id = %ids.request_id, method = %request.method(), path = %request.uri().path());
    let mut response = tracing::Instrument::instrument(next.run(request), span).await;
    if let Ok(v) = HeaderValue::from_str(&ids.request_id.to_string()) {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}

/// Every error answer is problem+json: what axum refuses before a handler runs (a path
/// segment that is not UTF-8, a body past the limit where the handler reads raw bytes) is
/// plain text otherwise. JSON answers (problems, `/readyz`'s 503) pass unchanged.
async fn problem_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let plain = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_none_or(|v| v.to_ascii_lowercase().starts_with("text/plain"));
    if !(status.is_client_error() || status.is_server_error()) || !plain {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let (slug, title) = match status {
        StatusCode::BAD_REQUEST => ("invalid-request", "Invalid request"),
        StatusCode::PAYLOAD_TOO_LARGE => ("payload-too-large", "Payload too large"),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ("unsupported-media-type", "Unsupported media type"),
        s if s.is_server_error() => ("internal-error", "Internal error"),
        _ => ("invalid-request", "Invalid request"),
    };
    // axum names the refused part in backquotes (`Invalid UTF-8 in `environmentId``).
    let field = text
        .split('`')
        .nth(1)
        .filter(|f| !f.is_empty())
        .unwrap_or("request");
    let detail = if status.is_server_error() || text.is_empty() {
        status.canonical_reason().unwrap_or(title).to_string()
    } else {
        text.clone()
    };
    let problem = crate::problem::Problem {
        problem_type: format!("urn:ferry:problem:{slug}"),
        title: title.to_string(),
        status: status.as_u16(),
        errors: if status.is_client_error() && !text.is_empty() {
            vec![crate::problem::FieldError::new(field, &text)]
        } else {
            vec![]
        },
        detail,
        retry_after_seconds: None,
    };
    let body = serde_json::to_vec(&problem).unwrap_or_default();
    parts.headers.insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(body))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

/// `/readyz`: 503 when the store does not answer; otherwise 200 with `status` `ready`, or
/// `degraded` with the `problems` an operator must look at (a subscription stuck on an event,
/// a transaction holding the event stream back, the NATS relay or an inbound consumer
/// failing, a stream found without the relay's messages), every subscription's position and
/// lag, and with NATS the relay's and each inbound consumer's state, lag and last error.
async fn readyz(State(state): State<AppState>) -> Response {
    if !state.db().ping().await {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(
                serde_json::json!({"status": "unavailable", "reason": "the store does not answer"}),
            ),
        )
            .into_response();
    }
    let subscriptions = match stream::subscription_status(state.db()).await {
        Ok(s) => s,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let stuck = state.db().subscription_health().problems();
    let holder = match stream::stream_holder(state.db(), state.stream_hold_warn()).await {
        Ok(h) => h,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let mut problems: Vec<String> = stuck
        .iter()
        .map(|p| {
            format!(
                "subscription {} is stuck (nothing skipped, {} attempts since {}): {}",
                p.name,
                p.attempts,
                p.since.to_rfc3339(),
                p.error
            )
        })
        .collect();
    if let Some(h) = &holder {
        problems.push(holder_problem(h));
    }
    let readiness = state.telemetry().readiness(&subscriptions);
    problems.extend(readiness.problems);
    let subscriptions: Vec<serde_json::Value> = subscriptions
        .into_iter()
        .map(|s| {
            let mut v = serde_json::to_value(&s).unwrap_or_default();
            if let Some(p) = stuck.iter().find(|p| p.name == s.name) {
                v["stuck"] = serde_json::to_value(p).unwrap_or_default();
            }
            v
        })
        .collect();
    let status = if problems.is_empty() {
        "ready"
    } else {
        "degraded"
    };
    let mut body = serde_json::json!({
        "status": status,
        "problems": problems,
        "subscriptions": subscriptions,
    });
    if let Some(h) = holder {
        body["streamHeldBackBy"] = serde_json::to_value(h).unwrap_or_default();
    }
    if let Some(nats) = readiness.nats {
        body["nats"] = nats;
    }
    if let Some(trust) = readiness.inbound_trust {
        body["inboundTrust"] = trust;
    }
    Json(body).into_response()
}

/// One line naming the transaction that holds the event stream back.
pub fn holder_problem(h: &ferry_store::stream::StreamHolder) -> String {
    let who = match (&h.pid, &h.prepared_gid) {
        (Some(pid), _) => format!("backend pid {pid}"),
        (None, Some(gid)) => format!("prepared transaction {gid:?}"),
        (None, None) => "a transaction".to_string(),
    };
    format!(
        "{who} (database {}, {}, {}) has held the event stream back for {:.0} s; {} events wait behind it",
        h.database.as_deref().unwrap_or("?"),
        h.application
            .as_deref()
            .filter(|a| !a.is_empty())
            .unwrap_or("no application name"),
        h.state.as_deref().unwrap_or("unknown state"),
        h.age_seconds,
        h.waiting_events
    )
}

/// The document the router was built with (see [`Api`]).
#[derive(Clone)]
struct Document(std::sync::Arc<str>);

async fn openapi(Extension(Document(text)): Extension<Document>) -> Response {
    let mut response = text.to_string().into_response();
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    response
}

async fn metrics(State(state): State<AppState>) -> Response {
    // Lag needs the store; a store that does not answer leaves it out (readyz says why).
    let subscriptions = match stream::subscription_status(state.db()).await {
        Ok(subscriptions) => Some(subscriptions),
        Err(error) => {
            tracing::warn!(%error, "cannot read subscription lag for /metrics");
            None
        }
    };
    let text = state.telemetry().render(subscriptions.as_deref());
    let mut response = text.into_response();
    response.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint".to_string())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// The process's own routes: events in and out, metrics, health, readiness, this document.
fn process_routes() -> ApiRouter<AppState> {
    ApiRouter::new()
        .api_route(
            "/factory/events",
            post_with(events::post_event, |op| {
                op.id("PostEvent")
                    .summary("Accept one CloudEvent Ferry reacts to (EnvironmentCreated, EnvironmentStateChanged, ApprovalDecided, …), for users without NATS. Only service identities (scope factory.events.publish, no human role) may post, from a source FERRY_TRUSTED_SOURCES trusts for the event and, when either is set, that FERRY_SOURCE_IDENTITIES binds to the token's sub. Redelivery of the same source and id has no second effect; a malformed event is dead-lettered.")
                    .scope(PUBLISH)
                    .response_with::<202, Json<events::EventAccepted>, _>(|r| {
                        r.description("Handled (`duplicate` true when it was already).")
                    })
                    .errors(&[400, 401, 403, 409, 415, 422])
            }),
        )
        .api_route(
            "/factory/events/stream",
            get_with(events::event_stream, |op| {
                op.id("EventStream")
                    .summary("The tenant's events as Server-Sent Events (id = stream position, event = subject, data = CloudEvent); resume with Last-Event-ID or ?after=.")
                    .scope(READ)
                    .query("after", "Start after this stream position (an event's id).", json!({"type": "string"}))
                    .text(200, "text/event-stream", "text/event-stream")
                    .errors(&[400, 401, 403])
            }),
        )
        .api_route(
            "/metrics",
            get_with(metrics, |op| {
                op.id("Metrics")
                    .summary("Prometheus metrics.")
                    .public()
                    .text(200, "Prometheus text exposition.", "text/plain")
            }),
        )
        .api_route(
            "/healthz",
            get_with(healthz, |op| {
                op.id("Health").summary("Liveness.").public().bare(200, "Alive.")
            }),
        )
        .api_route(
            "/readyz",
            get_with(readyz, |op| {
                op.id("Ready")
                    .summary("Readiness: the store answers; subscriptions' positions and lag; the NATS relay and inbound consumers with their lag and last error.")
                    .public()
                    .bare(200, "Ready.")
                    .bare(503, "The store does not answer.")
            }),
        )
        .api_route(
            "/openapi.json",
            get_with(openapi, |op| {
                op.id("OpenApi")
                    .summary("This document.")
                    .public()
                    .bare(200, "The OpenAPI document.")
            }),
        )
}

/// Every route of the API with its documentation: the one declaration the router and the
/// OpenAPI document are both built from (a route cannot be served undocumented).
pub struct Api {
    routes: Router<AppState>,
    document: OpenApi,
}

impl Api {
    /// The process's routes and the routes `declare` returns (every bounded context's,
    /// merged), declared with the document generator prepared.
    pub fn build(declare: impl FnOnce() -> ApiRouter<AppState>) -> Self {
        crate::openapi::prepare();
        let mut document = OpenApi::default();
        let routes = process_routes()
            .merge(declare())
            .finish_api_with(&mut document, crate::openapi::finish);
        Self { routes, document }
    }

    /// The OpenAPI document.
    pub fn document(&self) -> &OpenApi {
        &self.document
    }

    /// The document as served at `/openapi.json` and written to `schemas/openapi.json`.
    pub fn document_text(&self) -> String {
        crate::openapi::to_text(&self.document)
    }
}

/// The HTTP API of `api`, and the pages of `pages` (not part of the API's document), on
/// `state`.
pub fn router(state: AppState, api: Api, pages: Router<AppState>) -> Router {
    let document = Document(api.document_text().into());
    api.routes
        .merge(pages)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(Extension(document))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn(problem_errors))
        .layer(middleware::from_fn(request_ids))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

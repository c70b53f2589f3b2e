//! Events over HTTP, for users without NATS: `POST /factory/events` accepts the CloudEvents
//! Ferry reacts to (same validation, de-duplication and dead-lettering as the NATS
//! consumers), and `GET /factory/events/stream` serves the live event stream of the
//! caller's tenant as Server-Sent Events, from a position, resumable with `Last-Event-ID`.

use crate::auth::Caller;
use crate::problem::ApiError;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_messaging::inbound::AcceptError;
use std::collections::HashMap;

impl From<AcceptError> for ApiError {
    fn from(e: AcceptError) -> Self {
        match e {
            AcceptError::Malformed(reason) => ApiError::bad_field("body", reason),
            AcceptError::Forbidden(reason) => ApiError::Forbidden(reason),
            AcceptError::Rejected(reason) => ApiError::Rule {
                detail: reason,
                field: None,
            },
            AcceptError::InProgress(_) => ApiError::Conflict,
            AcceptError::Unavailable(reason) => ApiError::Unavailable(reason.into()),
        }
    }
}

/// `POST /factory/events`: one CloudEvent (structured JSON) from a service identity (scope
/// `factory.events.publish`, no human role). 202 when handled (or already handled:
/// `duplicate` is true).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn post_event(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    caller.require_event_publisher()?;
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    if !(content_type.starts_with("application/cloudevents+json")
        || content_type.starts_with("application/json"))
    {
        return Err(ApiError::UnsupportedMediaType);
    }
    let poster = ferry_messaging::inbound::Poster {
        tenant: caller.tenant.clone(),
        actor: caller.actor.clone(),
    };
    let accepted =
        ferry_messaging::inbound::accept_cloud_event(state.inbound(), &poster, &body).await?;
    tracing::info!(id = %accepted.id, event = %accepted.event, duplicate = accepted.duplicate, "event accepted");
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({"id": accepted.id, "event": accepted.event, "duplicate": accepted.duplicate})),
    )
        .into_response())
}

/// `GET /factory/events/stream[?after=<position>]`: Server-Sent Events, one per stored event
/// of the caller's tenant: `id` = the stream position (send it back as `Last-Event-ID`),
/// `event` = the subject, `data` = the CloudEvent.
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn event_stream(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    caller.require_read()?;
    if let Some(unknown) = query.keys().find(|k| k.as_str() != "after") {
        return Err(ApiError::bad_field(
            unknown,
            "unknown query parameter (allowed: after)",
        ));
    }
    let after = query.get("after").map(String::as_str);
    if let Some(a) = after {
        if ferry_messaging::parse_position(a).is_none() {
            return Err(ApiError::bad_field(
                "after",
                "not a stream position (use an event's id)",
            ));
        }
    }
    let last_event_id = headers.get("last-event-id").and_then(|v| v.to_str().ok());
    let from = ferry_messaging::start_position(last_event_id, after);
    let stream = ferry_messaging::sse_stream(
        state.db().clone(),
        caller.tenant.to_string(),
        from,
        state.db().subscribe_commits(),
    );
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

//! Events over HTTP, for users without NATS: `POST /factory/events` accepts the CloudEvents
//! Ferry reacts to (same validation, de-duplication and dead-lettering as the NATS
//! consumers), and `GET /factory/events/stream` serves the live event stream of the
//! caller's tenant as Server-Sent Events, from a position, resumable with `Last-Event-ID`.

use crate::auth::Caller;
use crate::ports::{IntakeError, Poster};
use crate::problem::ApiError;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::collections::HashMap;

impl From<IntakeError> for ApiError {
    fn from(e: IntakeError) -> Self {
        match e {
            IntakeError::Malformed(reason) => ApiError::bad_field("body", reason),
            IntakeError::Forbidden(reason) => ApiError::Forbidden(reason),
            IntakeError::Rejected(reason) => ApiError::Rule {
                detail: reason,
                field: None,
            },
            IntakeError::InProgress(_) => ApiError::Conflict,
            IntakeError::Unavailable(reason) => ApiError::Unavailable(reason.into()),
        }
    }
}

/// The body of `POST /factory/events`: one structured-mode CloudEvent, kept as the bytes
/// that were sent (inbound processing validates and de-duplicates them).
pub struct CloudEventBody(pub Bytes);

impl<S: Send + Sync> axum::extract::FromRequest<S> for CloudEventBody {
    // Axum's own answer (e.g. 413 past the body limit), as when the handler took `Bytes`.
    type Rejection = axum::extract::rejection::BytesRejection;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        <Bytes as axum::extract::FromRequest<S>>::from_request(req, state)
            .await
            .map(Self)
    }
}

impl aide::operation::OperationInput for CloudEventBody {
    fn operation_input(
        ctx: &mut aide::generate::GenContext,
        operation: &mut aide::openapi::Operation,
    ) {
        let schema = ctx
            .schema
            .subschema_for::<ferry_domain::cloudevent::CloudEvent>();
        crate::openapi::set_request_body(
            ctx,
            operation,
            "application/cloudevents+json",
            schema,
            true,
        );
    }
}

/// The answer to an accepted event.
#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
pub struct EventAccepted {
    /// The CloudEvent id.
    pub id: String,
    /// The event name (`ReleaseReady`, …).
    pub event: String,
    /// True when the id was handled before (nothing happened this time).
    pub duplicate: bool,
}

/// `POST /factory/events`: one CloudEvent (structured JSON) from a service identity (scope
/// `factory.events.publish`, no human role). 202 when handled (or already handled:
/// `duplicate` is true).
#[tracing::instrument(skip_all, fields(tenant = %caller.tenant))]
pub async fn post_event(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    CloudEventBody(body): CloudEventBody,
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
    let poster = Poster {
        tenant: caller.tenant.clone(),
        actor: caller.actor.clone(),
    };
    let accepted = state.intake().accept(&poster, &body).await?;
    tracing::info!(id = %accepted.id, event = %accepted.event, duplicate = accepted.duplicate, "event accepted");
    Ok((
        StatusCode::ACCEPTED,
        Json(EventAccepted {
            id: accepted.id,
            event: accepted.event,
            duplicate: accepted.duplicate,
        }),
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
        if !state.feed().is_position(a) {
            return Err(ApiError::bad_field(
                "after",
                "not a stream position (use an event's id)",
            ));
        }
    }
    let last_event_id = headers.get("last-event-id").and_then(|v| v.to_str().ok());
    let stream = state.feed().stream(&caller.tenant, last_event_id, after);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

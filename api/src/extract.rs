//! Request extractors that turn every malformed input into a problem with the field and
//! the reason: JSON bodies, the caller's token, and the request's ids.

use crate::auth::Caller;
use crate::problem::{ApiError, FieldError};
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use serde::de::DeserializeOwned;
use serde_json::Value;
use uuid::Uuid;

/// Largest accepted body.
pub const MAX_BODY: usize = 256 * 1024;

/// A JSON body, validated into `T`, with the raw document kept (for idempotency hashes).
pub struct ValidJson<T> {
    /// The typed body.
    pub value: T,
    /// The body as parsed JSON.
    pub raw: Value,
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
        .is_some_and(|v| v == "application/json" || v.ends_with("+json"))
}

/// Parses and validates a JSON body; `None` for an empty body when `optional`.
pub fn parse_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    bytes: &[u8],
    optional: bool,
) -> Result<Option<ValidJson<T>>, ApiError> {
    if optional && bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    if !is_json(headers) {
        return Err(ApiError::UnsupportedMediaType);
    }
    let raw: Value =
        serde_json::from_slice(bytes).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
    let value = serde_path_to_error::deserialize(raw.clone()).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        // serde reports a missing field at the parent; name the field itself.
        let field = match message
            .strip_prefix("missing field `")
            .and_then(|m| m.split('`').next())
        {
            Some(name) if path == "." => name.to_string(),
            Some(name) => format!("{path}.{name}"),
            None => match message
                .strip_prefix("unknown field `")
                .and_then(|m| m.split('`').next())
            {
                Some(name) if path == "." => name.to_string(),
                _ if path == "." => "body".to_string(),
                _ => path,
            },
        };
        ApiError::Unprocessable(vec![FieldError::new(field, message)])
    })?;
    Ok(Some(ValidJson { value, raw }))
}

impl<T: DeserializeOwned + Send> FromRequest<AppState> for ValidJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let headers = req.headers().clone();
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::bad_field("body", e.body_text()))?;
        parse_body(&headers, &bytes, false)?
            .ok_or_else(|| ApiError::invalid_field("body", "a JSON body is required"))
    }
}

/// A JSON body that may be absent.
pub struct OptionalJson<T>(pub Option<T>);

impl<T: DeserializeOwned + Send> FromRequest<AppState> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let headers = req.headers().clone();
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::bad_field("body", e.body_text()))?;
        Ok(Self(parse_body(&headers, &bytes, true)?.map(|v| v.value)))
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let value = parts
            .headers
            .get(header::AUTHORIZATION)
            .ok_or_else(|| ApiError::Unauthorized("a bearer token is required".to_string()))?;
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ApiError::Unauthorized(
                    "the Authorization header must be 'Bearer <token>'".to_string(),
                )
            })?;
        state.verifier().verify(token).await
    }
}

/// The ids of this request, for event metadata and logs.
#[derive(Debug, Clone, Copy)]
pub struct RequestIds {
    /// This request (`X-Request-Id` if the caller sent a UUID, else a new one).
    pub request_id: Uuid,
    /// The business operation (`X-Correlation-Id` if sent, else the request id).
    pub correlation_id: Uuid,
}

impl RequestIds {
    /// Reads or makes the ids from headers.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let uuid = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| Uuid::parse_str(v.trim()).ok())
        };
        let request_id = uuid("x-request-id").unwrap_or_else(Uuid::new_v4);
        Self {
            request_id,
            correlation_id: uuid("x-correlation-id").unwrap_or(request_id),
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for RequestIds {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<RequestIds>()
            .copied()
            .unwrap_or_else(|| RequestIds::from_headers(&parts.headers)))
    }
}

//! Request extractors that turn every malformed input into a problem with the field and
//! the reason: JSON bodies, the caller's token, and the request's ids.

use crate::auth::Caller;
use crate::problem::{ApiError, FieldError};
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_projections::queries::decode_cursor;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::HashMap;
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
    let StrictValue(raw) =
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

/// A JSON document in which no object repeats a key. serde_json keeps the last of
/// repeated keys, so `{"decision":"reject","decision":"approve"}` would read as one thing
/// to Ferry and as another to a proxy or log reader that keeps the first: such a body is
/// malformed.
struct StrictValue(Value);

impl<'de> serde::Deserialize<'de> for StrictValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let StrictValue(value) = map.next_value()?;
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format!(
                    "the key {key:?} appears twice in one object"
                )));
            }
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
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
        let token = bearer_token(parts.headers.get(header::AUTHORIZATION))?;
        state.verifier().verify(token).await
    }
}

/// The token of an `Authorization: Bearer <token>` value (an HTTP header, or the gRPC
/// `authorization` metadata, which is the same thing).
pub fn bearer_token(value: Option<&axum::http::HeaderValue>) -> Result<&str, ApiError> {
    bearer_token_text(value.map(|v| v.to_str()))
}

/// As [`bearer_token`], from the value as text (`Err` when it is not visible ASCII).
pub fn bearer_token_text<E>(value: Option<Result<&str, E>>) -> Result<&str, ApiError> {
    let value =
        value.ok_or_else(|| ApiError::Unauthorized("a bearer token is required".to_string()))?;
    value
        .ok()
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            ApiError::Unauthorized("the Authorization header must be 'Bearer <token>'".to_string())
        })
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
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        Self::from_values(text("x-request-id"), text("x-correlation-id"))
    }

    /// The ids a caller sent (used when they are UUIDs), else new ones: the request id, and
    /// the correlation id (the request id when absent).
    pub fn from_values(request: Option<&str>, correlation: Option<&str>) -> Self {
        let uuid = |v: Option<&str>| v.and_then(|v| Uuid::parse_str(v.trim()).ok());
        let request_id = uuid(request).unwrap_or_else(Uuid::new_v4);
        Self {
            request_id,
            correlation_id: uuid(correlation).unwrap_or(request_id),
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

/// Default page size.
const DEFAULT_LIMIT: u32 = 50;
/// Largest page size.
const MAX_LIMIT: u32 = 200;

/// Query parameters, refusing unknown ones so a typo is not silently ignored.
pub struct QueryParams(HashMap<String, String>);

impl QueryParams {
    /// The parameters, refusing any not in `allowed`.
    pub fn new(raw: HashMap<String, String>, allowed: &[&str]) -> Result<Self, ApiError> {
        if let Some(unknown) = raw.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(ApiError::bad_field(
                unknown,
                format!("unknown query parameter (allowed: {})", allowed.join(", ")),
            ));
        }
        Ok(Self(raw))
    }

    /// Parameter `name` parsed by `parse`; a value that does not parse is a 400 naming it.
    pub fn parse<T>(
        &self,
        name: &str,
        parse: impl Fn(&str) -> Option<T>,
        expected: &str,
    ) -> Result<Option<T>, ApiError> {
        match self.0.get(name) {
            None => Ok(None),
            Some(v) => parse(v)
                .map(Some)
                .ok_or_else(|| ApiError::bad_field(name, format!("{v:?} is not {expected}"))),
        }
    }

    /// `limit` (1 to 200, default 50) and `cursor`.
    pub fn page(&self) -> Result<(u32, Option<i64>), ApiError> {
        let limit = self
            .parse(
                "limit",
                |v| {
                    v.parse::<u32>()
                        .ok()
                        .filter(|n| (1..=MAX_LIMIT).contains(n))
                },
                "a number from 1 to 200",
            )?
            .unwrap_or(DEFAULT_LIMIT);
        let cursor = match self.0.get("cursor") {
            None => None,
            Some(c) => Some(decode_cursor(c).map_err(|e| ApiError::bad_field("cursor", e))?),
        };
        Ok((limit, cursor))
    }
}

/// An enum value from its serialized name (e.g. a `state` query parameter).
pub fn enum_from_str<T: serde::de::DeserializeOwned>(v: &str) -> Option<T> {
    serde_json::from_value(serde_json::Value::String(v.to_string())).ok()
}

/// The `Idempotency-Key` header, if sent (1 to 255 visible ASCII characters).
pub fn idempotency_key(
    headers: &HeaderMap,
) -> Result<Option<crate::idempotent::IdempotencyKey>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let raw = value.to_str().map_err(|_| {
        ApiError::bad_field(
            "Idempotency-Key",
            "must be 1 to 255 visible ASCII characters",
        )
    })?;
    crate::idempotent::IdempotencyKey::parse("Idempotency-Key", raw).map(Some)
}

/// 201 with `body` and `Location: location`.
pub fn created<T: serde::Serialize>(location: &str, body: &T) -> Response {
    let mut response = (StatusCode::CREATED, Json(body)).into_response();
    if let Ok(v) = HeaderValue::from_str(location) {
        response.headers_mut().insert(header::LOCATION, v);
    }
    response
}

/// A request carrying an `Idempotency-Key`, about to create `resource_id`.
pub struct IdempotentRequest<'a> {
    /// The key.
    pub key: &'a str,
    /// The operation (a key is bound to one).
    pub operation: &'a str,
    /// The body as parsed (a key is bound to one body).
    pub body: &'a Value,
    /// The resource this request creates when the key is fresh (name-based on the key).
    pub resource_id: &'a str,
    /// This request (only it may give the key back).
    pub owner: &'a str,
}

/// What a reserved `Idempotency-Key` says to do.
#[derive(Debug)]
pub enum Reservation {
    /// Go on, creating this resource: the one the request named when the key is fresh, else
    /// the one the first request with the key recorded (it has not answered: it is still
    /// running or it crashed). The recorded id wins because it is what the first request
    /// created, whatever names the version that made it derived ids from (issue 37 changed
    /// them; a retry across the upgrade must land on the same run or promotion).
    Proceed(String),
    /// The first request's stored answer, to replay.
    Replay {
        /// The resource it created.
        resource_id: String,
        /// Its answer's body.
        body: Value,
    },
}

impl IdempotentRequest<'_> {
    /// Reserves the key. [`Reservation::Replay`] is the first request's stored answer;
    /// [`Reservation::Proceed`] means go on with the resource id it names, and the same
    /// command on the same resource id is refused by its aggregate if it already took
    /// effect. The same key with another body or operation is a 422.
    pub async fn reserve(
        &self,
        db: &ferry_store::Database,
        tenant: &str,
    ) -> Result<Reservation, ApiError> {
        use sha2::Digest;
        let hash = hex::encode(sha2::Sha256::digest(self.body.to_string().as_bytes()));
        match ferry_store::idempotency::reserve(
            db,
            tenant,
            self.key,
            self.operation,
            &hash,
            self.resource_id,
            self.owner,
        )
        .await?
        {
            ferry_store::idempotency::KeyState::Fresh => {
                Ok(Reservation::Proceed(self.resource_id.to_string()))
            }
            ferry_store::idempotency::KeyState::Replay {
                resource_id,
                response: None,
            } => Ok(Reservation::Proceed(resource_id)),
            ferry_store::idempotency::KeyState::Replay {
                resource_id,
                response: Some((_, body)),
            } => Ok(Reservation::Replay { resource_id, body }),
            ferry_store::idempotency::KeyState::Mismatch => {
                Err(ApiError::IdempotencyMismatch(self.key.to_string()))
            }
        }
    }
}

/// The HTTP answer to a creating use case: 201 with the resource and
/// `Location: {location_prefix}{id}`, marked `Idempotent-Replayed: true` when it is the first
/// request's answer again.
pub fn created_answer<V: serde::Serialize>(
    location_prefix: &str,
    created: &crate::idempotent::Created<V>,
) -> Response {
    let location = format!("{location_prefix}{}", created.id());
    match created {
        crate::idempotent::Created::New { view, .. } => self::created(&location, view),
        crate::idempotent::Created::Replayed { answer, .. } => {
            let mut response = self::created(&location, answer);
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h
    }

    #[test]
    fn a_key_repeated_in_one_object_is_malformed_at_any_depth() {
        let parse = |body: &str| parse_body::<Value>(&json_headers(), body.as_bytes(), false);
        for body in [
            r#"{"decision":"reject","decision":"approve"}"#,
            r#"{"a":{"b":1,"b":2}}"#,
            r#"[{"x":[{"k":1,"k":1}]}]"#,
        ] {
            match parse(body) {
                Err(ApiError::MalformedJson(m)) => assert!(m.contains("twice"), "{m}"),
                other => panic!("{body}: {:?}", other.map(|v| v.map(|v| v.raw))),
            }
        }
        let fine = parse(r#"{"a":{"b":1},"b":[1,2.5,"x",null,true,{"b":1}]}"#)
            .unwrap()
            .unwrap();
        assert_eq!(fine.raw["b"][1], 2.5);
        assert_eq!(fine.raw["a"]["b"], 1);
        // The depth limit still holds.
        assert!(matches!(
            parse(&format!("{}{}", "[".repeat(10_000), "]".repeat(10_000))),
            Err(ApiError::MalformedJson(_))
        ));
    }
}

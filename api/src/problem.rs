//! RFC 9457 problem+json errors. Every error variant maps to one status on purpose:
//! validation → 400/422, missing or bad token → 401, missing scope or role → 403, unknown
//! resource → 404, wrong state and domain conflicts → 409, concurrent change → 409 with
//! `Retry-After`, store down → 503, anything unexpected → 500 with details logged only.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use ferry_domain::run::RunError;
use ferry_domain::specification::SpecificationError;
use ferry_store::CommandError;
use serde::Serialize;

/// One field that was refused, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct FieldError {
    /// JSON path of the field in the body (`configRefs.db`), or the query/header name.
    pub field: String,
    /// Why it was refused.
    pub reason: String,
}

impl FieldError {
    /// A field error.
    pub fn new(field: impl Into<String>, reason: impl ToString) -> Self {
        Self {
            field: field.into(),
            reason: reason.to_string(),
        }
    }
}

/// The problem document (RFC 9457) with Ferry's extension members.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Problem {
    /// A URI naming the kind of problem (`urn:ferry:problem:<slug>`).
    #[serde(rename = "type")]
    pub problem_type: String,
    /// Short summary of the kind.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What went wrong this time.
    pub detail: String,
    /// The fields that were refused, for validation problems (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldError>,
    /// Seconds after which a retry may succeed, for conflicts and unavailability.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u32>,
}

/// Every way a request can fail.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON at all.
    #[error("malformed JSON: {0}")]
    MalformedJson(String),
    /// The body is not `application/json`.
    #[error("expected Content-Type: application/json")]
    UnsupportedMediaType,
    /// A query parameter, path segment or header is malformed.
    #[error("invalid request")]
    BadRequest(Vec<FieldError>),
    /// The body is JSON but a field is missing or refused.
    #[error("invalid body")]
    Unprocessable(Vec<FieldError>),
    /// No token, or a token that does not verify.
    #[error("{0}")]
    Unauthorized(String),
    /// The token lacks a scope or role, or the caller may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// No such resource for this tenant.
    #[error("{0}")]
    NotFound(String),
    /// The resource is in a state that does not allow this.
    #[error("{0}")]
    WrongState(String),
    /// Someone else changed the resource at the same time.
    #[error("the resource was changed concurrently; retry the request")]
    Conflict,
    /// The path exists but not with this method.
    #[error("method not allowed on this path")]
    MethodNotAllowed,
    /// A domain rule refused the request.
    #[error("{detail}")]
    Rule {
        /// What the rule says.
        detail: String,
        /// The field involved, if any.
        field: Option<String>,
    },
    /// The same Idempotency-Key with another request.
    #[error("Idempotency-Key {0:?} was already used for a different request")]
    IdempotencyMismatch(String),
    /// The store is unreachable (the cause is logged, not returned).
    #[error("the event store is unavailable")]
    Unavailable(#[source] ferry_store::BoxError),
    /// A bug or an unexpected failure; the cause is logged, not returned.
    #[error("internal error")]
    Internal(#[source] ferry_store::BoxError),
}

/// A 422 naming each refused reference of a declaration and the rule that refused it.
pub fn refused_references(refused: Vec<ferry_domain::confinement::FieldRefusal>) -> ApiError {
    tracing::info!(fields = ?refused.iter().map(|r| r.field.as_str()).collect::<Vec<_>>(), "references refused");
    ApiError::Unprocessable(
        refused
            .into_iter()
            .map(|r| FieldError::new(r.field, r.refusal))
            .collect(),
    )
}

impl ApiError {
    /// A 400 for one field.
    pub fn bad_field(field: &str, reason: impl ToString) -> Self {
        Self::BadRequest(vec![FieldError::new(field, reason)])
    }

    /// A 422 for one field.
    pub fn invalid_field(field: &str, reason: impl ToString) -> Self {
        Self::Unprocessable(vec![FieldError::new(field, reason)])
    }

    /// A text field a command refused (a name, reason or link a console could not render
    /// faithfully): 422 naming the field.
    pub fn invalid_text(invalid: ferry_domain::text::InvalidText) -> Self {
        Self::invalid_field(&invalid.field, invalid.problem)
    }

    /// Wraps an unexpected error (logged with its causes when answered).
    pub fn internal(error: impl Into<ferry_store::BoxError>) -> Self {
        Self::Internal(error.into())
    }

    fn parts(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            Self::MalformedJson(_) => (StatusCode::BAD_REQUEST, "malformed-json", "Malformed JSON"),
            Self::UnsupportedMediaType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported-media-type",
                "Unsupported media type",
            ),
            Self::BadRequest(_) => (
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid request",
            ),
            Self::Unprocessable(_) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "validation-failed",
                "Validation failed",
            ),
            Self::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"),
            Self::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden", "Forbidden"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not-found", "Not found"),
            Self::WrongState(_) => (StatusCode::CONFLICT, "wrong-state", "Wrong state"),
            Self::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
            ),
            Self::Conflict => (
                StatusCode::CONFLICT,
                "concurrent-modification",
                "Concurrent modification",
            ),
            Self::Rule { .. } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "rule-violated",
                "Rule violated",
            ),
            Self::IdempotencyMismatch(_) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency key reused",
            ),
            Self::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "Service unavailable",
            ),
            Self::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal-error",
                "Internal error",
            ),
        }
    }

    /// The problem document.
    pub fn problem(&self) -> Problem {
        let (status, slug, title) = self.parts();
        let errors = match self {
            Self::BadRequest(e) | Self::Unprocessable(e) => e.clone(),
            Self::Rule {
                field: Some(f),
                detail,
            } => vec![FieldError::new(f.clone(), detail)],
            _ => vec![],
        };
        let detail = match self {
            Self::BadRequest(e) | Self::Unprocessable(e) => e
                .iter()
                .map(|e| format!("{}: {}", e.field, e.reason))
                .collect::<Vec<_>>()
                .join("; "),
            Self::Internal(_) => "an unexpected error occurred; it has been logged".to_string(),
            Self::Unavailable(_) => "the event store is unavailable; retry shortly".to_string(),
            other => other.to_string(),
        };
        let retry_after_seconds = match self {
            Self::Conflict => Some(1),
            Self::Unavailable(_) => Some(5),
            _ => None,
        };
        Problem {
            problem_type: format!("urn:ferry:problem:{slug}"),
            title: title.to_string(),
            status: status.as_u16(),
            detail,
            errors,
            retry_after_seconds,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match &self {
            Self::Internal(cause) => {
                tracing::error!(error = %ferry_store::error_chain(cause.as_ref()), "internal error")
            }
            Self::Unavailable(cause) => {
                tracing::warn!(error = %ferry_store::error_chain(cause.as_ref()), "store unavailable")
            }
            _ => tracing::debug!(error = %self, "request refused"),
        }
        let problem = self.problem();
        let status =
            StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(&problem)).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = problem.retry_after_seconds {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if matches!(self, Self::Unauthorized(_)) {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"ferry\""),
            );
        }
        response
    }
}

impl From<RunError> for ApiError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::NotRequested => Self::NotFound("no such provisioning run".to_string()),
            RunError::AlreadyRequested
            | RunError::InvalidTransition { .. }
            | RunError::PlanReceiptAlreadyRecorded
            | RunError::ApplyReceiptAlreadyRecorded
            | RunError::ApprovalRequired(_)
            | RunError::NotInSync
            | RunError::PolicyDenied(_) => Self::WrongState(e.to_string()),
            RunError::ApproverIsRequester(_) | RunError::PromotionApprovalRequired(_) => {
                Self::Forbidden(e.to_string())
            }
            RunError::ReceiptResultMismatch { .. } => Self::Rule {
                detail: e.to_string(),
                field: None,
            },
            RunError::ReasonRequired => Self::Rule {
                detail: e.to_string(),
                field: Some("reason".to_string()),
            },
            RunError::UnverifiedPromotionApproval => Self::Rule {
                detail: e.to_string(),
                field: Some("approvalId".to_string()),
            },
            RunError::PromotionApprovalMismatch(_) => Self::Rule {
                detail: e.to_string(),
                field: None,
            },
            RunError::InvalidText(invalid) => Self::invalid_text(invalid),
        }
    }
}

impl From<SpecificationError> for ApiError {
    fn from(e: SpecificationError) -> Self {
        match e {
            SpecificationError::ProjectMismatch { .. } => Self::Rule {
                detail: e.to_string(),
                field: Some("projectId".to_string()),
            },
            SpecificationError::IdentityMismatch(_) => Self::WrongState(e.to_string()),
            SpecificationError::InvalidText(invalid) => Self::invalid_text(invalid),
        }
    }
}

impl From<ferry_domain::environment::EnvironmentError> for ApiError {
    fn from(e: ferry_domain::environment::EnvironmentError) -> Self {
        match e {
            ferry_domain::environment::EnvironmentError::NotRegistered => {
                Self::NotFound(e.to_string())
            }
            ferry_domain::environment::EnvironmentError::IdentityMismatch
            | ferry_domain::environment::EnvironmentError::NoPendingLowering => {
                Self::WrongState(e.to_string())
            }
            ferry_domain::environment::EnvironmentError::LoweringApprovedByItsRequester(_) => {
                Self::Forbidden(e.to_string())
            }
            ferry_domain::environment::EnvironmentError::InvalidText(invalid) => {
                Self::invalid_text(invalid)
            }
        }
    }
}

impl<E> From<CommandError<E>> for ApiError
where
    E: std::error::Error + Into<ApiError>,
{
    fn from(e: CommandError<E>) -> Self {
        Self::from_command(e, Into::into)
    }
}

impl ApiError {
    /// A command's error, its domain refusal mapped by `refusal`: for aggregates of a
    /// bounded context whose error types this crate does not know.
    pub fn from_command<E: std::error::Error>(
        e: CommandError<E>,
        refusal: impl FnOnce(E) -> ApiError,
    ) -> Self {
        match e {
            CommandError::Domain(d) => refusal(d),
            CommandError::NotFound => Self::NotFound("no such resource".to_string()),
            // The record, or one the command was decided on, changed: retry.
            CommandError::Conflict | CommandError::Moved => Self::Conflict,
            CommandError::Unavailable(cause) => Self::Unavailable(cause),
            CommandError::Store(cause) => Self::Internal(cause),
        }
    }
}

impl From<ferry_projections::queries::QueryError> for ApiError {
    fn from(e: ferry_projections::queries::QueryError) -> Self {
        let unavailable = matches!(&e, ferry_projections::queries::QueryError::Sql(sql)
            if ferry_store::is_unavailable(sql));
        if unavailable {
            Self::Unavailable(Box::new(e))
        } else {
            Self::Internal(Box::new(e))
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if ferry_store::is_unavailable(&e) {
            Self::Unavailable(Box::new(e))
        } else {
            Self::Internal(Box::new(e))
        }
    }
}

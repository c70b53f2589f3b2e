//! Ferry's internal gRPC interface (`proto/`): `ferry.provisioning.v1.Provisioning` and
//! `ferry.delivery.v1.Promotions`, beside the standard health service (`grpc.health.v1`) and
//! server reflection, so `grpcurl` works against it. Served on `FERRY_GRPC_ADDR`.
//!
//! Each method translates its message to the use case its HTTP route calls, with the same
//! token check (the bearer token in the `authorization` metadata); the use case applies the
//! scopes and roles, takes the tenant from the token, and for `Promotions.Request` runs the
//! gates and the idempotency keys. Errors are the use cases' refusals mapped one to one
//! ([`status`]).

use crate::contexts::promotions::use_cases::{self, RequestPromotionRequest};
use crate::contexts::provisioning::views::ProvisioningReads;
use ferry_api::auth::Caller;
use ferry_api::extract::{bearer_token_text, RequestIds};
use ferry_api::idempotent::{IdempotencyKey, Keyed};
use ferry_api::problem::{ApiError, FieldError};
use ferry_api::state::AppState;
use ferry_domain::promotion::{Hotfix, Strategy};
use ferry_domain::{EnvironmentId, SpecificationKind};
use ferry_domain::{FactoryRunId, ReceiptRef, ReleaseId};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tonic::metadata::MetadataMap;
use tonic::{Code, Request, Response, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The code generated from `proto/` (by `build.rs`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    /// `ferry.provisioning.v1`.
    pub mod provisioning {
        tonic::include_proto!("ferry.provisioning.v1");
    }
    /// `ferry.delivery.v1`.
    pub mod delivery {
        tonic::include_proto!("ferry.delivery.v1");
    }
    /// Every message and service, encoded, for server reflection.
    pub const DESCRIPTORS: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/ferry_descriptors.bin"));
}

use pb::delivery::promotions_server::{Promotions, PromotionsServer};
use pb::provisioning::provisioning_server::{Provisioning, ProvisioningServer};

/// Calls and their latency, by method and status code (as the HTTP side counts its work).
#[derive(Clone)]
pub struct GrpcMetrics {
    calls: IntCounterVec,
    seconds: HistogramVec,
}

impl GrpcMetrics {
    /// The families, registered in the process's registry.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let calls = IntCounterVec::new(
            Opts::new(
                "ferry_grpc_requests_total",
                "gRPC calls by method and status code.",
            ),
            &["method", "code"],
        )?;
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "ferry_grpc_request_duration_seconds",
                "gRPC call latency by method.",
            ),
            &["method"],
        )?;
        registry.register(Box::new(calls.clone()))?;
        registry.register(Box::new(seconds.clone()))?;
        Ok(Self { calls, seconds })
    }

    fn observe<T>(&self, method: &str, started: Instant, result: &Result<T, Status>) {
        let code = match result {
            Ok(_) => Code::Ok,
            Err(status) => status.code(),
        };
        self.calls
            .with_label_values(&[method, &format!("{code:?}")])
            .inc();
        self.seconds
            .with_label_values(&[method])
            .observe(started.elapsed().as_secs_f64());
    }
}

/// `lowerCamel` → `lower_camel`: a field of the HTTP body named as in the proto message.
fn proto_field(field: &str) -> String {
    let mut out = String::with_capacity(field.len() + 4);
    for c in field.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

fn invalid(message: &str, fields: &[FieldError]) -> Status {
    let mut details = ErrorDetails::new();
    for f in fields {
        details.add_bad_request_violation(proto_field(&f.field), f.reason.clone());
    }
    let summary = fields
        .iter()
        .map(|f| format!("{}: {}", proto_field(&f.field), f.reason))
        .collect::<Vec<_>>()
        .join("; ");
    Status::with_error_details(
        Code::InvalidArgument,
        format!("{message}: {summary}"),
        details,
    )
}

/// The status of each HTTP problem: validation → INVALID_ARGUMENT with field violations; no
/// or a bad token → UNAUTHENTICATED; a missing scope or role → PERMISSION_DENIED; unknown to
/// this tenant → NOT_FOUND; a wrong state or a rule without a field → FAILED_PRECONDITION; a
/// reused idempotency key → ALREADY_EXISTS; a concurrent change → ABORTED with retry advice;
/// the store away → UNAVAILABLE; anything else → INTERNAL, the cause logged, not returned.
pub fn status(e: ApiError) -> Status {
    match e {
        ApiError::MalformedJson(reason) => {
            invalid("invalid request", &[FieldError::new("body", reason)])
        }
        ApiError::UnsupportedMediaType => Status::invalid_argument(e.to_string()),
        ApiError::BadRequest(fields) | ApiError::Unprocessable(fields) => {
            invalid("invalid request", &fields)
        }
        ApiError::Rule {
            detail,
            field: Some(field),
        } => invalid(&detail, &[FieldError::new(field, detail.clone())]),
        ApiError::Rule {
            detail,
            field: None,
        } => Status::failed_precondition(detail),
        ApiError::Unauthorized(m) => Status::unauthenticated(m),
        ApiError::Forbidden(m) => Status::permission_denied(m),
        ApiError::NotFound(m) => Status::not_found(m),
        ApiError::WrongState(m) => Status::failed_precondition(m),
        ApiError::MethodNotAllowed => Status::unimplemented(e.to_string()),
        ApiError::IdempotencyMismatch(_) => Status::already_exists(e.to_string()),
        ApiError::Conflict => Status::with_error_details(
            Code::Aborted,
            e.to_string(),
            ErrorDetails::with_retry_info(Some(Duration::from_secs(1))),
        ),
        ApiError::Unavailable(ref cause) => {
            tracing::warn!(error = %cause, "store unavailable");
            Status::with_error_details(
                Code::Unavailable,
                e.to_string(),
                ErrorDetails::with_retry_info(Some(Duration::from_secs(5))),
            )
        }
        ApiError::Internal(ref cause) => {
            tracing::error!(error = ?cause, "internal error answering a gRPC call");
            Status::internal("internal error")
        }
    }
}

/// The verified caller of a call, from its metadata: the bearer token in `authorization`.
async fn caller(state: &AppState, metadata: &MetadataMap) -> Result<Caller, Status> {
    let token =
        bearer_token_text(metadata.get("authorization").map(|v| v.to_str())).map_err(status)?;
    state.verifier().verify(token).await.map_err(status)
}

/// The ids of a call, for event metadata and logs: `x-request-id` and `x-correlation-id`
/// when sent as UUIDs, as over HTTP.
fn request_ids(metadata: &MetadataMap) -> RequestIds {
    let text = |name: &str| metadata.get(name).and_then(|v| v.to_str().ok());
    RequestIds::from_values(text("x-request-id"), text("x-correlation-id"))
}

/// A field of a message as the value type the use case takes; an empty string is absent.
fn optional<T, E: std::fmt::Display>(
    field: &str,
    raw: String,
    parse: impl FnOnce(String) -> Result<T, E>,
) -> Result<Option<T>, Status> {
    if raw.is_empty() {
        return Ok(None);
    }
    parse(raw)
        .map(Some)
        .map_err(|e| status(ApiError::invalid_field(field, e)))
}

fn timestamp(at: chrono::DateTime<chrono::Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: at.timestamp(),
        nanos: i32::try_from(at.timestamp_subsec_nanos()).unwrap_or(0),
    }
}

/// `ferry.provisioning.v1.Provisioning`.
pub struct ProvisioningService {
    state: AppState,
    metrics: GrpcMetrics,
}

impl ProvisioningService {
    async fn current(
        &self,
        request: Request<pb::provisioning::GetCurrentSpecificationRequest>,
    ) -> Result<pb::provisioning::GetCurrentSpecificationResponse, Status> {
        let caller = caller(&self.state, request.metadata()).await?;
        caller.require_read().map_err(status)?;
        let request = request.into_inner();
        let environment = EnvironmentId::parse(request.environment_id)
            .map_err(|e| status(ApiError::bad_field("environmentId", e)))?;
        let kind = match request.kind.as_str() {
            "" => None,
            "Environment" => Some(SpecificationKind::Environment),
            "Workload" => Some(SpecificationKind::Workload),
            _ => {
                return Err(status(ApiError::bad_field(
                    "kind",
                    "must be Environment or Workload",
                )))
            }
        };
        let view = self
            .state
            .reads()
            .current_specification(&caller.tenant, &environment)
            .await
            .map_err(|e| status(e.into()))?
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no specification declared for environment {environment}"
                ))
            })?;
        let specifications: Vec<_> = view
            .specifications
            .into_iter()
            .filter(|s| kind.is_none_or(|k| s.kind == k))
            .map(|s| pb::provisioning::EnvironmentSpecification {
                kind: s.kind.as_str().to_string(),
                specification_id: s.specification_id.to_string(),
                latest: Some(pb::provisioning::SpecificationVersion {
                    version: s.latest.version,
                    project_id: s.latest.project_id.to_string(),
                    program_ref: s.latest.program_ref.to_string(),
                    program_version: s.latest.program_version.to_string(),
                    release_id: s
                        .latest
                        .release_id
                        .map(|r| r.to_string())
                        .unwrap_or_default(),
                    strategy: s.latest.strategy.map(|r| r.to_string()).unwrap_or_default(),
                    declared_by: s.latest.declared_by.to_string(),
                    declared_at: Some(timestamp(s.latest.declared_at)),
                }),
                applied: s.applied.map(|a| pb::provisioning::AppliedSpecification {
                    version: a.version,
                    provisioning_run_id: a.provisioning_run_id.to_string(),
                    applied_at: Some(timestamp(a.applied_at)),
                }),
            })
            .collect();
        if specifications.is_empty() {
            return Err(Status::not_found(format!(
                "no {} specification declared for environment {environment}",
                request.kind
            )));
        }
        Ok(pb::provisioning::GetCurrentSpecificationResponse {
            environment_id: environment.to_string(),
            specifications,
        })
    }
}

#[tonic::async_trait]
impl Provisioning for ProvisioningService {
    #[tracing::instrument(skip_all, fields(rpc = "Provisioning.GetCurrentSpecification"))]
    async fn get_current_specification(
        &self,
        request: Request<pb::provisioning::GetCurrentSpecificationRequest>,
    ) -> Result<Response<pb::provisioning::GetCurrentSpecificationResponse>, Status> {
        let started = Instant::now();
        let result = self.current(request).await;
        self.metrics
            .observe("Provisioning.GetCurrentSpecification", started, &result);
        result.map(Response::new)
    }
}

/// `ferry.delivery.v1.Promotions`.
pub struct PromotionsService {
    state: AppState,
    metrics: GrpcMetrics,
}

impl PromotionsService {
    async fn request_promotion(
        &self,
        request: Request<pb::delivery::RequestPromotionRequest>,
    ) -> Result<pb::delivery::Promotion, Status> {
        let caller = caller(&self.state, request.metadata()).await?;
        let ids = request_ids(request.metadata());
        let request = request.into_inner();
        let key = match request.idempotency_key.as_str() {
            "" => None,
            raw => Some(IdempotencyKey::parse("idempotencyKey", raw).map_err(status)?),
        };
        let body = RequestPromotionRequest {
            release_id: ReleaseId::parse(&request.release_id)
                .map_err(|e| status(ApiError::invalid_field("releaseId", e)))?,
            environment_id: EnvironmentId::parse(request.environment_id)
                .map_err(|e| status(ApiError::invalid_field("environmentId", e)))?,
            strategy: optional("strategy", request.strategy, |s| {
                serde_json::from_value::<Strategy>(serde_json::Value::String(s))
            })?
            .unwrap_or_default(),
            run_id: optional("runId", request.run_id, |r| FactoryRunId::parse(&r))?,
            hotfix: request.hotfix.map(|h| Hotfix { reason: h.reason }),
            receipt_ref: optional("receiptRef", request.receipt_ref, ReceiptRef::parse)?,
        };
        // The key is bound to the request as the HTTP body it stands for (absent fields left
        // out), so that a key works alike over both.
        let sent = serde_json::to_value(&body).map_err(|e| status(ApiError::internal(e)))?;
        let keyed = key.as_ref().map(|key| Keyed {
            key,
            request: &sent,
        });
        let view = use_cases::request(&self.state, &caller, ids, body, keyed)
            .await
            .map_err(status)?
            .into_view()
            .map_err(status)?;
        Ok(pb::delivery::Promotion {
            promotion_id: view.promotion_id.to_string(),
            tenant_id: view.tenant_id.to_string(),
            project_id: view.project_id.to_string(),
            release_id: view.release_id.to_string(),
            environment_id: view.environment_id.to_string(),
            environment_class: view.environment_class.as_str().to_string(),
            strategy: view.strategy.as_str().to_string(),
            run_id: view.run_id.map(|r| r.to_string()).unwrap_or_default(),
            receipt_ref: view
                .receipt_ref
                .map(|r| r.as_str().to_string())
                .unwrap_or_default(),
            hotfix_reason: view.hotfix.map(|h| h.reason).unwrap_or_default(),
            previous_release_id: view
                .previous_release_id
                .map(|r| r.to_string())
                .unwrap_or_default(),
            state: view.state.as_str().to_string(),
            requested_by: view.requested_by.to_string(),
            requested_at: Some(timestamp(view.requested_at)),
        })
    }
}

#[tonic::async_trait]
impl Promotions for PromotionsService {
    #[tracing::instrument(skip_all, fields(rpc = "Promotions.Request"))]
    async fn request(
        &self,
        request: Request<pb::delivery::RequestPromotionRequest>,
    ) -> Result<Response<pb::delivery::Promotion>, Status> {
        let started = Instant::now();
        let result = self.request_promotion(request).await;
        self.metrics.observe("Promotions.Request", started, &result);
        result.map(Response::new)
    }
}

/// Why the gRPC server could not start.
#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    /// The address is taken or not ours.
    #[error("cannot listen on {addr} (FERRY_GRPC_ADDR): {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The reflection service could not read the descriptors (a build problem).
    #[error("gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// Serves the interface on `addr` until `stop` turns true; the address it listens on and
/// the server's task.
pub async fn serve(
    state: AppState,
    metrics: GrpcMetrics,
    addr: SocketAddr,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<
    (
        SocketAddr,
        tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    ),
    GrpcError,
> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| GrpcError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| GrpcError::Bind { addr, source })?;
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<ProvisioningServer<ProvisioningService>>()
        .await;
    health
        .set_serving::<PromotionsServer<PromotionsService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::DESCRIPTORS)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    // Older clients (Python's grpcio reflection, older grpcurl) still ask v1alpha.
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::DESCRIPTORS)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let router = tonic::transport::Server::builder()
        .layer(tower_http::trace::TraceLayer::new_for_grpc())
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(ProvisioningServer::new(ProvisioningService {
            state: state.clone(),
            metrics: metrics.clone(),
        }))
        .add_service(PromotionsServer::new(PromotionsService { state, metrics }));
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let handle = tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await
    });
    tracing::info!(addr = %local, "gRPC is serving");
    Ok((local, handle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_field_names_become_proto_field_names() {
        assert_eq!(proto_field("releaseId"), "release_id");
        assert_eq!(proto_field("hotfix.reason"), "hotfix.reason");
        assert_eq!(proto_field("body"), "body");
    }

    #[test]
    fn each_problem_has_its_status() {
        let cases = [
            (
                ApiError::bad_field("releaseId", "bad"),
                Code::InvalidArgument,
            ),
            (
                ApiError::invalid_field("hotfix.reason", "bad"),
                Code::InvalidArgument,
            ),
            (ApiError::Unauthorized("no".into()), Code::Unauthenticated),
            (ApiError::Forbidden("no".into()), Code::PermissionDenied),
            (ApiError::NotFound("no".into()), Code::NotFound),
            (ApiError::WrongState("no".into()), Code::FailedPrecondition),
            (ApiError::Conflict, Code::Aborted),
            (
                ApiError::IdempotencyMismatch("k".into()),
                Code::AlreadyExists,
            ),
            (ApiError::Unavailable("down".into()), Code::Unavailable),
            (ApiError::internal("bug with a secret"), Code::Internal),
        ];
        for (error, code) in cases {
            let s = status(error);
            assert_eq!(s.code(), code, "{s:?}");
            assert!(!s.message().contains("secret"));
        }
        let s = status(ApiError::bad_field("releaseId", "not a UUID"));
        let details = s.get_error_details();
        let violations = &details.bad_request().unwrap().field_violations;
        assert_eq!(violations[0].field, "release_id");
        let s = status(ApiError::Conflict);
        assert!(s.get_error_details().retry_info().is_some());
    }
}

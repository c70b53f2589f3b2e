//! The OpenAPI 3.1 document, generated with `aide` from the route declarations
//! ([`crate::router::Api`]): a route is declared together with its documentation (`get_with`,
//! `post_with`), request bodies come from the handlers' extractor types and responses from
//! the view types (schemars), so the document and the router cannot drift apart. It is
//! served at `/openapi.json` and written to `schemas/openapi.json` by `ferry schemas`.

use crate::auth::Caller;
use crate::extract::{OptionalJson, RequestIds, ValidJson};
use crate::problem::{ApiError, Problem};
use aide::generate::GenContext;
use aide::openapi::{
    MediaType, OpenApi, Operation, Parameter, ReferenceOr, RequestBody, SchemaObject, StatusCode,
};
use aide::operation::{set_body, OperationInput, OperationOutput};
use aide::transform::{TransformOpenApi, TransformOperation};
use schemars::generate::SchemaSettings;
use schemars::JsonSchema;
use serde_json::{json, Value};

/// The bearer scheme every protected operation names.
const BEARER: &str = "bearer";
/// Read scope.
pub const READ: &str = "factory.provisioning.read";
/// Apply scope.
pub const APPLY: &str = "factory.provisioning.apply";
/// Event-publishing scope (service identities).
pub const PUBLISH: &str = "factory.events.publish";

// The caller and the request ids are not part of the contract's shape: the bearer
// requirement is named per operation, and request ids are optional headers.
impl OperationInput for Caller {}
impl OperationInput for RequestIds {}

/// Documents the request body: `schema` as `content_type`.
pub fn set_request_body(
    ctx: &mut GenContext,
    operation: &mut Operation,
    content_type: &str,
    schema: schemars::Schema,
    required: bool,
) {
    let body = RequestBody {
        required,
        content: [(
            content_type.to_string(),
            MediaType {
                schema: Some(SchemaObject {
                    json_schema: schema,
                    example: None,
                    external_docs: None,
                }),
                ..MediaType::default()
            },
        )]
        .into_iter()
        .collect(),
        ..RequestBody::default()
    };
    set_body(ctx, operation, body);
}

impl<T: JsonSchema> OperationInput for ValidJson<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        let schema = ctx.schema.subschema_for::<T>();
        set_request_body(ctx, operation, "application/json", schema, true);
    }
}

impl<T: JsonSchema> OperationInput for OptionalJson<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        let schema = ctx.schema.subschema_for::<T>();
        set_request_body(ctx, operation, "application/json", schema, false);
    }
}

// Error responses are named per operation (`errors`), as shared components.
impl OperationOutput for ApiError {
    type Inner = ();
}

/// Documentation helpers for the route declarations.
pub trait Doc<'t>: Sized {
    /// Needs a bearer token with `scope`.
    fn scope(self, scope: &str) -> Self;
    /// Needs no token.
    fn public(self) -> Self;
    /// The shared error responses this operation can answer with (e.g. `[400, 401]`).
    fn errors(self, codes: &[u16]) -> Self;
    /// A query parameter (never required).
    fn query(self, name: &str, description: &str, schema: Value) -> Self;
    /// A path parameter.
    fn path(self, name: &str, description: &str, schema: Value) -> Self;
    /// The `Idempotency-Key` header.
    fn idempotency_key(self) -> Self;
    /// `limit` and `cursor`.
    fn paging(self) -> Self;
    /// A success response whose body is `content_type` text.
    fn text(self, status: u16, description: &str, content_type: &str) -> Self;
    /// A response without a documented body.
    fn bare(self, status: u16, description: &str) -> Self;
}

fn parameter(value: Value) -> Parameter {
    // The literals below are fixed; a test renders the document, so a bad one fails there.
    serde_json::from_value(value).unwrap_or_else(|e| panic!("bad OpenAPI parameter: {e}"))
}

fn set_response(
    operation: &mut Operation,
    status: u16,
    response: ReferenceOr<aide::openapi::Response>,
) {
    operation
        .responses
        .get_or_insert_with(Default::default)
        .responses
        .insert(StatusCode::Code(status), response);
}

impl<'t> Doc<'t> for TransformOperation<'t> {
    fn scope(self, scope: &str) -> Self {
        self.security_requirement_scopes(BEARER, [scope])
    }

    fn public(mut self) -> Self {
        self.inner_mut().security = Vec::new();
        self
    }

    fn errors(mut self, codes: &[u16]) -> Self {
        for code in codes {
            set_response(
                self.inner_mut(),
                *code,
                ReferenceOr::Reference {
                    reference: format!("#/components/responses/{code}"),
                    description: None,
                    summary: None,
                },
            );
        }
        self
    }

    fn query(mut self, name: &str, description: &str, schema: Value) -> Self {
        let p = parameter(
            json!({"name": name, "in": "query", "required": false, "description": description, "schema": schema}),
        );
        self.inner_mut().parameters.push(ReferenceOr::Item(p));
        self
    }

    fn path(mut self, name: &str, description: &str, schema: Value) -> Self {
        let p = parameter(
            json!({"name": name, "in": "path", "required": true, "description": description, "schema": schema}),
        );
        self.inner_mut().parameters.push(ReferenceOr::Item(p));
        self
    }

    fn idempotency_key(mut self) -> Self {
        let p = parameter(json!({
            "name": "Idempotency-Key", "in": "header", "required": false,
            "description": "A retry with the same key and body returns the first response; the same key with another body is refused (422).",
            "schema": {"type": "string", "maxLength": 255}
        }));
        self.inner_mut().parameters.push(ReferenceOr::Item(p));
        self
    }

    fn paging(self) -> Self {
        self.query(
            "limit",
            "Page size, 1 to 200 (default 50).",
            json!({"type": "integer", "minimum": 1, "maximum": 200}),
        )
        .query(
            "cursor",
            "The `nextCursor` of the previous page.",
            json!({"type": "string"}),
        )
    }

    fn text(mut self, status: u16, description: &str, content_type: &str) -> Self {
        let response = serde_json::from_value(json!({
            "description": description,
            "content": {content_type: {"schema": {"type": "string"}}}
        }))
        .unwrap_or_else(|e| panic!("bad OpenAPI response: {e}"));
        set_response(self.inner_mut(), status, ReferenceOr::Item(response));
        self
    }

    fn bare(mut self, status: u16, description: &str) -> Self {
        let response = aide::openapi::Response {
            description: description.to_string(),
            ..Default::default()
        };
        set_response(self.inner_mut(), status, ReferenceOr::Item(response));
        self
    }
}

/// The schema of `T` as a JSON value, in the document's generator (for parameters).
pub fn schema_of<T: JsonSchema>() -> Value {
    aide::generate::in_context(|ctx| ctx.schema.subschema_for::<T>().to_value())
}

/// Makes the generator write JSON Schema 2020-12 into `components/schemas`, and not guess
/// responses: each operation names its own. Called before the routes are declared.
pub fn prepare() {
    aide::generate::infer_responses(false);
    aide::generate::extract_schemas(true);
    aide::generate::in_context(|ctx| {
        ctx.schema = SchemaSettings::draft2020_12()
            .with(|s| {
                s.definitions_path = "#/components/schemas".into();
                s.inline_subschemas = false;
            })
            .into_generator();
    });
    aide::generate::on_error(|error| tracing::warn!(%error, "OpenAPI generation"));
}

fn problem_response(description: &str) -> ReferenceOr<aide::openapi::Response> {
    ReferenceOr::Item(
        serde_json::from_value(json!({
            "description": description,
            "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
        }))
        .unwrap_or_else(|e| panic!("bad OpenAPI response: {e}")),
    )
}

/// The document-level parts: info, the bearer scheme, the shared error responses.
pub fn finish(api: TransformOpenApi<'_>) -> TransformOpenApi<'_> {
    let mut api = api
        .title("Ferry")
        .version(env!("CARGO_PKG_VERSION"))
        .description("Delivery and provisioning control plane: desired-state specifications and provisioning runs that plan before they apply. Errors are RFC 9457 problem+json.");
    aide::generate::in_context(|ctx| {
        ctx.schema.subschema_for::<Problem>();
    });
    let inner = api.inner_mut();
    inner
        .components
        .get_or_insert_with(Default::default)
        .security_schemes
        .insert(
        BEARER.to_string(),
        ReferenceOr::Item(
            serde_json::from_value(json!({"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
                "description": "JWT with claims sub, tenant, scope (space-separated) and roles (Operator, PlatformAdmin, Observer)."}))
            .unwrap_or_else(|e| panic!("bad OpenAPI security scheme: {e}")),
        ),
    );
    // Whatever takes a path parameter or a body can be refused as malformed before anything
    // else (a path segment that is not UTF-8, a body that is not JSON or is past the limit).
    if let Some(paths) = inner.paths.as_mut() {
        for item in paths.paths.values_mut() {
            let ReferenceOr::Item(item) = item else {
                continue;
            };
            for operation in [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ]
            .into_iter()
            .flatten()
            {
                let takes_path = operation
                    .parameters
                    .iter()
                    .any(|p| matches!(p, ReferenceOr::Item(aide::openapi::Parameter::Path { .. })));
                let documented = operation
                    .responses
                    .as_ref()
                    .is_some_and(|r| r.responses.contains_key(&StatusCode::Code(400)));
                if (takes_path || operation.request_body.is_some()) && !documented {
                    set_response(
                        operation,
                        400,
                        ReferenceOr::Reference {
                            reference: "#/components/responses/400".to_string(),
                            description: None,
                            summary: None,
                        },
                    );
                }
            }
        }
    }
    let components = inner.components.get_or_insert_with(Default::default);
    for (code, description) in [
        ("400", "Malformed JSON, path parameter, query parameter or header, or a body past the limit."),
        ("401", "No bearer token, or one that does not verify."),
        ("403", "The token lacks the scope or role, or the caller may not do this (e.g. approve their own run)."),
        ("404", "No such resource for this tenant."),
        ("409", "Wrong state, or a concurrent change (retry after Retry-After)."),
        ("415", "The body is not application/json."),
        ("422", "A field is missing or refused, a referenced record does not exist, or an Idempotency-Key was reused with another body."),
    ] {
        components
            .responses
            .insert(code.to_string(), problem_response(description));
    }
    api
}

/// The document as text: pretty JSON ending in a newline (aide writes `"openapi": "3.1.0"`).
pub fn to_text(document: &OpenApi) -> String {
    // Through a `Value`, whose keys are sorted, so the text does not depend on field order.
    let value = serde_json::to_value(document).unwrap_or_default();
    let mut text = serde_json::to_string_pretty(&value).unwrap_or_default();
    text.push('\n');
    text
}

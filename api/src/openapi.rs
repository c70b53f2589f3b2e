//! The OpenAPI 3.1 document, built from the same types the handlers use (schemars), served
//! at `/openapi.json` and written to `schemas/openapi.json` by `ferry schemas`.

use crate::problem::Problem;
use crate::routes::{
    ApprovalRequest, CancelRequest, DeclareSpecificationRequest, PlanProvisioningRequest,
};
use ferry_domain::specification::SpecificationVersion;
use ferry_projections::views::CurrentSpecificationView;
use ferry_projections::{Page, RunView};
use schemars::generate::SchemaSettings;
use serde_json::{json, Map, Value};

fn problem_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    })
}

fn ok(description: &str, schema: Value) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": schema}}})
}

fn body(schema: Value, required: bool) -> Value {
    json!({"required": required, "content": {"application/json": {"schema": schema}}})
}

fn errors(codes: &[&str]) -> Map<String, Value> {
    codes
        .iter()
        .map(|c| {
            (
                c.to_string(),
                json!({"$ref": format!("#/components/responses/{c}")}),
            )
        })
        .collect()
}

fn responses(success: (&str, Value), codes: &[&str]) -> Value {
    let mut map = errors(codes);
    map.insert(success.0.to_string(), success.1);
    Value::Object(map)
}

fn query(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "query", "required": false, "description": description, "schema": schema})
}

fn path(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "path", "required": true, "description": description, "schema": schema})
}

/// The OpenAPI document.
pub fn document() -> Value {
    let mut generator = SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = "#/components/schemas".into())
        .into_generator();
    let mut schema =
        |f: fn(&mut schemars::SchemaGenerator) -> schemars::Schema| f(&mut generator).to_value();
    let declare = schema(|g| g.subschema_for::<DeclareSpecificationRequest>());
    let plan = schema(|g| g.subschema_for::<PlanProvisioningRequest>());
    let cancel = schema(|g| g.subschema_for::<CancelRequest>());
    let approval = schema(|g| g.subschema_for::<ApprovalRequest>());
    let version = schema(|g| g.subschema_for::<SpecificationVersion>());
    let run = schema(|g| g.subschema_for::<RunView>());
    let spec_page = schema(|g| g.subschema_for::<Page<SpecificationVersion>>());
    let run_page = schema(|g| g.subschema_for::<Page<RunView>>());
    let current = schema(|g| g.subschema_for::<CurrentSpecificationView>());
    let cloud_event = schema(|g| g.subschema_for::<ferry_messaging::CloudEvent>());
    let put_env = schema(|g| g.subschema_for::<crate::environments::PutEnvironmentRequest>());
    let env_view = schema(|g| g.subschema_for::<crate::environments::EnvironmentView>());
    let kind = schema(|g| g.subschema_for::<ferry_domain::SpecificationKind>());
    let run_kind = schema(|g| g.subschema_for::<ferry_domain::ProvisioningKind>());
    let state = schema(|g| g.subschema_for::<ferry_domain::ProvisioningState>());
    schema(|g| g.subschema_for::<Problem>());
    let schemas = generator.take_definitions(true);

    let paging = [
        query(
            "limit",
            "Page size, 1 to 200 (default 50).",
            json!({"type": "integer", "minimum": 1, "maximum": 200}),
        ),
        query(
            "cursor",
            "The `nextCursor` of the previous page.",
            json!({"type": "string"}),
        ),
    ];
    let read = json!([{"bearer": ["factory.provisioning.read"]}]);
    let apply = json!([{"bearer": ["factory.provisioning.apply"]}]);
    let publish = json!([{"bearer": ["factory.events.publish"]}]);
    let run_id = path(
        "provisioningRunId",
        "The run.",
        json!({"type": "string", "format": "uuid"}),
    );
    let idempotency = json!({
        "name": "Idempotency-Key", "in": "header", "required": false,
        "description": "A retry with the same key and body returns the first response; the same key with another body is refused (422).",
        "schema": {"type": "string", "maxLength": 255}
    });

    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Ferry",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Delivery and provisioning control plane: desired-state specifications and provisioning runs that plan before they apply. Errors are RFC 9457 problem+json."
        },
        "paths": {
            "/factory/provisioning/specifications": {
                "get": {
                    "operationId": "ListSpecifications",
                    "summary": "Every declared specification version, newest first.",
                    "security": read,
                    "parameters": [
                        query("environmentId", "Only this environment.", json!({"type": "string"})),
                        query("projectId", "Only this project.", json!({"type": "string"})),
                        query("kind", "Only this kind.", kind),
                        query("specificationId", "Only this specification's versions.", json!({"type": "string", "format": "uuid"})),
                        paging[0], paging[1]
                    ],
                    "responses": responses(("200", ok("A page of versions.", spec_page)), &["400", "401", "403"])
                },
                "post": {
                    "operationId": "DeclareSpecification",
                    "summary": "Declare a new immutable version of an environment's desired state.",
                    "security": apply,
                    "requestBody": body(declare, true),
                    "responses": responses(("201", ok("The new version.", version)), &["400", "401", "403", "409", "415", "422"])
                }
            },
            "/factory/provisioning/runs": {
                "get": {
                    "operationId": "ListProvisioningRuns",
                    "summary": "Runs by environment, kind and state, with receipts, newest first.",
                    "security": read,
                    "parameters": [
                        query("environmentId", "Only this environment.", json!({"type": "string"})),
                        query("kind", "Only this kind.", run_kind),
                        query("state", "Only this state.", state),
                        paging[0], paging[1]
                    ],
                    "responses": responses(("200", ok("A page of runs.", run_page)), &["400", "401", "403"])
                },
                "post": {
                    "operationId": "PlanProvisioning",
                    "summary": "Plan a specification version against an environment; the run starts in Requested.",
                    "security": apply,
                    "parameters": [idempotency],
                    "requestBody": body(plan, true),
                    "responses": responses(("201", ok("The run.", run.clone())), &["400", "401", "403", "409", "415", "422"])
                }
            },
            "/factory/provisioning/runs/{provisioningRunId}": {
                "get": {
                    "operationId": "GetProvisioningRun",
                    "summary": "One run with its plan, approval, apply receipt and logs.",
                    "security": read,
                    "parameters": [run_id.clone()],
                    "responses": responses(("200", ok("The run.", run.clone())), &["401", "403", "404"])
                }
            },
            "/factory/provisioning/runs/{provisioningRunId}/cancel": {
                "post": {
                    "operationId": "CancelProvisioning",
                    "summary": "Cancel a run before apply.",
                    "security": apply,
                    "parameters": [run_id.clone()],
                    "requestBody": body(cancel, false),
                    "responses": responses(("200", ok("The cancelled run.", run.clone())), &["401", "403", "404", "409", "415", "422"])
                }
            },
            "/factory/provisioning/runs/{provisioningRunId}/approval": {
                "post": {
                    "operationId": "DecideApproval",
                    "summary": "Approve or reject a run awaiting approval; the requester cannot approve.",
                    "security": apply,
                    "parameters": [run_id],
                    "requestBody": body(approval, true),
                    "responses": responses(("200", ok("The run after the decision.", run)), &["401", "403", "404", "409", "415", "422"])
                }
            },
            "/factory/provisioning/environments/{environmentId}/current-specification": {
                "get": {
                    "operationId": "GetCurrentSpecification",
                    "summary": "The newest declared and the last applied specification of each kind for an environment.",
                    "security": read,
                    "parameters": [path("environmentId", "The environment.", json!({"type": "string"}))],
                    "responses": responses(("200", ok("The environment's specifications.", current)), &["400", "401", "403", "404"])
                }
            },
            "/factory/provisioning/runs/{provisioningRunId}/logs": {
                "get": {
                    "operationId": "GetProvisioningRunLogs",
                    "summary": "The run's plan and apply logs as text (secrets redacted before storage).",
                    "security": read,
                    "parameters": [path("provisioningRunId", "The run.", json!({"type": "string", "format": "uuid"}))],
                    "responses": responses(("200", json!({"description": "The logs.", "content": {"text/plain": {"schema": {"type": "string"}}}})), &["401", "403", "404"])
                }
            },
            "/factory/environments/{environmentId}": {
                "put": {
                    "operationId": "PutEnvironment",
                    "summary": "Record an environment (PlatformAdmin); a new one gets its baseline declared and planned.",
                    "security": apply,
                    "parameters": [path("environmentId", "The environment.", json!({"type": "string"}))],
                    "requestBody": body(put_env, true),
                    "responses": responses(("200", ok("Updated or unchanged (201 when recorded for the first time).", env_view.clone())), &["400", "401", "403", "409", "415", "422"])
                },
                "get": {
                    "operationId": "GetEnvironment",
                    "summary": "An environment as Ferry knows it.",
                    "security": read,
                    "parameters": [path("environmentId", "The environment.", json!({"type": "string"}))],
                    "responses": responses(("200", ok("The environment.", env_view)), &["400", "401", "403", "404"])
                }
            },
            "/factory/events": {
                "post": {
                    "operationId": "PostEvent",
                    "summary": "Accept one CloudEvent Ferry reacts to (EnvironmentCreated, EnvironmentStateChanged, ApprovalDecided, …), for users without NATS. Only service identities (scope factory.events.publish, no human role) may post, from a source FERRY_TRUSTED_SOURCES trusts for the event. Redelivery of the same source and id has no second effect; a malformed event is dead-lettered.",
                    "security": publish,
                    "requestBody": {"required": true, "content": {"application/cloudevents+json": {"schema": cloud_event}}},
                    "responses": responses(("202", json!({"description": "Handled (`duplicate` true when it was already).", "content": {"application/json": {"schema": {"type": "object", "properties": {"id": {"type": "string"}, "event": {"type": "string"}, "duplicate": {"type": "boolean"}}}}}})), &["400", "401", "403", "409", "415", "422"])
                }
            },
            "/factory/events/stream": {
                "get": {
                    "operationId": "EventStream",
                    "summary": "The tenant's events as Server-Sent Events (id = stream position, event = subject, data = CloudEvent); resume with Last-Event-ID or ?after=.",
                    "security": read,
                    "parameters": [query("after", "Start after this stream position (an event's id).", json!({"type": "string"}))],
                    "responses": responses(("200", json!({"description": "text/event-stream", "content": {"text/event-stream": {"schema": {"type": "string"}}}})), &["400", "401", "403"])
                }
            },
            "/metrics": {"get": {"operationId": "Metrics", "summary": "Prometheus metrics.", "security": [], "responses": {"200": {"description": "Prometheus text exposition.", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/healthz": {"get": {"operationId": "Health", "summary": "Liveness.", "security": [], "responses": {"200": {"description": "Alive."}}}},
            "/readyz": {"get": {"operationId": "Ready", "summary": "Readiness: the store answers; subscriptions' positions and lag; the NATS relay and inbound consumers with their lag and last error.", "security": [], "responses": {"200": {"description": "Ready."}, "503": {"description": "The store does not answer."}}}},
            "/openapi.json": {"get": {"operationId": "OpenApi", "summary": "This document.", "security": [], "responses": {"200": {"description": "The OpenAPI document."}}}}
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
                    "description": "JWT with claims sub, tenant, scope (space-separated) and roles (Operator, PlatformAdmin, Observer)."}
            },
            "responses": {
                "400": problem_response("Malformed JSON, query parameter or header."),
                "401": problem_response("No bearer token, or one that does not verify."),
                "403": problem_response("The token lacks the scope or role, or the caller may not do this (e.g. approve their own run)."),
                "404": problem_response("No such resource for this tenant."),
                "409": problem_response("Wrong state, or a concurrent change (retry after Retry-After)."),
                "415": problem_response("The body is not application/json."),
                "422": problem_response("A field is missing or refused, a referenced record does not exist, or an Idempotency-Key was reused with another body.")
            },
            "schemas": schemas
        }
    })
}

/// The document as written to `schemas/openapi.json`.
pub fn document_text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).unwrap_or_default();
    text.push('\n');
    text
}

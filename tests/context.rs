//! A bounded context added in one file: a counter aggregate with its command route, its
//! read model, its published events, an event of another service it hears, and their
//! documentation, registered through [`BoundedContext`] and nothing else. It shows what
//! ARCHITECTURE.md's "Adding an aggregate" promises: the process serves the route and
//! documents it, projects the events, publishes them to NATS, consumes the event it hears
//! over NATS and HTTP (once per message), and refuses another tenant, without a line of
//! Ferry's own crates naming it.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod common;

use aide::axum::routing::post_with;
use aide::axum::ApiRouter;
use axum::extract::{Path, State};
use axum::Json;
use common::*;
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, DomainEvent};
use ferry_api::auth::Caller;
use ferry_api::extract::{RequestIds, ValidJson};
use ferry_api::openapi::{Doc, APPLY, READ};
use ferry_api::problem::ApiError;
use ferry_api::state::AppState;
use ferry_app::inbound::{classify, execute_marked, ContextInbound, InboundParts};
use ferry_app::{BoundedContext, Contexts, Server};
use ferry_domain::{EventType, StoredAggregate, TenantId, TenantOwned};
use ferry_messaging::inbound::{Handled, InboundEnvelope, InboundError, InboundEvent, InboundKind};
use ferry_messaging::testing::Nats;
use ferry_messaging::{DomainEvents, Publishers};
use ferry_projections::projection::TableNames;
use ferry_projections::{Projection, TableSpec};
use ferry_store::database::Backend;
use ferry_store::stream::{HandlerError, Param, Tx};
use ferry_store::testing::{eventually_showing, TestDatabase};
use ferry_store::{Subscriber, Subscription, Typed};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

// ---- the aggregate (in Ferry: `domain/src/<aggregate>.rs`) ----

/// A per-tenant counter.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Counter {
    tenant: Option<TenantId>,
    total: u64,
}

#[derive(Debug, Clone)]
enum CounterCommand {
    Add { tenant: TenantId, by: u64 },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
enum CounterEvent {
    /// The counter went up.
    #[serde(rename = "CounterAdded", rename_all = "camelCase")]
    Added {
        tenant_id: TenantId,
        by: u64,
        total: u64,
    },
}

impl CounterEvent {
    fn stored_type(&self) -> EventType {
        match self {
            Self::Added { .. } => EventType::first("CounterAdded"),
        }
    }
}

impl DomainEvent for CounterEvent {
    fn event_type(&self) -> String {
        self.stored_type().name.to_string()
    }
    fn event_version(&self) -> String {
        self.stored_type().version.to_string()
    }
}

#[derive(Debug, thiserror::Error)]
enum CounterError {
    #[error("a counter goes up by at least 1")]
    Zero,
}

impl From<CounterError> for ApiError {
    fn from(e: CounterError) -> Self {
        ApiError::Rule {
            detail: e.to_string(),
            field: Some("by".to_string()),
        }
    }
}

impl Aggregate for Counter {
    const TYPE: &'static str = "Counter";
    type Command = CounterCommand;
    type Event = CounterEvent;
    type Error = CounterError;
    type Services = ();

    async fn handle(
        &mut self,
        command: CounterCommand,
        _: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), CounterError> {
        let CounterCommand::Add { tenant, by } = command;
        if by == 0 {
            return Err(CounterError::Zero);
        }
        let total = self.total + by;
        sink.write(
            CounterEvent::Added {
                tenant_id: tenant,
                by,
                total,
            },
            self,
        )
        .await;
        Ok(())
    }

    fn apply(&mut self, event: CounterEvent) {
        let CounterEvent::Added {
            tenant_id, total, ..
        } = event;
        self.tenant = Some(tenant_id);
        self.total = total;
    }
}

impl TenantOwned for Counter {
    fn tenant(&self) -> Option<&TenantId> {
        self.tenant.as_ref()
    }
}

impl StoredAggregate for Counter {}

// ---- the context (in Ferry: `app/src/contexts/<context>.rs`) ----

#[derive(Debug, Deserialize, JsonSchema)]
struct AddRequest {
    /// How much to add (at least 1).
    by: u64,
}

#[derive(Debug, Serialize, Deserialize, JsonSchema)]
struct CounterView {
    total: u64,
}

async fn add(
    State(state): State<AppState>,
    caller: Caller,
    ids: RequestIds,
    Path(id): Path<String>,
    ValidJson { value: body, .. }: ValidJson<AddRequest>,
) -> Result<Json<CounterView>, ApiError> {
    caller.require_apply()?;
    let metadata = caller.metadata(ids);
    let command = CounterCommand::Add {
        tenant: caller.tenant.clone(),
        by: body.by,
    };
    let done = state
        .repository::<Counter>()
        .execute(&caller.tenant, &id, command, &metadata, true)
        .await?;
    let total = done.aggregate.total;
    // Read your writes: answer once the read model shows the new total.
    state
        .reads()
        .wait_until(
            state.read_your_writes(),
            &["test-counters"],
            done.position,
            || async { Ok(read_total(&state, &caller.tenant, &id).await? >= Some(total)) },
        )
        .await?;
    Ok(Json(CounterView { total }))
}

async fn read_total(
    state: &AppState,
    tenant: &TenantId,
    id: &str,
) -> Result<Option<u64>, ferry_projections::queries::QueryError> {
    let sql = state
        .db()
        .sql("SELECT total FROM rm_test_counters WHERE tenant_id = $1 AND counter_id = $2");
    let total: Option<i64> = ferry_store::on_pool!(state.db(), pool =>
        sqlx::query_scalar(&sql).bind(tenant.as_str()).bind(id).fetch_optional(pool).await?);
    Ok(total.map(|t| t as u64))
}

async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<CounterView>, ApiError> {
    caller.require_read()?;
    match read_total(&state, &caller.tenant, &id).await? {
        Some(total) => Ok(Json(CounterView { total })),
        None => Err(ApiError::NotFound(format!("no counter {id}"))),
    }
}

struct CountersProjection;

const COUNTER_TABLES: &[TableSpec] = &[TableSpec {
    base: "rm_test_counters",
    ddl: &["CREATE TABLE IF NOT EXISTS {t} (
        tenant_id text NOT NULL, counter_id text NOT NULL, total bigint NOT NULL,
        PRIMARY KEY (tenant_id, counter_id))"],
}];

impl Projection for CountersProjection {
    fn name(&self) -> &'static str {
        "test-counters"
    }
    fn tables(&self) -> &'static [TableSpec] {
        COUNTER_TABLES
    }
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription {
        subscription.on::<Counter>(CounterRows(tables.clone()))
    }
}

struct CounterRows(TableNames);

#[async_trait::async_trait]
impl Subscriber<Counter> for CounterRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<CounterEvent>) -> Result<(), HandlerError> {
        let CounterEvent::Added {
            tenant_id, total, ..
        } = &event.event;
        let table = self.0.get("rm_test_counters");
        let sql = format!(
            "INSERT INTO {table} (tenant_id, counter_id, total) VALUES ($1, $2, $3)
             ON CONFLICT (tenant_id, counter_id) DO UPDATE SET total = excluded.total"
        );
        tx.execute(
            &sql,
            &[
                Param::Text(Some(tenant_id.to_string())),
                Param::Text(Some(event.aggregate_id.clone())),
                Param::Int(Some(*total as i64)),
            ],
        )
        .await?;
        Ok(())
    }
}

/// `counters.v1.bump-requested`: another service asks for a counter to go up.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
struct BumpRequested {
    tenant_id: TenantId,
    counter_id: String,
    by: u64,
}

impl InboundEvent for BumpRequested {
    const NAME: &'static str = "BumpRequested";
    const SUBJECT: &'static str = "counters.v1.bump-requested";
    const SUMMARY: &'static str = "Another service asks for a counter to go up.";
    fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }
}

/// What the context does with the events it hears.
struct CountersInbound {
    counters: ferry_store::Repository<Counter>,
}

#[async_trait::async_trait]
impl ContextInbound for CountersInbound {
    async fn handle(&self, envelope: &InboundEnvelope) -> Result<Handled, InboundError> {
        let Some(bump) = envelope.event.get::<BumpRequested>() else {
            return Ok(Handled::NothingToDo);
        };
        let command = CounterCommand::Add {
            tenant: envelope.tenant_id.clone(),
            by: bump.by,
        };
        // The effect commits with the message's "handled" mark.
        execute_marked(&self.counters, envelope, &bump.counter_id, command, true)
            .await
            .map_err(classify)?;
        Ok(Handled::Recorded)
    }
}

/// The whole registration.
struct Counters;

impl BoundedContext for Counters {
    fn name(&self) -> &'static str {
        "counters"
    }

    fn register_aggregates(&self) {
        ferry_store::events::register::<Counter>();
    }

    fn routes(&self) -> ApiRouter<AppState> {
        ApiRouter::new().api_route(
            "/tests/counters/{counterId}",
            post_with(add, |op| {
                op.id("AddToCounter")
                    .summary("Add to a counter.")
                    .scope(APPLY)
                    .path("counterId", "The counter.", json!({"type": "string"}))
                    .response_with::<200, Json<CounterView>, _>(|r| r.description("The new total."))
                    .errors(&[400, 401, 403, 422])
            })
            .get_with(get, |op| {
                op.id("GetCounter")
                    .summary("A counter's total.")
                    .scope(READ)
                    .path("counterId", "The counter.", json!({"type": "string"}))
                    .response_with::<200, Json<CounterView>, _>(|r| r.description("The total."))
                    .errors(&[401, 403, 404])
            }),
        )
    }

    fn projections(&self) -> Vec<Arc<dyn Projection>> {
        vec![Arc::new(CountersProjection)]
    }

    fn publishers(&self) -> Publishers {
        Publishers::new().with(Arc::new(DomainEvents::<Counter>::new()))
    }

    fn inbound_events(&self) -> Vec<InboundKind> {
        vec![InboundKind::of::<BumpRequested>()]
    }

    fn inbound(&self, parts: &InboundParts) -> Option<Arc<dyn ContextInbound>> {
        Some(Arc::new(CountersInbound {
            counters: ferry_store::Repository::new(parts.db.clone(), ()),
        }))
    }
}

// ---- the test ----

#[tokio::test]
async fn a_context_registered_in_one_place_is_served_documented_projected_and_published() {
    let nats = Nats::start().await;
    let data = tempfile::tempdir().unwrap();
    let db = TestDatabase::new(Backend::Postgres).await;
    let mut config = config(data.path());
    config.database_url = Some(db.location.clone());
    config.nats_url = Some(nats.url());
    let server = Server::start_with_contexts(
        &config,
        db.db.clone(),
        Contexts::builtin().with(Arc::new(Counters)),
    )
    .await
    .unwrap();
    let s = TestServer {
        base: format!("http://{}", server.addr),
        server: Some(server),
        db: Some(db),
        client: reqwest::Client::new(),
        data_dir: data,
    };
    let alice = operator("acme", "alice");

    // Served, through the shared auth, validation and problem mapping.
    let (status, body) = s
        .post(&alice, "/tests/counters/c-1", &json!({"by": 2}))
        .await;
    assert_eq!((status, body["total"].clone()), (200, json!(2)), "{body}");
    let (status, body) = s
        .post(&alice, "/tests/counters/c-1", &json!({"by": 3}))
        .await;
    assert_eq!((status, body["total"].clone()), (200, json!(5)), "{body}");
    let (status, body) = s
        .post(&alice, "/tests/counters/c-1", &json!({"by": 0}))
        .await;
    assert_eq!(status, 422, "{body}");
    let (status, _) = s
        .post(
            &operator("globex", "mallory"),
            "/tests/counters/c-1",
            &json!({"by": 1}),
        )
        .await;
    assert_ne!(status, 200, "another tenant's counter is not reachable");

    // Projected: the read model answers right after the command.
    let (status, body) = s.get(&alice, "/tests/counters/c-1").await;
    assert_eq!((status, body), (200, json!({"total": 5})));
    let (status, _) = s
        .get(&operator("globex", "mallory"), "/tests/counters/c-1")
        .await;
    assert_eq!(status, 404);

    // Documented: the served document has the route, with its operations.
    let (status, doc) = s.get("", "/openapi.json").await;
    assert_eq!(status, 200);
    let path = &doc["paths"]["/tests/counters/{counterId}"];
    assert_eq!(path["post"]["operationId"], "AddToCounter", "{path}");
    assert_eq!(path["get"]["operationId"], "GetCounter", "{path}");
    // And Ferry's own routes are still there.
    assert!(doc["paths"]["/factory/provisioning/runs"].is_object());

    // Published: the events reach JetStream on their domain subject.
    let client = async_nats::connect(&nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let js = &js;
    let stream = eventually_showing("the relay's stream", 15, || async move {
        js.get_stream("FERRY_EVENTS")
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let stream = &stream;
    // The relay publishes in the background: wait for the second addition, not just any.
    let event = eventually_showing("the second counter-added message", 15, || async move {
        let message = stream
            .get_last_raw_message_by_subject("ferry.events.counter.counter-added")
            .await
            .map_err(|e| e.to_string())?;
        let event: Value = serde_json::from_slice(&message.payload).map_err(|e| e.to_string())?;
        if event["data"]["total"] == 5 {
            Ok(event)
        } else {
            Err(event.to_string())
        }
    })
    .await;
    assert_eq!(
        event["data"],
        json!({"tenantId": "acme", "by": 3, "total": 5})
    );
    assert_eq!(event["tenantid"], "acme");

    // Heard over HTTP: a service's event goes to the context's handler, once per message.
    let bump = |id: &str, by: u64| {
        json!({"specversion": "1.0", "id": id, "source": "urn:counter-service",
               "type": "BumpRequested", "tenantid": "acme",
               "data": {"tenantId": "acme", "counterId": "c-1", "by": by}})
    };
    let (status, body) = s
        .post_event(&service("acme", "svc"), &bump("b-1", 10))
        .await;
    assert_eq!(
        (status, body["event"].clone()),
        (202, json!("BumpRequested")),
        "{body}"
    );
    let (status, body) = s
        .post_event(&service("acme", "svc"), &bump("b-1", 10))
        .await;
    assert_eq!(
        (status, body["duplicate"].clone()),
        (202, json!(true)),
        "{body}"
    );
    let total_reaches = |total: u64| {
        let (server, reader) = (&s, &alice);
        eventually_showing("the counter's read model", 15, move || async move {
            let (_, body) = server.get(reader, "/tests/counters/c-1").await;
            (body["total"] == total)
                .then_some(())
                .ok_or(body.to_string())
        })
    };
    total_reaches(15).await;
    // A payload that breaks the event's types is refused with the field.
    let mut bad = bump("b-2", 1);
    bad["data"]["by"] = json!("many");
    let (status, body) = s.post_event(&service("acme", "svc"), &bad).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("BumpRequested payload is invalid"),
        "{body}"
    );

    // Heard over NATS: Ferry consumes the subject the context declared.
    let mut over_nats = bump("b-3", 5);
    over_nats["type"] = json!("counters.v1.bump-requested");
    let over_nats = &over_nats;
    // The consumers set up the stream storing the subject as they start: publish once it is.
    eventually_showing("the subject stored by a stream", 15, || async move {
        let ack = js
            .publish("counters.v1.bump-requested", over_nats.to_string().into())
            .await
            .map_err(|e| e.to_string())?;
        ack.await.map_err(|e| e.to_string())
    })
    .await;
    total_reaches(20).await;

    // Documented among the events Ferry consumes.
    let files = Contexts::builtin()
        .with(Arc::new(Counters))
        .published_schemas()
        .unwrap();
    assert!(files
        .iter()
        .any(|(path, _)| path == "events/inbound/bump-requested.schema.json"));

    // Known to every reader of the stream, so Ferry's own subscriptions pass over it.
    assert!(ferry_store::events::is_known("Counter"));
    tokio::time::timeout(Duration::from_secs(10), s.stop())
        .await
        .unwrap();
}

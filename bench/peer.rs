//! The peer of `bench/run.sh` (figure h): what a team would build instead of Ferry, plain
//! cqrs-es 0.5 with postgres-es, wired as the library's demo wires it (`postgres_cqrs`,
//! one `GenericQuery` view per aggregate over a `PostgresViewRepository`, queries dispatched
//! in process after the commit), running the same command mix as `bench/load.rs` in process
//! (no HTTP, no authentication, no idempotency, no global stream): declare a specification
//! version, request a plan, cancel it, request a promotion.
//!
//! ```sh
//! cargo run --release --example peer -- postgres://postgres@127.0.0.1:5432/peer 32 20
//! ```
//!
//! It creates its tables in the given (empty) database and prints one JSON object.
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout, clippy::unwrap_used, missing_docs)] // a command-line report

use cqrs_es::event_sink::EventSink;
use cqrs_es::persist::GenericQuery;
use cqrs_es::{Aggregate, DomainEvent, EventEnvelope, View};
use postgres_es::{postgres_cqrs, PostgresCqrs, PostgresViewRepository};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An environment's specification: one new version per declaration.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Specification {
    environment: String,
    version: u32,
}

#[derive(Debug)]
enum SpecificationCommand {
    Declare {
        environment: String,
        program_ref: String,
        program_version: String,
        actor: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum SpecificationEvent {
    Declared {
        tenant_id: String,
        environment_id: String,
        version: u32,
        program_ref: String,
        program_version: String,
        declared_by: String,
        declared_at: String,
        configuration: serde_json::Value,
    },
}

impl DomainEvent for SpecificationEvent {
    fn event_type(&self) -> String {
        "SpecificationDeclared".into()
    }
    fn event_version(&self) -> String {
        "1".into()
    }
}

#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("{0}")]
    Rule(&'static str),
}

impl Aggregate for Specification {
    const TYPE: &'static str = "Specification";
    type Command = SpecificationCommand;
    type Event = SpecificationEvent;
    type Error = Refused;
    type Services = ();

    async fn handle(
        &mut self,
        command: Self::Command,
        _: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), Refused> {
        let SpecificationCommand::Declare {
            environment,
            program_ref,
            program_version,
            actor,
        } = command;
        if program_ref.is_empty() {
            return Err(Refused::Rule("a program is required"));
        }
        sink.write(
            SpecificationEvent::Declared {
                tenant_id: "bench".into(),
                environment_id: environment,
                version: self.version + 1,
                program_ref,
                program_version,
                declared_by: actor,
                declared_at: chrono::Utc::now().to_rfc3339(),
                configuration: json!({"region": "eu-west-1", "replicas": 2}),
            },
            self,
        )
        .await;
        Ok(())
    }

    fn apply(&mut self, event: Self::Event) {
        let SpecificationEvent::Declared {
            environment_id,
            version,
            ..
        } = event;
        self.environment = environment_id;
        self.version = version;
    }
}

/// A run or a promotion: requested, then perhaps cancelled.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Flow {
    state: String,
}

#[derive(Debug)]
enum FlowCommand {
    RequestPlan {
        specification: String,
        version: u32,
        environment: String,
        actor: String,
    },
    RequestPromotion {
        release: String,
        environment: String,
        actor: String,
    },
    Cancel {
        reason: String,
        actor: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum FlowEvent {
    PlanRequested {
        tenant_id: String,
        specification_id: String,
        specification_version: u32,
        environment_id: String,
        kind: String,
        requested_by: String,
        requested_at: String,
    },
    PromotionRequested {
        tenant_id: String,
        release_id: String,
        environment_id: String,
        environment_class: String,
        strategy: String,
        requested_by: String,
        requested_at: String,
    },
    Cancelled {
        cancelled_by: String,
        reason: String,
        at: String,
    },
}

impl DomainEvent for FlowEvent {
    fn event_type(&self) -> String {
        match self {
            Self::PlanRequested { .. } => "PlanRequested",
            Self::PromotionRequested { .. } => "PromotionRequested",
            Self::Cancelled { .. } => "Cancelled",
        }
        .into()
    }
    fn event_version(&self) -> String {
        "1".into()
    }
}

impl Aggregate for Flow {
    const TYPE: &'static str = "Flow";
    type Command = FlowCommand;
    type Event = FlowEvent;
    type Error = Refused;
    type Services = ();

    async fn handle(
        &mut self,
        command: Self::Command,
        _: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), Refused> {
        let now = chrono::Utc::now().to_rfc3339();
        let event = match command {
            FlowCommand::RequestPlan {
                specification,
                version,
                environment,
                actor,
            } if self.state.is_empty() => FlowEvent::PlanRequested {
                tenant_id: "bench".into(),
                specification_id: specification,
                specification_version: version,
                environment_id: environment,
                kind: "Release".into(),
                requested_by: actor,
                requested_at: now,
            },
            FlowCommand::RequestPromotion {
                release,
                environment,
                actor,
            } if self.state.is_empty() => FlowEvent::PromotionRequested {
                tenant_id: "bench".into(),
                release_id: release,
                environment_id: environment,
                environment_class: "development".into(),
                strategy: "AllAtOnce".into(),
                requested_by: actor,
                requested_at: now,
            },
            FlowCommand::Cancel { reason, actor } if self.state == "Requested" => {
                FlowEvent::Cancelled {
                    cancelled_by: actor,
                    reason,
                    at: now,
                }
            }
            _ => return Err(Refused::Rule("wrong state")),
        };
        sink.write(event, self).await;
        Ok(())
    }

    fn apply(&mut self, event: Self::Event) {
        self.state = match event {
            FlowEvent::PlanRequested { .. } | FlowEvent::PromotionRequested { .. } => "Requested",
            FlowEvent::Cancelled { .. } => "Cancelled",
        }
        .into();
    }
}

/// The read model: the aggregate's latest state, as a list page would show it.
#[derive(Debug, Default, Serialize, Deserialize)]
struct SpecificationView {
    environment_id: String,
    version: u32,
    program_ref: String,
}

impl View<Specification> for SpecificationView {
    fn update(&mut self, event: &EventEnvelope<Specification>) {
        let SpecificationEvent::Declared {
            environment_id,
            version,
            program_ref,
            ..
        } = &event.payload;
        self.environment_id = environment_id.clone();
        self.version = *version;
        self.program_ref = program_ref.clone();
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct FlowView {
    state: String,
    environment_id: String,
}

impl View<Flow> for FlowView {
    fn update(&mut self, event: &EventEnvelope<Flow>) {
        match &event.payload {
            FlowEvent::PlanRequested { environment_id, .. }
            | FlowEvent::PromotionRequested { environment_id, .. } => {
                self.state = "Requested".into();
                self.environment_id = environment_id.clone();
            }
            FlowEvent::Cancelled { .. } => self.state = "Cancelled".into(),
        }
    }
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS events (aggregate_type text NOT NULL, aggregate_id text NOT NULL,
  sequence bigint CHECK (sequence >= 0) NOT NULL, event_type text NOT NULL, event_version text NOT NULL,
  payload json NOT NULL, metadata json NOT NULL, PRIMARY KEY (aggregate_type, aggregate_id, sequence));
CREATE TABLE IF NOT EXISTS specification_view (view_id text NOT NULL, version bigint CHECK (version >= 0) NOT NULL,
  payload json NOT NULL, PRIMARY KEY (view_id));
CREATE TABLE IF NOT EXISTS flow_view (view_id text NOT NULL, version bigint CHECK (version >= 0) NOT NULL,
  payload json NOT NULL, PRIMARY KEY (view_id));
";

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    (sorted[i].as_secs_f64() * 10_000.0).round() / 10.0
}

/// A handler of specifications and one of flows (runs and promotions), each with its view,
/// on a pool of the given database (whose tables it creates).
async fn connect(url: &str) -> (Arc<PostgresCqrs<Specification>>, Arc<PostgresCqrs<Flow>>) {
    // The same pool size as Ferry's Postgres store.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(url)
        .await
        .unwrap();
    sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
    let spec_view = Arc::new(
        PostgresViewRepository::<SpecificationView, Specification>::new(
            "specification_view",
            pool.clone(),
        ),
    );
    let flow_view = Arc::new(PostgresViewRepository::<FlowView, Flow>::new(
        "flow_view",
        pool.clone(),
    ));
    let specs = Arc::new(postgres_cqrs(
        pool.clone(),
        vec![Box::new(GenericQuery::new(spec_view))],
        (),
    ));
    let flows = Arc::new(postgres_cqrs(
        pool.clone(),
        vec![Box::new(GenericQuery::new(flow_view))],
        (),
    ));
    (specs, flows)
}

/// One task's command mix, repeated until `deadline`: every command's latency, and how
/// many commands failed.
async fn mix(
    specs: Arc<PostgresCqrs<Specification>>,
    flows: Arc<PostgresCqrs<Flow>>,
    run: String,
    t: usize,
    deadline: Instant,
) -> (Vec<Duration>, u64) {
    let mut lat = Vec::new();
    let mut errors = 0u64;
    let mut n = 0u64;
    while Instant::now() < deadline {
        n += 1;
        let environment = format!("{run}-{t}-{}", n % 20);
        let actor = "load".to_string();
        let timed = Instant::now();
        let r = specs
            .execute(
                &environment,
                SpecificationCommand::Declare {
                    environment: environment.clone(),
                    program_ref: "/srv/infra#web".into(),
                    program_version: "3f2a9c1".into(),
                    actor: actor.clone(),
                },
            )
            .await;
        lat.push(timed.elapsed());
        if r.is_err() {
            errors += 1;
            continue;
        }
        let plan = uuid::Uuid::new_v4().to_string();
        let timed = Instant::now();
        let r = flows
            .execute(
                &plan,
                FlowCommand::RequestPlan {
                    specification: environment.clone(),
                    version: 1,
                    environment: environment.clone(),
                    actor: actor.clone(),
                },
            )
            .await;
        lat.push(timed.elapsed());
        if r.is_err() {
            errors += 1;
            continue;
        }
        let timed = Instant::now();
        let r = flows
            .execute(
                &plan,
                FlowCommand::Cancel {
                    reason: "load".into(),
                    actor: actor.clone(),
                },
            )
            .await;
        lat.push(timed.elapsed());
        errors += u64::from(r.is_err());
        let timed = Instant::now();
        let r = flows
            .execute(
                &uuid::Uuid::new_v4().to_string(),
                FlowCommand::RequestPromotion {
                    release: run.clone(),
                    environment: format!("dev-{t}"),
                    actor,
                },
            )
            .await;
        lat.push(timed.elapsed());
        errors += u64::from(r.is_err());
    }
    (lat, errors)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let url = args
        .get(1)
        .cloned()
        .expect("usage: peer <postgres-url> [tasks] [seconds]");
    let tasks: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(32);
    let seconds: u64 = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(20);
    let (specs, flows) = connect(&url).await;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (specs, flows, run) = (specs.clone(), flows.clone(), run.clone());
        handles.push(tokio::spawn(mix(specs, flows, run, t, deadline)));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for h in handles {
        let (lat, e) = h.await.unwrap();
        all.extend(lat);
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort();
    let report = json!({
        "tasks": tasks,
        "seconds": (elapsed * 10.0).round() / 10.0,
        "errors": errors,
        "commands": {
            "count": all.len(),
            "perSecond": (all.len() as f64 / elapsed * 10.0).round() / 10.0,
            "p50Ms": percentile(&all, 0.5),
            "p99Ms": percentile(&all, 0.99),
        }
    });
    println!("{report}");
}

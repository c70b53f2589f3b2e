//! The projections: how each event changes the read-model tables, the table definitions,
//! and the runner that ties a projection to its checkpoint.

use crate::views::{AppliedSpecification, RunView};
use ferry_domain::run::RunEvent;
use ferry_domain::specification::SpecificationEvent;
use ferry_domain::{ProvisioningRunId, SpecificationId};
use ferry_store::database::Backend;
use ferry_store::stream::{run_subscription, Handler, HandlerError, Param, StoredEvent, Tx};
use ferry_store::Database;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// One read-model table: its live name and its DDL, with `{t}` for the table name, `{i}`
/// for a unique index-name prefix, `{json}` and `{ts}` for the engine's types.
#[derive(Debug, Clone, Copy)]
pub struct TableSpec {
    /// The live table name.
    pub base: &'static str,
    /// CREATE statements.
    pub ddl: &'static [&'static str],
}

/// The actual table names a runner writes to (live or rebuild copies).
#[derive(Debug, Clone)]
pub struct TableNames(HashMap<&'static str, String>);

impl TableNames {
    /// The actual name of `base`.
    pub fn get<'a>(&'a self, base: &'a str) -> &'a str {
        self.0.get(base).map_or(base, String::as_str)
    }
}

/// A read model built from the global stream.
#[async_trait::async_trait]
pub trait Projection: Send + Sync {
    /// Its name: the checkpoint and the `ferry projections rebuild NAME` argument.
    fn name(&self) -> &'static str;
    /// The tables it owns.
    fn tables(&self) -> &'static [TableSpec];
    /// Applies one event to the tables.
    async fn apply(
        &self,
        tx: &mut Tx,
        tables: &TableNames,
        event: &StoredEvent,
    ) -> Result<(), HandlerError>;
}

/// Every projection Ferry keeps.
pub fn all_projections() -> Vec<Arc<dyn Projection>> {
    vec![
        Arc::new(SpecificationsProjection),
        Arc::new(RunsProjection),
        Arc::new(EnvironmentsProjection),
    ]
}

fn decode<T: DeserializeOwned>(event: &StoredEvent) -> Result<T, HandlerError> {
    serde_json::from_value(event.payload.clone()).map_err(|e| HandlerError::Decode {
        event_type: event.event_type.clone(),
        position: event.position.global_position,
        reason: e.to_string(),
    })
}

fn text(v: impl ToString) -> Param {
    Param::Text(Some(v.to_string()))
}

fn int(v: impl Into<i64>) -> Param {
    Param::Int(Some(v.into()))
}

fn json<T: serde::Serialize>(v: &T) -> Result<Param, HandlerError> {
    serde_json::to_value(v)
        .map(|v| Param::Json(Some(v)))
        .map_err(|e| HandlerError::Decode {
            event_type: "document".to_string(),
            position: 0,
            reason: e.to_string(),
        })
}

/// `rm_specification_versions`: every declared version.
pub struct SpecificationsProjection;

const SPEC_TABLES: &[TableSpec] = &[TableSpec {
    base: "rm_specification_versions",
    ddl: &[
        "CREATE TABLE IF NOT EXISTS {t} (
            tenant_id text NOT NULL, specification_id text NOT NULL, version bigint NOT NULL,
            environment_id text NOT NULL, project_id text NOT NULL, kind text NOT NULL,
            position bigint NOT NULL, declared_at {ts} NOT NULL, document {json} NOT NULL,
            PRIMARY KEY (tenant_id, specification_id, version))",
        "CREATE INDEX IF NOT EXISTS {i}_page ON {t} (tenant_id, position)",
    ],
}];

#[async_trait::async_trait]
impl Projection for SpecificationsProjection {
    fn name(&self) -> &'static str {
        "specifications"
    }
    fn tables(&self) -> &'static [TableSpec] {
        SPEC_TABLES
    }
    async fn apply(
        &self,
        tx: &mut Tx,
        t: &TableNames,
        event: &StoredEvent,
    ) -> Result<(), HandlerError> {
        if event.aggregate_type != "DeploymentSpecification" {
            return Ok(());
        }
        let SpecificationEvent::SpecificationDeclared(v) = decode(event)?;
        let sql = format!(
            "INSERT INTO {} (tenant_id, specification_id, version, environment_id, project_id, kind, position, declared_at, document)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING",
            t.get("rm_specification_versions")
        );
        tx.execute(
            &sql,
            &[
                text(&v.tenant_id),
                text(v.specification_id),
                int(v.version),
                text(&v.environment_id),
                text(&v.project_id),
                text(v.kind.as_str()),
                int(event.position.global_position),
                Param::Time(Some(v.declared_at)),
                json(&v)?,
            ],
        )
        .await?;
        Ok(())
    }
}

/// `rm_runs`: one document per run, with columns to filter and page by.
pub struct RunsProjection;

const RUN_TABLES: &[TableSpec] = &[TableSpec {
    base: "rm_runs",
    ddl: &[
        "CREATE TABLE IF NOT EXISTS {t} (
            provisioning_run_id text PRIMARY KEY, tenant_id text NOT NULL,
            environment_id text NOT NULL, kind text NOT NULL, state text NOT NULL,
            position bigint NOT NULL, version bigint NOT NULL, updated_at {ts} NOT NULL,
            document {json} NOT NULL)",
        "CREATE INDEX IF NOT EXISTS {i}_page ON {t} (tenant_id, position)",
    ],
}];

#[async_trait::async_trait]
impl Projection for RunsProjection {
    fn name(&self) -> &'static str {
        "runs"
    }
    fn tables(&self) -> &'static [TableSpec] {
        RUN_TABLES
    }
    async fn apply(
        &self,
        tx: &mut Tx,
        t: &TableNames,
        event: &StoredEvent,
    ) -> Result<(), HandlerError> {
        if event.aggregate_type != "ProvisioningRun" {
            return Ok(());
        }
        let run_event: RunEvent = decode(event)?;
        let table = t.get("rm_runs");
        if let Some(view) = RunView::start(&run_event) {
            let sql = format!(
                "INSERT INTO {table} (provisioning_run_id, tenant_id, environment_id, kind, state, position, version, updated_at, document)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING"
            );
            tx.execute(
                &sql,
                &[
                    text(view.provisioning_run_id),
                    text(&view.tenant_id),
                    text(&view.environment_id),
                    text(view.kind.as_str()),
                    text(view.state.as_str()),
                    int(event.position.global_position),
                    int(event.sequence),
                    Param::Time(Some(view.updated_at)),
                    json(&view)?,
                ],
            )
            .await?;
            return Ok(());
        }
        let select = format!("SELECT document FROM {table} WHERE provisioning_run_id = $1");
        let Some(doc) = tx.fetch_json(&select, &[text(&event.aggregate_id)]).await? else {
            return Err(HandlerError::Decode {
                event_type: event.event_type.clone(),
                position: event.position.global_position,
                reason: format!("run {} has no ProvisioningRequested", event.aggregate_id),
            });
        };
        let mut view: RunView = serde_json::from_value(doc).map_err(|e| HandlerError::Decode {
            event_type: "RunView".to_string(),
            position: event.position.global_position,
            reason: e.to_string(),
        })?;
        if view.version >= event.sequence as u64 {
            return Ok(()); // already applied
        }
        view.apply(&run_event);
        let update = format!(
            "UPDATE {table} SET state = $2, version = $3, updated_at = $4, document = $5 WHERE provisioning_run_id = $1"
        );
        tx.execute(
            &update,
            &[
                text(&event.aggregate_id),
                text(view.state.as_str()),
                int(event.sequence),
                Param::Time(Some(view.updated_at)),
                json(&view)?,
            ],
        )
        .await?;
        Ok(())
    }
}

/// `rm_environment_specifications`: newest and last applied specification per environment
/// and kind, with `rm_environment_run_targets` to know which version a run applies.
pub struct EnvironmentsProjection;

const ENV_TABLES: &[TableSpec] = &[
    TableSpec {
        base: "rm_environment_specifications",
        ddl: &["CREATE TABLE IF NOT EXISTS {t} (
            tenant_id text NOT NULL, environment_id text NOT NULL, kind text NOT NULL,
            specification_id text NOT NULL, latest_version bigint NOT NULL, latest {json} NOT NULL,
            applied {json},
            PRIMARY KEY (tenant_id, environment_id, kind))"],
    },
    TableSpec {
        base: "rm_environment_run_targets",
        ddl: &["CREATE TABLE IF NOT EXISTS {t} (
            provisioning_run_id text PRIMARY KEY, tenant_id text NOT NULL,
            specification_id text NOT NULL, target {json} NOT NULL)"],
    },
];

#[async_trait::async_trait]
impl Projection for EnvironmentsProjection {
    fn name(&self) -> &'static str {
        "environments"
    }
    fn tables(&self) -> &'static [TableSpec] {
        ENV_TABLES
    }
    async fn apply(
        &self,
        tx: &mut Tx,
        t: &TableNames,
        event: &StoredEvent,
    ) -> Result<(), HandlerError> {
        let specs = t.get("rm_environment_specifications");
        let targets = t.get("rm_environment_run_targets");
        match event.aggregate_type.as_str() {
            "DeploymentSpecification" => {
                let SpecificationEvent::SpecificationDeclared(v) = decode(event)?;
                let sql = format!(
                    "INSERT INTO {specs} (tenant_id, environment_id, kind, specification_id, latest_version, latest)
                     VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (tenant_id, environment_id, kind)
                     DO UPDATE SET latest_version = excluded.latest_version, latest = excluded.latest
                     WHERE {specs}.latest_version < excluded.latest_version"
                );
                tx.execute(
                    &sql,
                    &[
                        text(&v.tenant_id),
                        text(&v.environment_id),
                        text(v.kind.as_str()),
                        text(v.specification_id),
                        int(v.version),
                        json(&v)?,
                    ],
                )
                .await?;
            }
            "ProvisioningRun" => match decode::<RunEvent>(event)? {
                RunEvent::ProvisioningRequested(r) => {
                    let sql = format!(
                        "INSERT INTO {targets} (provisioning_run_id, tenant_id, specification_id, target)
                         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING"
                    );
                    let target = RunTarget {
                        specification_id: r.specification_id,
                        specification_version: r.specification_version,
                    };
                    tx.execute(
                        &sql,
                        &[
                            text(r.provisioning_run_id),
                            text(&r.tenant_id),
                            text(r.specification_id),
                            json(&target)?,
                        ],
                    )
                    .await?;
                }
                RunEvent::ProvisioningApplied { applied_at, .. } => {
                    let select =
                        format!("SELECT target FROM {targets} WHERE provisioning_run_id = $1");
                    let Some(target) = tx.fetch_json(&select, &[text(&event.aggregate_id)]).await?
                    else {
                        return Ok(());
                    };
                    let target: RunTarget =
                        serde_json::from_value(target).map_err(|e| HandlerError::Decode {
                            event_type: "RunTarget".to_string(),
                            position: event.position.global_position,
                            reason: e.to_string(),
                        })?;
                    let applied = AppliedSpecification {
                        version: target.specification_version,
                        provisioning_run_id: ProvisioningRunId::parse(&event.aggregate_id)
                            .map_err(|e| HandlerError::Decode {
                                event_type: event.event_type.clone(),
                                position: event.position.global_position,
                                reason: e.to_string(),
                            })?,
                        applied_at,
                    };
                    // The last apply wins; runs apply one at a time per environment.
                    let sql = format!(
                        "UPDATE {specs} SET applied = $3 WHERE tenant_id = $1 AND specification_id = $2"
                    );
                    let tenant = event.tenant_id().unwrap_or_default().to_string();
                    tx.execute(
                        &sql,
                        &[text(tenant), text(target.specification_id), json(&applied)?],
                    )
                    .await?;
                }
                _ => {}
            },
            _ => {}
        }
        Ok(())
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RunTarget {
    specification_id: SpecificationId,
    specification_version: u32,
}

/// A projection bound to a set of tables and a checkpoint: the live one, or a rebuild copy.
pub struct ProjectionRunner {
    projection: Arc<dyn Projection>,
    tables: TableNames,
    checkpoint: String,
}

impl ProjectionRunner {
    /// The live runner, writing the live tables.
    pub fn live(projection: Arc<dyn Projection>) -> Self {
        Self::with_suffix(projection, "")
    }

    /// A runner writing `<table><suffix>` tables under checkpoint `<name><suffix>`.
    pub fn with_suffix(projection: Arc<dyn Projection>, suffix: &str) -> Self {
        let tables = TableNames(
            projection
                .tables()
                .iter()
                .map(|t| (t.base, format!("{}{suffix}", t.base)))
                .collect(),
        );
        let checkpoint = format!("{}{suffix}", projection.name());
        Self {
            projection,
            tables,
            checkpoint,
        }
    }

    /// The tables it writes.
    pub fn tables(&self) -> &TableNames {
        &self.tables
    }

    /// The projection.
    pub fn projection(&self) -> &Arc<dyn Projection> {
        &self.projection
    }

    /// The DDL that creates this runner's tables. Index names carry `token` so that a
    /// rebuilt table's indexes never collide with the live ones after a swap.
    pub fn create_statements(&self, backend: Backend, token: &str) -> Vec<String> {
        let (json, ts) = match backend {
            Backend::Postgres => ("jsonb", "timestamptz"),
            Backend::Sqlite => ("text", "text"),
        };
        self.projection
            .tables()
            .iter()
            .flat_map(|spec| {
                let name = self.tables.get(spec.base).to_string();
                spec.ddl.iter().map(move |ddl| {
                    ddl.replace("{t}", &name)
                        .replace("{i}", &format!("{name}_{token}"))
                        .replace("{json}", json)
                        .replace("{ts}", ts)
                })
            })
            .collect()
    }

    /// Creates the tables unless the first one exists (a rebuilt table keeps the indexes it
    /// was built with).
    pub async fn ensure_tables(&self, db: &Database) -> Result<(), sqlx::Error> {
        let mut tx = Tx::begin(db).await?;
        let first = self
            .projection
            .tables()
            .first()
            .map(|t| self.tables.get(t.base));
        if let Some(first) = first {
            if crate::rebuild::table_exists(&mut tx, first).await? {
                return tx.commit().await;
            }
        }
        for sql in self.create_statements(db.backend(), "v1") {
            tx.execute(&sql, &[]).await?;
        }
        tx.commit().await
    }
}

#[async_trait::async_trait]
impl Handler for ProjectionRunner {
    fn name(&self) -> &str {
        &self.checkpoint
    }
    async fn handle(&self, tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError> {
        self.projection.apply(tx, &self.tables, event).await
    }
}

/// Runs every live projection in the background and tells waiters when they move.
#[derive(Clone)]
pub struct Projector {
    progress: watch::Sender<u64>,
}

impl Projector {
    /// Creates the live tables and starts one subscription per projection.
    pub async fn start(
        db: &Database,
        poll: Duration,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Self, sqlx::Error> {
        let progress = watch::channel(0).0;
        for projection in all_projections() {
            let runner = ProjectionRunner::live(projection);
            runner.ensure_tables(db).await?;
            ferry_store::stream::ensure_checkpoint(db, runner.name()).await?;
            tokio::spawn(run_subscription(
                db.clone(),
                Arc::new(runner),
                poll,
                shutdown.clone(),
                Some(progress.clone()),
            ));
        }
        Ok(Self { progress })
    }

    /// Changes whenever a projection commits a batch.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.progress.subscribe()
    }
}

/// Creates every live table (for `ferry migrate` and tests).
pub async fn ensure_all_tables(db: &Database) -> Result<(), sqlx::Error> {
    for projection in all_projections() {
        ProjectionRunner::live(projection).ensure_tables(db).await?;
    }
    Ok(())
}

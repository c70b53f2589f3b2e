//! The projections: how each event changes the read-model tables, the table definitions,
//! and the runner that ties a projection to its checkpoint.
//!
//! Each projection declares the aggregates it reads and a [`Subscriber`] per aggregate that
//! writes its tables; the events arrive decoded ([`ferry_store::events`]).

use crate::views::{AppliedSpecification, RunView};
use ferry_domain::run::{ProvisioningRun, RunEvent};
use ferry_domain::specification::{
    DeploymentSpecification, SpecificationEvent, SpecificationVersion,
};
use ferry_domain::{ProvisioningRunId, SpecificationId};
use ferry_store::database::Backend;
use ferry_store::stream::{
    run_subscriptions, Handler, HandlerError, Param, Position, Running, StoredEvent, Tx,
};
use ferry_store::{Database, Subscriber, Subscription, Typed};
use serde::de::DeserializeOwned;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tracing::Instrument;

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
pub trait Projection: Send + Sync {
    /// Its name: the checkpoint and the `ferry projections rebuild NAME` argument.
    fn name(&self) -> &'static str;
    /// The tables it owns.
    fn tables(&self) -> &'static [TableSpec];
    /// Adds to `subscription` the aggregates it reads, each with a subscriber that writes
    /// `tables` (the live tables or a rebuild's copies).
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription;
}

/// The provisioning context's projections (the process collects every context's).
pub fn provisioning_projections() -> Vec<Arc<dyn Projection>> {
    vec![
        Arc::new(SpecificationsProjection),
        Arc::new(RunsProjection),
        Arc::new(EnvironmentsProjection),
    ]
}

/// Reads a document the projection stored itself.
fn read_document<T: DeserializeOwned>(
    what: impl FnOnce() -> String,
    doc: serde_json::Value,
) -> Result<T, HandlerError> {
    serde_json::from_value(doc).map_err(|e| HandlerError::Record {
        what: what(),
        source: Box::new(e),
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
        .map_err(|e| HandlerError::Record {
            what: "a read-model document".to_string(),
            source: Box::new(e),
        })
}

/// `rm_specification_versions`: every declared version.
pub struct SpecificationsProjection;

impl SpecificationsProjection {
    /// Its name (its checkpoint, and what a read-your-writes wait names).
    pub const NAME: &'static str = "specifications";
}

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

impl Projection for SpecificationsProjection {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn tables(&self) -> &'static [TableSpec] {
        SPEC_TABLES
    }
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription {
        subscription.on::<DeploymentSpecification>(SpecificationRows(tables.clone()))
    }
}

/// Writes `rm_specification_versions` (or its rebuild copy).
struct SpecificationRows(TableNames);

#[async_trait::async_trait]
impl Subscriber<DeploymentSpecification> for SpecificationRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<SpecificationEvent>) -> Result<(), HandlerError> {
        self.on_batch(tx, std::slice::from_ref(event)).await
    }

    async fn on_batch(
        &self,
        tx: &mut Tx,
        events: &[Typed<SpecificationEvent>],
    ) -> Result<(), HandlerError> {
        let mut rows = Vec::with_capacity(events.len());
        for event in events {
            let SpecificationEvent::SpecificationDeclared(v) = &event.event;
            rows.push(vec![
                text(&v.tenant_id),
                text(v.specification_id),
                int(v.version),
                text(&v.environment_id),
                text(&v.project_id),
                text(v.kind.as_str()),
                int(event.position.global_position),
                Param::Time(Some(v.declared_at)),
                json(v)?,
            ]);
        }
        tx.insert_rows(
            self.0.get("rm_specification_versions"),
            &[
                "tenant_id",
                "specification_id",
                "version",
                "environment_id",
                "project_id",
                "kind",
                "position",
                "declared_at",
                "document",
            ],
            rows,
            "ON CONFLICT DO NOTHING",
        )
        .await?;
        Ok(())
    }
}

/// `rm_runs`: one document per run, with columns to filter and page by.
pub struct RunsProjection;

impl RunsProjection {
    /// Its name (its checkpoint, and what a read-your-writes wait names).
    pub const NAME: &'static str = "runs";
}

const RUN_TABLES: &[TableSpec] = &[TableSpec {
    base: "rm_runs",
    ddl: &[
        "CREATE TABLE IF NOT EXISTS {t} (
            provisioning_run_id text PRIMARY KEY, tenant_id text NOT NULL,
            environment_id text NOT NULL, kind text NOT NULL, state text NOT NULL,
            position bigint NOT NULL, version bigint NOT NULL, updated_at {ts} NOT NULL,
            document {json} NOT NULL)",
        "CREATE INDEX IF NOT EXISTS {i}_page ON {t} (tenant_id, position)",
        // An environment's runs: its page of the list, the reconciler's look for a run in
        // flight there (without it, a scan of every run of the tenant).
        "CREATE INDEX IF NOT EXISTS {i}_environment ON {t} (tenant_id, environment_id, position)",
    ],
}];

impl Projection for RunsProjection {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn tables(&self) -> &'static [TableSpec] {
        RUN_TABLES
    }
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription {
        subscription.on::<ProvisioningRun>(RunRows(tables.clone()))
    }
}

/// Writes `rm_runs` (or its rebuild copy).
struct RunRows(TableNames);

#[async_trait::async_trait]
impl Subscriber<ProvisioningRun> for RunRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<RunEvent>) -> Result<(), HandlerError> {
        let table = self.0.get("rm_runs");
        if let Some(view) = RunView::start(&event.event) {
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
        let what = || format!("the {table} row of run {}", event.aggregate_id);
        let Some(doc) = tx.fetch_json(&select, &[text(&event.aggregate_id)]).await? else {
            return Err(HandlerError::Record {
                what: what(),
                source: "missing: the run's ProvisioningRequested was not projected".into(),
            });
        };
        let mut view: RunView = read_document(what, doc)?;
        if view.version >= event.sequence as u64 {
            return Ok(()); // already applied
        }
        view.apply(&event.event);
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

    /// Reads the stored documents of every run in the batch at once, folds the events into
    /// them in memory and writes each changed run once: the same rows as event by event.
    async fn on_batch(&self, tx: &mut Tx, events: &[Typed<RunEvent>]) -> Result<(), HandlerError> {
        let table = self.0.get("rm_runs");
        let ids: BTreeSet<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
        let select = format!(
            "SELECT provisioning_run_id, document FROM {table} WHERE provisioning_run_id IN"
        );
        let keys: Vec<Param> = ids.iter().map(text).collect();
        let mut runs: BTreeMap<String, Folded<RunView>> = BTreeMap::new();
        for (id, doc) in tx.fetch_documents(&select, &keys).await? {
            let view = read_document(|| format!("the {table} row of run {id}"), doc)?;
            runs.insert(id, Folded::stored(view));
        }
        for event in events {
            let start = RunView::start(&event.event);
            match (runs.get_mut(&event.aggregate_id), start) {
                (Some(_), Some(_)) => {} // requested again: the row stays as it is
                (None, Some(view)) => {
                    let folded = Folded::new(view, event.position.global_position, event.sequence);
                    runs.insert(event.aggregate_id.clone(), folded);
                }
                (None, None) => {
                    return Err(HandlerError::Record {
                        what: format!("the {table} row of run {}", event.aggregate_id),
                        source: "missing: the run's ProvisioningRequested was not projected".into(),
                    })
                }
                (Some(run), None) => {
                    if run.view.version < event.sequence as u64 {
                        run.view.apply(&event.event);
                        run.changed(event.sequence);
                    }
                }
            }
        }
        let mut rows = Vec::new();
        for run in runs.into_values().filter(|r| r.changed) {
            let view = run.view;
            rows.push(vec![
                text(view.provisioning_run_id),
                text(&view.tenant_id),
                text(&view.environment_id),
                text(view.kind.as_str()),
                text(view.state.as_str()),
                int(run.position),
                int(run.sequence),
                Param::Time(Some(view.updated_at)),
                json(&view)?,
            ]);
        }
        tx.insert_rows(
            table,
            &[
                "provisioning_run_id",
                "tenant_id",
                "environment_id",
                "kind",
                "state",
                "position",
                "version",
                "updated_at",
                "document",
            ],
            rows,
            "ON CONFLICT (provisioning_run_id) DO UPDATE SET state = excluded.state,
             version = excluded.version, updated_at = excluded.updated_at, document = excluded.document",
        )
        .await?;
        Ok(())
    }
}

/// A document a batch folds its events into before writing it once.
pub struct Folded<V> {
    /// The document.
    pub view: V,
    /// Where its row starts in the stream (used only when the batch inserts it).
    pub position: i64,
    /// The sequence of the last event folded in.
    pub sequence: i64,
    /// Whether the batch changed it (only changed documents are written).
    pub changed: bool,
}

impl<V> Folded<V> {
    /// A document as stored before the batch.
    pub fn stored(view: V) -> Self {
        Self {
            view,
            position: 0,
            sequence: 0,
            changed: false,
        }
    }

    /// A document the batch starts, at the event at `position` with `sequence`.
    pub fn new(view: V, position: i64, sequence: i64) -> Self {
        Self {
            view,
            position,
            sequence,
            changed: true,
        }
    }

    /// The event with `sequence` changed it.
    pub fn changed(&mut self, sequence: i64) {
        self.sequence = sequence;
        self.changed = true;
    }
}

/// `rm_environment_specifications`: newest and last applied specification per environment
/// and kind, with `rm_environment_run_targets` to know which version a run applies.
pub struct EnvironmentsProjection;

impl EnvironmentsProjection {
    /// Its name (its checkpoint, and what a read-your-writes wait names).
    pub const NAME: &'static str = "environments";
}

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

impl Projection for EnvironmentsProjection {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn tables(&self) -> &'static [TableSpec] {
        ENV_TABLES
    }
    fn subscribe(&self, subscription: Subscription, tables: &TableNames) -> Subscription {
        let rows = Arc::new(EnvironmentRows(tables.clone()));
        // A run's apply updates the row its specification's declaration wrote, and nothing
        // else crosses: declarations first, then runs, is the stream's effect.
        subscription
            .on::<DeploymentSpecification>(rows.clone())
            .on::<ProvisioningRun>(rows)
            .by_aggregate()
    }
}

/// Writes `rm_environment_specifications` and `rm_environment_run_targets` (or their
/// rebuild copies): declarations set the latest version, runs the applied one.
struct EnvironmentRows(TableNames);

#[async_trait::async_trait]
impl Subscriber<DeploymentSpecification> for EnvironmentRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<SpecificationEvent>) -> Result<(), HandlerError> {
        let specs = self.0.get("rm_environment_specifications");
        let SpecificationEvent::SpecificationDeclared(v) = &event.event;
        let sql = format!(
            "INSERT INTO {specs} (tenant_id, environment_id, kind, specification_id, latest_version, latest)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (tenant_id, environment_id, kind)
             DO UPDATE SET latest_version = excluded.latest_version, latest = excluded.latest
             WHERE {specs}.latest_version < excluded.latest_version"
        );
        tx.execute(&sql, &latest_row(v)?).await?;
        Ok(())
    }

    /// One row per environment and kind: the declaration that the event-by-event upserts
    /// would leave (the first of the highest version), written with the same upsert.
    async fn on_batch(
        &self,
        tx: &mut Tx,
        events: &[Typed<SpecificationEvent>],
    ) -> Result<(), HandlerError> {
        let specs = self.0.get("rm_environment_specifications");
        let mut latest: BTreeMap<(&str, &str, &str), &SpecificationVersion> = BTreeMap::new();
        for event in events {
            let SpecificationEvent::SpecificationDeclared(v) = &event.event;
            let key = (
                v.tenant_id.as_str(),
                v.environment_id.as_str(),
                v.kind.as_str(),
            );
            let entry = latest.entry(key).or_insert(&**v);
            if entry.version < v.version {
                *entry = &**v;
            }
        }
        let mut rows = Vec::with_capacity(latest.len());
        for v in latest.into_values() {
            rows.push(latest_row(v)?);
        }
        tx.insert_rows(
            specs,
            &[
                "tenant_id",
                "environment_id",
                "kind",
                "specification_id",
                "latest_version",
                "latest",
            ],
            rows,
            &format!(
                "ON CONFLICT (tenant_id, environment_id, kind)
                 DO UPDATE SET latest_version = excluded.latest_version, latest = excluded.latest
                 WHERE {specs}.latest_version < excluded.latest_version"
            ),
        )
        .await?;
        Ok(())
    }
}

/// The `rm_environment_specifications` row of a declaration as the latest.
fn latest_row(v: &SpecificationVersion) -> Result<Vec<Param>, HandlerError> {
    Ok(vec![
        text(&v.tenant_id),
        text(&v.environment_id),
        text(v.kind.as_str()),
        text(v.specification_id),
        int(v.version),
        json(v)?,
    ])
}

#[async_trait::async_trait]
impl Subscriber<ProvisioningRun> for EnvironmentRows {
    async fn on(&self, tx: &mut Tx, event: &Typed<RunEvent>) -> Result<(), HandlerError> {
        let specs = self.0.get("rm_environment_specifications");
        let targets = self.0.get("rm_environment_run_targets");
        match &event.event {
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
                let select = format!("SELECT target FROM {targets} WHERE provisioning_run_id = $1");
                let Some(target) = tx.fetch_json(&select, &[text(&event.aggregate_id)]).await?
                else {
                    return Ok(());
                };
                let target: RunTarget = read_document(
                    || format!("the {targets} row of run {}", event.aggregate_id),
                    target,
                )?;
                let applied = AppliedSpecification {
                    version: target.specification_version,
                    provisioning_run_id: ProvisioningRunId::parse(&event.aggregate_id).map_err(
                        |e| HandlerError::Record {
                            what: format!("run id {:?}", event.aggregate_id),
                            source: Box::new(e),
                        },
                    )?,
                    applied_at: *applied_at,
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
        }
        Ok(())
    }

    /// Requests' targets are inserted together; an apply, which reads them, first writes
    /// those gathered so far and is then handled on its own.
    async fn on_batch(&self, tx: &mut Tx, events: &[Typed<RunEvent>]) -> Result<(), HandlerError> {
        let targets = self.0.get("rm_environment_run_targets");
        let mut rows = Vec::new();
        for event in events {
            match &event.event {
                RunEvent::ProvisioningRequested(r) => {
                    let target = RunTarget {
                        specification_id: r.specification_id,
                        specification_version: r.specification_version,
                    };
                    rows.push(vec![
                        text(r.provisioning_run_id),
                        text(&r.tenant_id),
                        text(r.specification_id),
                        json(&target)?,
                    ]);
                }
                RunEvent::ProvisioningApplied { .. } => {
                    insert_targets(tx, targets, std::mem::take(&mut rows)).await?;
                    Subscriber::<ProvisioningRun>::on(self, tx, event).await?;
                }
                _ => {}
            }
        }
        insert_targets(tx, targets, rows).await
    }
}

async fn insert_targets(
    tx: &mut Tx,
    table: &str,
    rows: Vec<Vec<Param>>,
) -> Result<(), HandlerError> {
    let columns = [
        "provisioning_run_id",
        "tenant_id",
        "specification_id",
        "target",
    ];
    tx.insert_rows(table, &columns, rows, "ON CONFLICT DO NOTHING")
        .await?;
    Ok(())
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
    subscription: Subscription,
    /// The live projector's growth check ([`ProjectionRunner::analyzing`]); `None` elsewhere.
    analyzer: Option<Analyzer>,
}

/// How many events a live projection handles between two looks at how much its tables grew.
pub const GROWTH_CHECK_EVERY: u64 = 1_000;

/// A table is analyzed once it has changed at least this many rows since it last was.
const ANALYZE_AT_LEAST: i64 = 1_000;

/// The runner's tables (of `$1`, comma-separated) that changed at least as many rows since
/// their last `ANALYZE` as they held then (or [`ANALYZE_AT_LEAST`]).
const GROWN: &str = "SELECT COALESCE(jsonb_agg(n), '[]') FROM unnest(string_to_array($1, ',')) AS n
  JOIN pg_stat_user_tables s ON s.relid = to_regclass(n)
  JOIN pg_class c ON c.oid = s.relid
 WHERE s.n_mod_since_analyze >= GREATEST($2, c.reltuples)";

/// A live projection's growth check: every [`GROWTH_CHECK_EVERY`] events it looks at how many
/// rows its tables changed since their last `ANALYZE` and analyzes those that have doubled
/// (at least [`ANALYZE_AT_LEAST`] rows).
///
/// Why: Postgres keeps a prepared statement's generic plan until the table's statistics
/// change, and a plan made while a table was nearly empty scans all of it. The autovacuum
/// daemon analyzes at most once a minute; until then a fresh table's lookups slow down as it
/// grows (measured: a promotion's quarantine lookup from 0.2 ms to 1.2 ms in ten seconds of
/// `bench/run.sh`'s mix). Doubling keeps the checks and analyses few; they run on a
/// connection of their own, one at a time, beside the projector.
struct Analyzer {
    db: Database,
    /// Events handled by this process.
    handled: AtomicU64,
    /// A check is running (the next due one is skipped rather than queued).
    busy: Arc<AtomicBool>,
}

/// Analyzes the tables of `names` that [`GROWN`] finds.
async fn analyze_grown(db: &Database, names: &[String]) -> Result<(), sqlx::Error> {
    let mut tx = Tx::begin(db).await?;
    let params = [text(names.join(",")), int(ANALYZE_AT_LEAST)];
    let found: Vec<String> = match tx.fetch_json(GROWN, &params).await? {
        Some(found) => serde_json::from_value(found).unwrap_or_default(),
        None => Vec::new(),
    };
    // Only names of the runner's own tables go into the statement.
    let grown: Vec<&str> = names
        .iter()
        .filter(|n| found.contains(n))
        .map(String::as_str)
        .collect();
    if !grown.is_empty() {
        tracing::debug!(tables = ?grown, "analyzing read-model tables that grew");
        tx.execute(&format!("ANALYZE {}", grown.join(", ")), &[])
            .await?;
    }
    tx.commit().await
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
        let subscription = projection.subscribe(Subscription::new(checkpoint), &tables);
        Self {
            projection,
            tables,
            subscription,
            analyzer: None,
        }
    }

    /// This runner analyzes its tables on `db` when they grow (see [`Analyzer`]).
    pub fn analyzing(mut self, db: Database) -> Self {
        if db.backend() == Backend::Postgres {
            self.analyzer = Some(Analyzer {
                db,
                handled: AtomicU64::new(0),
                busy: Arc::new(AtomicBool::new(false)),
            });
        }
        self
    }

    /// Counts `events` and, every [`GROWTH_CHECK_EVERY`], starts the growth check on a
    /// task of its own (never in the batch's transaction, which it would lengthen).
    fn count(&self, events: usize) {
        let Some(analyzer) = &self.analyzer else {
            return;
        };
        let events = events as u64;
        let before = analyzer.handled.fetch_add(events, Ordering::Relaxed);
        if before / GROWTH_CHECK_EVERY == (before + events) / GROWTH_CHECK_EVERY
            || analyzer.busy.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let names: Vec<String> = self
            .projection
            .tables()
            .iter()
            .map(|t| self.tables.get(t.base).to_string())
            .collect();
        let (db, busy) = (analyzer.db.clone(), Arc::clone(&analyzer.busy));
        let span = tracing::debug_span!("analyze", projection = self.projection.name());
        tokio::spawn(
            async move {
                if let Err(error) = analyze_grown(&db, &names).await {
                    tracing::warn!(%error, "could not analyze the read-model tables that grew");
                }
                busy.store(false, Ordering::Release);
            }
            .instrument(span),
        );
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
        self.projection
            .tables()
            .iter()
            .flat_map(|spec| self.table_statements(spec, backend, token))
            .collect()
    }

    /// The DDL of one of this runner's tables (see [`Self::create_statements`]).
    fn table_statements(&self, spec: &TableSpec, backend: Backend, token: &str) -> Vec<String> {
        let (json, ts) = match backend {
            Backend::Postgres => ("jsonb", "timestamptz"),
            Backend::Sqlite => ("text", "text"),
        };
        let name = self.tables.get(spec.base);
        spec.ddl
            .iter()
            .map(|ddl| {
                ddl.replace("{t}", name)
                    .replace("{i}", &format!("{name}_{token}"))
                    .replace("{json}", json)
                    .replace("{ts}", ts)
            })
            .collect()
    }

    /// Creates the tables that do not exist and adds to those that do the indexes of this
    /// version they lack. A table keeps the indexes it was made with (index names carry
    /// the token of the build or rebuild that made them), so an index is recognised by what
    /// it indexes ([`IndexShape`]), not by its name: a new version's index reaches an
    /// existing deployment at its next start, without a rebuild. Columns a new version
    /// adds to a table still need `ferry projections rebuild`.
    pub async fn ensure_tables(&self, db: &Database) -> Result<(), sqlx::Error> {
        let mut tx = Tx::begin(db).await?;
        if db.backend() == Backend::Postgres {
            // Instances starting together would otherwise race to create the same table or
            // index (a unique violation in the catalog) or add one index twice.
            tx.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended('ferry:read-model-ddl', 0))",
                &[],
            )
            .await?;
        }
        for spec in self.projection.tables() {
            let table = self.tables.get(spec.base);
            if !crate::rebuild::table_exists(&mut tx, table).await? {
                for sql in self.table_statements(spec, db.backend(), "v1") {
                    tx.execute(&sql, &[]).await?;
                }
                continue;
            }
            let present = index_shapes(&mut tx, table).await?;
            // A name no earlier index of the table can hold (they carry "v1" or a rebuild's
            // token), so that IF NOT EXISTS never skips the index being added.
            let token = format!("m{}", &uuid::Uuid::new_v4().simple().to_string()[..7]);
            for sql in self.table_statements(spec, db.backend(), &token) {
                let Some(shape) = IndexShape::of(&sql) else {
                    continue;
                };
                if !present.contains(&shape) {
                    tracing::info!(table, index = %sql, "adding an index the table lacks");
                    tx.execute(&sql, &[]).await?;
                }
            }
        }
        tx.commit().await
    }
}

/// What an index indexes, read from its `CREATE [UNIQUE] INDEX` statement: whether it is
/// unique and its column list (quotes, spaces and case dropped). Two indexes of one table
/// with the same shape serve the same reads, whatever their names; an index whose columns
/// change in a later version is a new index. The method and a partial index's predicate are
/// not compared: the read models' indexes are plain B-trees over whole tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexShape {
    unique: bool,
    columns: String,
}

impl IndexShape {
    /// The shape of a `CREATE [UNIQUE] INDEX ... ON table [USING method] (columns) ...`
    /// statement (as written in a [`TableSpec`], as Postgres' `pg_get_indexdef` or SQLite's
    /// `sqlite_master` give it back); `None` for any other statement.
    pub fn of(statement: &str) -> Option<Self> {
        // One space between words, so that a statement over several lines reads the same
        // (and the upper-cased copy keeps the byte offsets).
        let statement = statement.split_whitespace().collect::<Vec<_>>().join(" ");
        let upper = statement.to_ascii_uppercase();
        let unique = upper.starts_with("CREATE UNIQUE INDEX");
        if !unique && !upper.starts_with("CREATE INDEX") {
            return None;
        }
        let on = upper.find(" ON ")?;
        let open = on + statement[on..].find('(')?;
        let mut depth = 0;
        let mut close = None;
        for (i, c) in statement[open..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(open + i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let columns = statement[open + 1..close?]
            .chars()
            .filter(|c| !c.is_whitespace() && *c != '"')
            .collect::<String>()
            .to_ascii_lowercase();
        Some(Self { unique, columns })
    }
}

/// The shapes of the indexes `table` has.
pub(crate) async fn index_shapes(tx: &mut Tx, table: &str) -> Result<Vec<IndexShape>, sqlx::Error> {
    let sql = match tx.backend() {
        Backend::Postgres => {
            "SELECT COALESCE(jsonb_agg(pg_get_indexdef(indexrelid)), '[]')
             FROM pg_index WHERE indrelid = to_regclass($1)"
        }
        // Indexes SQLite makes itself (a primary key's) have no statement.
        Backend::Sqlite => {
            "SELECT json_group_array(sql) FROM sqlite_master
             WHERE type = 'index' AND tbl_name = $1 AND sql IS NOT NULL"
        }
    };
    let found = tx
        .fetch_json(sql, &[Param::Text(Some(table.to_string()))])
        .await?;
    Ok(found
        .as_ref()
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().and_then(IndexShape::of))
        .collect())
}

#[async_trait::async_trait]
impl Handler for ProjectionRunner {
    fn name(&self) -> &str {
        self.subscription.name()
    }
    /// A read model: its rows and its checkpoint move in one transaction, and nothing
    /// outside its tables follows from them.
    fn replayable(&self) -> bool {
        true
    }
    async fn handle(&self, tx: &mut Tx, event: &StoredEvent) -> Result<(), HandlerError> {
        self.subscription.handle(tx, event).await?;
        self.count(1);
        Ok(())
    }
    async fn handle_batch(&self, tx: &mut Tx, events: &[StoredEvent]) -> Result<(), HandlerError> {
        self.subscription.handle_batch(tx, events).await?;
        self.count(events.len());
        Ok(())
    }
}

/// Runs every live projection in the background and tells waiters when they move.
#[derive(Clone)]
pub struct Projector {
    progress: Arc<HashMap<&'static str, watch::Sender<Position>>>,
}

/// Where each live projection stands in the stream: its checkpoint, moved after each
/// catch-up that handled events or found it moved by another instance. A read-your-writes
/// wait watches only the projections whose tables it reads, and reads them once those have
/// passed its command's events.
#[derive(Clone, Default)]
pub struct Progress(Arc<HashMap<&'static str, watch::Receiver<Position>>>);

impl Progress {
    pub(crate) fn of(senders: &HashMap<&'static str, watch::Sender<Position>>) -> Self {
        Self(Arc::new(
            senders
                .iter()
                .map(|(name, sender)| (*name, sender.subscribe()))
                .collect(),
        ))
    }

    /// Receivers of the counters of `projections`, marked as seen; of every projection if
    /// one of the names is not a live projection (a wait then wakes more often, never
    /// less); none without a projector.
    pub fn watch(&self, projections: &[&str]) -> Vec<watch::Receiver<Position>> {
        let named: Option<Vec<_>> = projections.iter().map(|n| self.0.get(n)).collect();
        let mut chosen: Vec<watch::Receiver<Position>> = match named {
            Some(named) if !named.is_empty() => named.into_iter().cloned().collect(),
            _ => self.0.values().cloned().collect(),
        };
        for receiver in &mut chosen {
            receiver.borrow_and_update();
        }
        chosen
    }
}

impl Projector {
    /// Creates the live tables and starts the projections' subscriptions. They run on one
    /// task and share each batch: one transaction reads the stream once and writes every
    /// projection's rows, instead of a transaction per projection.
    pub async fn start(
        db: &Database,
        projections: &[Arc<dyn Projection>],
        poll: Duration,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Self, sqlx::Error> {
        let mut progress = HashMap::new();
        let mut subscriptions = Vec::with_capacity(projections.len());
        for projection in projections.iter().cloned() {
            let moved = watch::channel(Position::default()).0;
            progress.insert(projection.name(), moved.clone());
            let runner = ProjectionRunner::live(projection).analyzing(db.clone());
            runner.ensure_tables(db).await?;
            ferry_store::stream::ensure_checkpoint(db, runner.name()).await?;
            subscriptions.push(Running {
                handler: Arc::new(runner),
                progress: Some(moved),
            });
        }
        tokio::spawn(run_subscriptions(db.clone(), subscriptions, poll, shutdown));
        Ok(Self {
            progress: Arc::new(progress),
        })
    }

    /// Each projection's checkpoint, moved whenever it commits.
    pub fn subscribe(&self) -> Progress {
        Progress::of(&self.progress)
    }
}

/// Creates the live tables of `projections` (for `ferry migrate` and tests).
pub async fn ensure_all_tables(
    db: &Database,
    projections: &[Arc<dyn Projection>],
) -> Result<(), sqlx::Error> {
    for projection in projections.iter().cloned() {
        ProjectionRunner::live(projection).ensure_tables(db).await?;
    }
    Ok(())
}

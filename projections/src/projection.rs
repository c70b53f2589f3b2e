//! The projection machinery: what a projection declares (its tables and the
//! [`Subscriber`](ferry_store::Subscriber) per aggregate that writes them; the events arrive
//! decoded, [`ferry_store::events`]), and the runner that ties a projection to its
//! checkpoint and tables. Each bounded context's projections live in its folder (e.g.
//! `app/src/contexts/provisioning/views.rs`).

use ferry_store::database::Backend;
use ferry_store::stream::{
    run_subscriptions, Handler, HandlerError, Param, Position, Running, StoredEvent, Tx,
};
use ferry_store::{Database, Subscription};
use std::collections::HashMap;
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

fn text(v: impl ToString) -> Param {
    Param::Text(Some(v.to_string()))
}

fn int(v: impl Into<i64>) -> Param {
    Param::Int(Some(v.into()))
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
pub async fn index_shapes(tx: &mut Tx, table: &str) -> Result<Vec<IndexShape>, sqlx::Error> {
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
    /// The progress of the projections whose senders `senders` are (by name).
    pub fn of(senders: &HashMap<&'static str, watch::Sender<Position>>) -> Self {
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

//! The relay: a subscription on the global stream that publishes every stored event to
//! JetStream as a CloudEvent, exactly once per event id and in stream order.
//!
//! * Each event is published with `Nats-Msg-Id` = event id and the next one only after its
//!   PubAck, so per-aggregate order in NATS is the store's order.
//! * The checkpoint (`nats-relay:<stream>` in `subscription_checkpoints`) moves only after
//!   the PubAcks, in a short transaction of its own: no database transaction stays open
//!   while NATS is slow or down (an open one would hold back every reader of the stream).
//! * At start and after every reconnection the relay reads the `Ferry-Position` header of
//!   the stream's last Ferry message and moves its checkpoint there: back when NATS lost
//!   acknowledged messages (they are republished), forward when a crash came between
//!   PubAck and checkpoint (nothing is published twice). `Nats-Msg-Id` de-duplication
//!   within the stream's duplicate window is the second line of defence.
//! * On Postgres the relay holds an advisory lock (one leader per stream across
//!   instances); a standby takes over when the leader's connection goes away.
//! * While NATS is down commands still commit; the relay retries with a growing pause and
//!   catches up when NATS returns.

use crate::outbound::{parse_position, position_token, to_outbound, DEFAULT_SOURCE};
use crate::subjects::STREAM_SUBJECTS;
use async_nats::jetstream::{self, message::PublishMessage, stream};
use ferry_store::stream::read_after;
use ferry_store::{Database, Position, Tx};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

/// Header carrying the global stream position of an event (`txid.position`).
pub const POSITION_HEADER: &str = "Ferry-Position";

/// How many older stream messages the start-up check looks through for a Ferry message.
const RECONCILE_SCAN: u64 = 1000;

/// The relay's settings. Suggested environment: `NATS_URL`, `FERRY_NATS_STREAM`,
/// `FERRY_CLOUDEVENTS_SOURCE`, `FERRY_NATS_DUPLICATE_WINDOW_SECS`.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// NATS server URL(s), e.g. `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// The JetStream stream, created or updated at start (default `FERRY_EVENTS`).
    pub stream_name: String,
    /// CloudEvent `source` (default `urn:ferry`).
    pub source: String,
    /// The stream's duplicate window: republishing within it is dropped by NATS.
    pub duplicate_window: Duration,
    /// How often to look for new events when no commit signal arrives.
    pub poll: Duration,
    /// Events read per batch (the checkpoint moves once per batch).
    pub batch: i64,
    /// Subjects the stream stores (default [`STREAM_SUBJECTS`]). Drop one that another
    /// stream already owns (e.g. an external promotions service's `releases.promotions.>`).
    pub subjects: Vec<String>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            nats_url: "nats://127.0.0.1:4222".to_string(),
            stream_name: "FERRY_EVENTS".to_string(),
            source: DEFAULT_SOURCE.to_string(),
            duplicate_window: Duration::from_secs(2 * 60 * 60),
            poll: Duration::from_secs(1),
            batch: 256,
            subjects: STREAM_SUBJECTS.iter().map(|s| s.to_string()).collect(),
        }
    }
}

impl RelayConfig {
    /// The relay's checkpoint name in `subscription_checkpoints`.
    pub fn checkpoint_name(&self) -> String {
        format!("nats-relay:{}", self.stream_name)
    }
}

/// Counters of the relay, for `/metrics` and tests.
#[derive(Debug, Default)]
pub struct RelayMetrics {
    /// Messages acknowledged by JetStream (duplicates included).
    pub published: AtomicU64,
    /// Of those, messages JetStream reported as duplicates (already stored).
    pub duplicates: AtomicU64,
    /// Integration events published with the domain fallback (a mapping bug).
    pub degraded: AtomicU64,
    /// Publish or stream-setup failures (each followed by a retry).
    pub failures: AtomicU64,
    /// Events the start-up check found missing in NATS and republished.
    pub rewound: AtomicU64,
    /// Events the start-up check found already stored past the checkpoint (not republished).
    pub skipped: AtomicU64,
    /// Global position of the last event whose checkpoint was saved.
    pub checkpoint: AtomicI64,
}

impl RelayMetrics {
    /// The counters in Prometheus text format, labelled with the stream.
    pub fn render(&self, stream: &str) -> String {
        let rows = [
            (
                "ferry_nats_relay_published_total",
                "Messages acknowledged by JetStream.",
                &self.published,
            ),
            (
                "ferry_nats_relay_duplicates_total",
                "Acknowledged messages JetStream reported as duplicates.",
                &self.duplicates,
            ),
            (
                "ferry_nats_relay_degraded_total",
                "Integration events published with the domain fallback.",
                &self.degraded,
            ),
            (
                "ferry_nats_relay_failures_total",
                "Failed relay steps (retried).",
                &self.failures,
            ),
            (
                "ferry_nats_relay_republished_total",
                "Events republished because NATS lost them.",
                &self.rewound,
            ),
            (
                "ferry_nats_relay_skipped_total",
                "Events found already stored past the checkpoint.",
                &self.skipped,
            ),
        ];
        let mut out = String::new();
        for (name, help, value) in rows {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{stream=\"{stream}\"}} {}\n",
                value.load(Ordering::Relaxed)
            ));
        }
        out.push_str(&format!(
            "# HELP ferry_nats_relay_checkpoint_position Global position of the relay's checkpoint.\n# TYPE ferry_nats_relay_checkpoint_position gauge\nferry_nats_relay_checkpoint_position{{stream=\"{stream}\"}} {}\n",
            self.checkpoint.load(Ordering::Relaxed)
        ));
        out
    }
}

/// Why the relay could not start or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The NATS client could not be set up.
    #[error(transparent)]
    Connect(#[from] crate::nats::ConnectError),
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] sqlx::Error),
    /// JetStream refused or did not answer.
    #[error("jetstream: {0}")]
    Nats(String),
    /// An event could not be serialized.
    #[error("serialize: {0}")]
    Serialize(#[from] serde_json::Error),
}

fn nats_err(e: impl std::fmt::Display) -> RelayError {
    RelayError::Nats(e.to_string())
}

/// A running relay.
pub struct Relay {
    handle: JoinHandle<()>,
    metrics: Arc<RelayMetrics>,
}

impl Relay {
    /// Starts the relay. Returns at once, also when NATS is unreachable (it keeps trying).
    pub async fn start(
        db: Database,
        config: RelayConfig,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Self, RelayError> {
        let connection = crate::nats::connect(&config.nats_url, "ferry-relay").await?;
        let metrics = Arc::new(RelayMetrics::default());
        let worker = Worker {
            db,
            js: jetstream::new(connection.client),
            connected: connection.connected,
            config,
            metrics: metrics.clone(),
            leader: None,
        };
        let span = tracing::info_span!("nats_relay", stream = %worker.config.stream_name);
        let handle = tokio::spawn(worker.run(shutdown).instrument(span));
        Ok(Self { handle, metrics })
    }

    /// The relay's counters.
    pub fn metrics(&self) -> Arc<RelayMetrics> {
        self.metrics.clone()
    }

    /// Waits until the relay stopped (after `shutdown` turned true).
    pub async fn join(self) {
        if let Err(error) = self.handle.await {
            tracing::error!(%error, "relay task ended abnormally");
        }
    }

    /// Stops the task at once, wherever it is (tests use it to simulate a crash).
    pub fn abort(&self) {
        self.handle.abort();
    }
}

struct Worker {
    db: Database,
    js: jetstream::Context,
    connected: watch::Receiver<u64>,
    config: RelayConfig,
    metrics: Arc<RelayMetrics>,
    /// On Postgres, the connection holding the advisory lock (dropped = lock released).
    leader: Option<sqlx::PgConnection>,
}

impl Worker {
    /// True when this relay may publish: always on SQLite (one process), on Postgres while
    /// it holds the stream's advisory lock on a connection of its own (outside the pool, so
    /// that a crashed relay's lock goes away with its connection).
    async fn lead(&mut self) -> bool {
        use sqlx::Connection;
        let ferry_store::database::Pool::Postgres(pool) = self.db.pool() else {
            return true;
        };
        if let Some(conn) = self.leader.as_mut() {
            if sqlx::query("SELECT 1").execute(&mut *conn).await.is_ok() {
                return true;
            }
            tracing::warn!("lost the relay's lock connection; trying to lead again");
            self.leader = None;
        }
        let options = pool.connect_options();
        let mut conn = match sqlx::PgConnection::connect_with(&options).await {
            Ok(c) => c,
            Err(error) => {
                tracing::warn!(%error, "cannot open the relay's lock connection");
                return false;
            }
        };
        let key = format!("ferry:{}", self.config.checkpoint_name());
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
            .bind(key)
            .fetch_one(&mut conn)
            .await
            .unwrap_or(false);
        if got {
            tracing::info!("this instance leads the relay");
            self.leader = Some(conn);
        }
        got
    }

    async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut commits = self.db.subscribe_commits();
        let mut ready = false;
        let mut backoff = Duration::from_millis(100);
        loop {
            if *shutdown.borrow() {
                return;
            }
            // A (re)connection may be to a server that lost messages: check again.
            if self.connected.has_changed().unwrap_or(false) {
                self.connected.mark_unchanged();
                ready = false;
            }
            if !self.lead().await {
                // Another instance publishes; stand by and check again.
                ready = false;
                tokio::select! {
                    _ = tokio::time::sleep(self.config.poll.max(Duration::from_secs(1))) => {}
                    _ = shutdown.changed() => {}
                }
                continue;
            }
            let step = async {
                if !ready {
                    self.prepare().await?;
                    ready = true;
                }
                self.pump().await
            };
            // Shutdown does not wait for a slow PubAck: an unsaved checkpoint only means the
            // next start lines up with the stream again.
            let step = tokio::select! {
                r = step => r,
                _ = shutdown.changed() => return,
            };
            match step {
                Ok(n) => {
                    backoff = Duration::from_millis(100);
                    if n >= usize::try_from(self.config.batch).unwrap_or(usize::MAX) {
                        continue; // more to read
                    }
                }
                Err(error) => {
                    self.metrics.failures.fetch_add(1, Ordering::Relaxed);
                    if matches!(error, RelayError::Nats(_)) {
                        ready = false;
                    }
                    tracing::warn!(%error, retry_in_ms = backoff.as_millis() as u64, "relay step failed");
                    // A reconnection ends the pause early: catch up as soon as NATS is back.
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = reconnected(&mut self.connected) => ready = false,
                        _ = shutdown.changed() => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                    continue;
                }
            }
            tokio::select! {
                _ = commits.changed() => {}
                _ = reconnected(&mut self.connected) => ready = false,
                _ = tokio::time::sleep(self.config.poll) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// Creates or updates the stream, then lines the checkpoint up with the stream's last
    /// Ferry message: behind it, NATS lost acknowledged messages (republish them); ahead of
    /// it, a crash came between PubAck and checkpoint (skip what is already stored, so
    /// nothing is duplicated even after the duplicate window).
    async fn prepare(&self) -> Result<(), RelayError> {
        ensure_stream(&self.js, &self.config).await?;
        let name = self.config.checkpoint_name();
        let checkpoint = load_checkpoint(&self.db, &name).await?;
        let target = match last_ferry_position(&self.js, &self.config.stream_name).await? {
            LastPosition::Found(p) => p,
            LastPosition::NoFerryMessage => Position::default(),
            LastPosition::Unknown => {
                tracing::warn!(
                    "no Ferry message among the stream's newest; keeping the checkpoint"
                );
                return Ok(());
            }
        };
        if target < checkpoint {
            let missing = count_between(&self.db, target, checkpoint).await?;
            tracing::warn!(
                stream_last = %position_token(target),
                checkpoint = %position_token(checkpoint),
                missing,
                "the stream lacks events the relay had published; republishing them"
            );
            self.metrics.rewound.fetch_add(missing, Ordering::Relaxed);
            move_checkpoint(&self.db, &name, target, true).await?;
        } else if target > checkpoint {
            let stored = count_between(&self.db, checkpoint, target).await?;
            tracing::info!(
                stream_last = %position_token(target),
                checkpoint = %position_token(checkpoint),
                stored,
                "the stream already holds events past the checkpoint; skipping them"
            );
            self.metrics.skipped.fetch_add(stored, Ordering::Relaxed);
            move_checkpoint(&self.db, &name, target, false).await?;
        }
        Ok(())
    }

    /// Publishes one batch after the checkpoint; returns how many events it took.
    async fn pump(&self) -> Result<usize, RelayError> {
        let name = self.config.checkpoint_name();
        let from = load_checkpoint(&self.db, &name).await?;
        let events = read_after(&self.db, from, self.config.batch).await?;
        let mut done: Option<Position> = None;
        let mut result = Ok(());
        for event in &events {
            match self.publish(event).await {
                Ok(()) => done = Some(event.position),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // Save what was acknowledged even when a later publish failed.
        if let Some(to) = done {
            move_checkpoint(&self.db, &name, to, false).await?;
            self.metrics
                .checkpoint
                .store(to.global_position, Ordering::Relaxed);
        }
        result.map(|()| events.len())
    }

    async fn publish(&self, event: &ferry_store::StoredEvent) -> Result<(), RelayError> {
        let out = to_outbound(&self.db, &self.config.source, event).await?;
        if out.degraded.is_some() {
            self.metrics.degraded.fetch_add(1, Ordering::Relaxed);
        }
        let body = out.event.to_bytes()?;
        let message = PublishMessage::build()
            .payload(body.into())
            .message_id(event.event_id.to_string())
            .header(POSITION_HEADER, position_token(event.position).as_str());
        let ack = self
            .js
            .send_publish(out.subject.clone(), message)
            .await
            .map_err(nats_err)?
            .await
            .map_err(nats_err)?;
        if ack.stream != self.config.stream_name {
            tracing::warn!(subject = %out.subject, stream = %ack.stream, "subject stored by another stream");
        }
        self.metrics.published.fetch_add(1, Ordering::Relaxed);
        if ack.duplicate {
            self.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
        }
        tracing::debug!(subject = %out.subject, id = %out.event.id, seq = ack.sequence, "published");
        Ok(())
    }
}

/// Resolves on the next (re)connection to NATS; never when the client is gone.
async fn reconnected(connected: &mut watch::Receiver<u64>) {
    if connected.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Creates the stream, or adds Ferry's subjects and duplicate window to an existing one
/// (keeping the operator's other settings, e.g. replicas and limits).
pub async fn ensure_stream(
    js: &jetstream::Context,
    config: &RelayConfig,
) -> Result<stream::Info, RelayError> {
    match js.get_stream(&config.stream_name).await {
        Ok(mut existing) => {
            let mut wanted = existing.info().await.map_err(nats_err)?.config.clone();
            let mut changed = wanted.duplicate_window != config.duplicate_window;
            wanted.duplicate_window = config.duplicate_window;
            for s in &config.subjects {
                if !wanted.subjects.iter().any(|x| x == s) {
                    wanted.subjects.push(s.clone());
                    changed = true;
                }
            }
            if changed {
                js.update_stream(wanted).await.map_err(nats_err)
            } else {
                Ok(existing.cached_info().clone())
            }
        }
        Err(e)
            if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            let created = js
                .create_stream(stream::Config {
                    name: config.stream_name.clone(),
                    subjects: config.subjects.clone(),
                    duplicate_window: config.duplicate_window,
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(nats_err)?;
            Ok(created.cached_info().clone())
        }
        Err(e) => Err(nats_err(e)),
    }
}

/// What the stream says about the last event Ferry published into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LastPosition {
    /// The newest Ferry message carries this position.
    Found(Position),
    /// The stream holds no Ferry message at all.
    NoFerryMessage,
    /// The newest messages (up to the scan limit) are not Ferry's: nothing can be said.
    Unknown,
}

/// The position of the newest message in the stream that Ferry published.
pub async fn last_ferry_position(
    js: &jetstream::Context,
    stream_name: &str,
) -> Result<LastPosition, RelayError> {
    let mut stream = js.get_stream(stream_name).await.map_err(nats_err)?;
    let state = stream.info().await.map_err(nats_err)?.state.clone();
    if state.messages == 0 {
        return Ok(LastPosition::NoFerryMessage);
    }
    let lowest = state
        .first_sequence
        .max(state.last_sequence.saturating_sub(RECONCILE_SCAN));
    let mut seq = state.last_sequence;
    while seq >= lowest && seq > 0 {
        // A deleted message in between is skipped, not fatal.
        if let Ok(message) = stream.get_raw_message(seq).await {
            if let Some(p) = message
                .headers
                .get(POSITION_HEADER)
                .and_then(|v| parse_position(v.as_str()))
            {
                return Ok(LastPosition::Found(p));
            }
        }
        seq -= 1;
    }
    Ok(if lowest <= state.first_sequence {
        LastPosition::NoFerryMessage
    } else {
        LastPosition::Unknown
    })
}

async fn load_checkpoint(db: &Database, name: &str) -> Result<Position, sqlx::Error> {
    let mut tx = Tx::begin(db).await?;
    let p = tx.claim_checkpoint(name).await?;
    tx.commit().await?;
    Ok(p)
}

/// Moves the checkpoint to `to`; only forward unless `backward` (the start-up rewind), so
/// that a slower second relay never undoes a faster one's progress.
async fn move_checkpoint(
    db: &Database,
    name: &str,
    to: Position,
    backward: bool,
) -> Result<(), sqlx::Error> {
    let mut tx = Tx::begin(db).await?;
    let current = tx.claim_checkpoint(name).await?;
    if backward || to > current {
        tx.save_checkpoint(name, to).await?;
    }
    tx.commit().await
}

/// Events after `from` up to and including `to` (for logs and counters).
async fn count_between(db: &Database, from: Position, to: Position) -> Result<u64, sqlx::Error> {
    let mut n = 0u64;
    let mut at = from;
    loop {
        let batch = read_after(db, at, 1000).await?;
        let Some(last) = batch.last().map(|e| e.position) else {
            return Ok(n);
        };
        for e in &batch {
            if e.position > to {
                return Ok(n);
            }
            n += 1;
        }
        at = last;
    }
}

//! The relay: a subscription on the global stream that publishes every stored event to
//! JetStream as a CloudEvent, exactly once per event id, in stream order, with no gap.
//!
//! * Each event is published with `Nats-Msg-Id` = event id, in stream order on one
//!   connection, up to 256 PubAcks outstanding: NATS stores one connection's publishes in the
//!   order sent, so per-aggregate order in NATS is the store's order.
//! * **Every publish states what must come before it**: `Nats-Expected-Last-Sequence` is the
//!   stream sequence of the relay's previous publish (its PubAck's, or that plus the
//!   publishes still in flight; the stream's last message's when the relay lined up with it).
//!   A refused publish leaves the stream as it was, so every publish in flight after it is
//!   refused as well. A server that lost its unsynced tail, or a stream deleted and
//!   made anew, has another last sequence and refuses the publish, so a loss can never turn
//!   into a gap in the middle of the stream. The relay then repairs from the last message
//!   NATS really has (below).
//! * The checkpoint (`nats-relay:<stream>` in `subscription_checkpoints`) moves only after
//!   the PubAcks, in a short transaction of its own: no database transaction stays open
//!   while NATS is slow or down (an open one would hold back every reader of the stream).
//! * Reading, encoding and publishing overlap, each on a task of its own: while one batch
//!   is published the next is encoded and the one after it read (see `Worker::pump`).
//! * **Lining up** (at start, after every reconnection and after a refused publish): the
//!   relay reads the `Ferry-Position` header of the stream's newest Ferry message. Behind the
//!   checkpoint, NATS lost messages it had acknowledged: exactly those are proven lost and
//!   republished. Ahead of it, a crash came between PubAck and checkpoint: nothing is
//!   published twice. A stream that holds **no** Ferry message although the relay had
//!   published (purged, emptied by a lost store, aged out by its limits) proves nothing
//!   about what its consumers read: it is reported (log, `ferry_nats_relay_stream_resets_total`,
//!   `/readyz`) and history is **not** replayed; new events go on from the checkpoint. A read
//!   of the stream that fails is an error to retry, never taken for "no message".
//! * Events are decoded before they are published ([`crate::outbound`]): one that does not
//!   decode stops the relay at it, shown by `/readyz` and retried; nothing after it is
//!   published meanwhile, and it is never skipped.
//! * Failures carry their cause. One that only a change of configuration fixes (e.g. the
//!   stream's subjects overlap another stream's) is logged once as an error saying what to
//!   change, shown by `/readyz`, and retried slowly.
//! * On Postgres the relay holds an advisory lock (one leader per stream across
//!   instances); a standby takes over when the leader's connection goes away.
//! * While NATS is down commands still commit; the relay retries with a growing pause and
//!   catches up when NATS returns.

use crate::health::{self, ErrorReport, NatsFailure};
use crate::inbound::subject_matches;
use crate::metrics::{Family, ScrapeCollector};
use crate::outbound::{parse_position, position_token, DEFAULT_SOURCE};
use crate::publish::{EncodeError, Publishers};
use crate::subjects::STREAM_SUBJECTS;
use async_nats::jetstream::{self, message::PublishMessage, stream};
use chrono::{DateTime, Utc};
use ferry_store::events::{DecodeError, ReadError};
use ferry_store::stream::read_after;
use ferry_store::{Database, Position, StoredEvent, Tx};
use prometheus::proto::MetricFamily;
use prometheus::Registry;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

/// Header carrying the global stream position of an event (`txid.position`).
pub const POSITION_HEADER: &str = "Ferry-Position";

/// How many older stream messages the line-up looks through for a Ferry message.
const RECONCILE_SCAN: u64 = 1000;

/// The start of the error reported while the leader lock's connection cannot be opened.
const LOCK_ERROR: &str = "cannot open the relay's leader-lock connection to the store";

/// The relay's settings. Suggested environment: `NATS_URL`, `FERRY_NATS_STREAM`,
/// `FERRY_CLOUDEVENTS_SOURCE`, `FERRY_NATS_DUPLICATE_WINDOW_SECS`.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// NATS server URL(s), e.g. `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// Ferry's NATS user and TLS (default: anonymous, TLS as the URL says).
    pub nats_auth: crate::nats::NatsAuth,
    /// The JetStream stream, created or updated at start (default `FERRY_EVENTS`).
    pub stream_name: String,
    /// CloudEvent `source` (default `urn:ferry`).
    pub source: String,
    /// The stream's duplicate window: republishing within it is dropped by NATS.
    pub duplicate_window: Duration,
    /// How often to look for new events when no commit signal arrives.
    pub poll: Duration,
    /// Events read per batch (batches are read and encoded while earlier ones publish).
    pub batch: i64,
    /// Subjects the stream stores (default [`STREAM_SUBJECTS`]). No other service may
    /// publish on them: every publish expects the stream's last sequence to be the relay's.
    pub subjects: Vec<String>,
    /// How often an idle relay checks that the stream still holds what it published (a
    /// stream purged while nothing is published is reported within this time).
    pub check_interval: Duration,
    /// What each aggregate's events become (default: none, so every event goes on its
    /// domain subject as stored; the process gives every bounded context's).
    pub publishers: Publishers,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            nats_url: "nats://127.0.0.1:4222".to_string(),
            nats_auth: crate::nats::NatsAuth::default(),
            stream_name: "FERRY_EVENTS".to_string(),
            source: DEFAULT_SOURCE.to_string(),
            duplicate_window: Duration::from_secs(2 * 60 * 60),
            poll: Duration::from_secs(1),
            batch: 1024,
            subjects: STREAM_SUBJECTS.iter().map(|s| s.to_string()).collect(),
            check_interval: Duration::from_secs(30),
            publishers: Publishers::new(),
        }
    }
}

impl RelayConfig {
    /// The relay's checkpoint name in `subscription_checkpoints`.
    pub fn checkpoint_name(&self) -> String {
        format!("nats-relay:{}", self.stream_name)
    }
}

/// What the relay is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub enum RelayRole {
    /// Not yet connected or lined up.
    #[default]
    Starting,
    /// Publishing (the only instance that does, on Postgres).
    Leader,
    /// Another instance publishes; this one waits to take over.
    Standby,
}

/// A stream found holding none of the messages the relay had published.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamReset {
    /// When the relay found it.
    pub at: DateTime<Utc>,
    /// The relay's checkpoint then: every event up to it had been acknowledged by NATS.
    pub checkpoint: String,
    /// The stream's first and last sequence and message count then.
    pub stream_first_sequence: u64,
    /// See `stream_first_sequence`.
    pub stream_last_sequence: u64,
    /// See `stream_first_sequence`.
    pub stream_messages: u64,
    /// True when the stream's own limits (age, count, size) can explain it; false when only a
    /// purge, a deletion or a lost store can.
    pub explained_by_limits: bool,
    /// Still true while the stream holds no message the relay published since.
    pub open: bool,
}

/// The last repair: messages NATS had acknowledged and then lost, republished.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Repair {
    /// When.
    pub at: DateTime<Utc>,
    /// The position of the stream's newest Ferry message (republishing starts after it).
    pub stream_last: String,
    /// The checkpoint the relay had reached.
    pub checkpoint: String,
    /// How many events were republished.
    pub events: u64,
}

/// The relay's state, for `/readyz`.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct RelayStatus {
    /// Leader, standby or starting.
    pub role: RelayRole,
    /// The stream sequence the next publish expects to follow (`Nats-Expected-Last-Sequence`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected_last_sequence: Option<u64>,
    /// When the last PubAck came.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_published_at: Option<DateTime<Utc>>,
    /// The last error, until a step succeeds again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<ErrorReport>,
    /// The last time the stream was found holding none of the relay's messages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_reset: Option<StreamReset>,
    /// The last republication of messages NATS lost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_repair: Option<Repair>,
}

/// Counters and state of the relay, for `/metrics`, `/readyz` and tests.
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
    /// Events found missing in NATS after it had acknowledged them, and republished.
    pub rewound: AtomicU64,
    /// Events the line-up found already stored past the checkpoint (not republished).
    pub skipped: AtomicU64,
    /// Publishes NATS refused because the stream's last sequence was not the expected one.
    pub refused: AtomicU64,
    /// Times the stream was found holding none of the relay's messages (not replayed).
    pub stream_resets: AtomicU64,
    /// Global position of the last event whose checkpoint was saved.
    pub checkpoint: AtomicI64,
    status: Mutex<RelayStatus>,
}

impl RelayMetrics {
    /// The relay's state now.
    pub fn status(&self) -> RelayStatus {
        self.status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn update(&self, change: impl FnOnce(&mut RelayStatus)) {
        change(
            &mut self
                .status
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
    }

    /// The lines `/readyz` lists among its problems.
    pub fn problems(&self, stream: &str) -> Vec<String> {
        let status = self.status();
        let mut out = Vec::new();
        if let Some(e) = &status.last_error {
            out.push(e.problem(&format!("the NATS relay to {stream}")));
        }
        // A stream whose own limits remove old messages empties by design: status only.
        if let Some(r) = status
            .stream_reset
            .as_ref()
            .filter(|r| r.open && !r.explained_by_limits)
        {
            out.push(format!(
                "stream {stream} holds none of the events the relay published up to position {} \
                 (found at {}; the stream has no limits that remove messages: it was purged or \
                 NATS lost its store): they were not republished, and consumers that had not \
                 read them will not see them unless an operator runs `ferry relay replay`",
                r.checkpoint,
                r.at.to_rfc3339(),
            ));
        }
        out
    }

    /// The relay's families, each sample labelled with `stream`: its counters and its
    /// checkpoint, failing and leader gauges as they are now.
    fn families(&self, stream: &str) -> Vec<MetricFamily> {
        let mut out: Vec<MetricFamily> = RELAY_COUNTERS
            .iter()
            .map(|(family, read)| family.one(vec![stream], read(self) as f64))
            .collect();
        let status = self.status();
        let failing = match &status.last_error {
            None => 0.0,
            Some(e) if e.permanent => 2.0,
            Some(_) => 1.0,
        };
        out.push(
            RELAY_CHECKPOINT.one(vec![stream], self.checkpoint.load(Ordering::Relaxed) as f64),
        );
        out.push(RELAY_FAILING.one(vec![stream], failing));
        out.push(RELAY_LEADER.one(
            vec![stream],
            f64::from(u8::from(status.role == RelayRole::Leader)),
        ));
        out
    }

    /// [`RelayMetrics::families`] in the Prometheus text format.
    pub fn render(&self, stream: &str) -> String {
        crate::metrics::encode(self.families(stream))
    }

    /// Registers the relay's families, labelled with `stream`, in `registry` (the
    /// process's, served at `/metrics`); they are read from this relay at each scrape.
    pub fn register(self: &Arc<Self>, registry: &Registry, stream: &str) -> prometheus::Result<()> {
        let metrics = self.clone();
        let stream = stream.to_string();
        registry.register(Box::new(ScrapeCollector::new(
            RELAY_COUNTERS
                .iter()
                .map(|(family, _)| family)
                .chain(&RELAY_GAUGES),
            move || metrics.families(&stream),
        )?))
    }
}

/// Reads one counter of the relay.
type ReadCounter = fn(&RelayMetrics) -> u64;

/// The relay's counters, with the field each is read from.
const RELAY_COUNTERS: [(Family, ReadCounter); 8] = [
    (
        Family::counter(
            "ferry_nats_relay_published_total",
            "Messages acknowledged by JetStream.",
            &["stream"],
        ),
        |m| m.published.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_nats_relay_duplicates_total",
            "Acknowledged messages JetStream reported as duplicates.",
            &["stream"],
        ),
        |m| m.duplicates.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_nats_relay_degraded_total",
            "Integration events published with the domain fallback.",
            &["stream"],
        ),
        |m| m.degraded.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_nats_relay_failures_total",
            "Failed relay steps (retried).",
            &["stream"],
        ),
        |m| m.failures.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_nats_relay_republished_total",
            "Events republished because NATS lost them after acknowledging them.",
            &["stream"],
        ),
        |m| m.rewound.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_nats_relay_skipped_total",
            "Events found already stored past the checkpoint.",
            &["stream"],
        ),
        |m| m.skipped.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_nats_relay_refused_total",
            "Publishes NATS refused because the stream's last sequence was not the expected one.",
            &["stream"],
        ),
        |m| m.refused.load(Ordering::Relaxed),
    ),
    (
        Family::counter(
            "ferry_nats_relay_stream_resets_total",
            "Times the stream held none of the relay's messages (history not replayed).",
            &["stream"],
        ),
        |m| m.stream_resets.load(Ordering::Relaxed),
    ),
];

const RELAY_CHECKPOINT: Family = Family::gauge(
    "ferry_nats_relay_checkpoint_position",
    "Global position of the relay's checkpoint.",
    &["stream"],
);
const RELAY_FAILING: Family = Family::gauge(
    "ferry_nats_relay_failing",
    "1 while the relay fails (2: until its configuration changes).",
    &["stream"],
);
const RELAY_LEADER: Family = Family::gauge(
    "ferry_nats_relay_leader",
    "1 while this instance publishes.",
    &["stream"],
);
/// The relay's gauges.
const RELAY_GAUGES: [Family; 3] = [RELAY_CHECKPOINT, RELAY_FAILING, RELAY_LEADER];

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
    Nats(#[from] NatsFailure),
    /// JetStream refused a publish because the stream's last sequence is not the one the
    /// relay expected: it lost messages, or was replaced, or another publisher wrote to it.
    #[error("NATS refused the publish: the stream's last sequence is not {expected} (it lost messages, was made anew, or another publisher wrote to it)")]
    StreamChanged {
        /// The sequence the relay expected to follow.
        expected: u64,
    },
    /// An aggregate's stored history has a hole where an event should be.
    #[error("store: {0}")]
    History(Box<ReadError>),
    /// The task reading and encoding the stream's batches ended without a batch (it
    /// panicked); the relay starts it again.
    #[error("the relay's reader stopped unexpectedly")]
    Stopped,
    /// An event could not be serialized.
    #[error("serialize: {0}")]
    Serialize(#[from] serde_json::Error),
    /// A stored event of one of Ferry's aggregates does not decode: the relay publishes
    /// nothing past it and retries until it does (it is never skipped).
    #[error("event {event_id} at position {position} cannot be published: {source}")]
    Undecodable {
        /// The event.
        event_id: uuid::Uuid,
        /// Its position (`txid.position`).
        position: String,
        /// Why it does not decode.
        source: DecodeError,
    },
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
        let connection =
            crate::nats::connect(&config.nats_url, &config.nats_auth, "ferry-relay").await?;
        let metrics = Arc::new(RelayMetrics::default());
        let worker = Worker {
            db,
            js: jetstream::new(connection.client),
            connected: connection.connected,
            config,
            metrics: metrics.clone(),
            leader: None,
            anchor: None,
            stored_subjects: Vec::new(),
        };
        let span = tracing::info_span!("nats_relay", stream = %worker.config.stream_name);
        let handle = tokio::spawn(worker.run(shutdown).instrument(span));
        Ok(Self { handle, metrics })
    }

    /// The relay's counters and state.
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
    /// The stream sequence the next publish must follow; `None` until lined up.
    anchor: Option<u64>,
    /// The subjects the stream stores (the expectation is only sent for those).
    stored_subjects: Vec<String>,
}

/// Reads the stream's batches and encodes their messages, each on a task of its own, while
/// the relay publishes (see [`Worker::pump`]). It owns what it needs.
struct Encoder {
    db: Database,
    publishers: Publishers,
    source: String,
    limit: i64,
}

/// A batch read after a checkpoint: the messages up to the first event that could not be
/// encoded, and why that one could not.
struct Batch {
    /// True when the read returned as many events as it asked for: there may be more.
    full: bool,
    ready: Vec<Ready>,
    failure: Option<RelayError>,
}

/// One event's message, encoded and ready to send.
struct Ready {
    position: Position,
    position_token: String,
    subject: String,
    /// The CloudEvent id (the event id): also the message id NATS deduplicates by.
    id: String,
    body: bytes::Bytes,
    degraded: bool,
}

impl Encoder {
    /// Reads the batches after `from` (one task) and encodes them (this one), sending each
    /// to `out` in order; stops after a batch that is not full, that holds an event it could
    /// not encode, or whose read failed, and when `out` is closed. Each stage waits for the
    /// next to take its last batch, so at most a few batches are in memory.
    async fn run(self, from: Position, out: mpsc::Sender<Result<Batch, RelayError>>) {
        let (read_to, mut reads) = mpsc::channel::<Result<Vec<StoredEvent>, sqlx::Error>>(1);
        let (db, limit) = (self.db.clone(), self.limit);
        let full = usize::try_from(limit).unwrap_or(usize::MAX);
        let reader = tokio::spawn(
            async move {
                let mut at = from;
                loop {
                    let read = read_after(&db, at, limit).await;
                    let next = match &read {
                        Ok(events) if events.len() >= full => events.last().map(|e| e.position),
                        _ => None,
                    };
                    if read_to.send(read).await.is_err() {
                        return;
                    }
                    match next {
                        Some(last) => at = last,
                        None => return,
                    }
                }
            }
            .in_current_span(),
        );
        while let Some(read) = reads.recv().await {
            let batch = match read {
                Ok(events) => Ok(self.encode_all(events).await),
                Err(e) => Err(RelayError::Store(e)),
            };
            let more = matches!(&batch, Ok(b) if b.full && b.failure.is_none());
            if out.send(batch).await.is_err() || !more {
                break;
            }
        }
        reader.abort();
    }

    /// Encodes `events` in order, stopping at the first that cannot be (its error is the
    /// batch's failure).
    async fn encode_all(&self, events: Vec<StoredEvent>) -> Batch {
        let mut batch = Batch {
            full: events.len() >= usize::try_from(self.limit).unwrap_or(usize::MAX),
            ready: Vec::with_capacity(events.len()),
            failure: None,
        };
        for event in &events {
            match self.encode(event).await {
                Ok(ready) => batch.ready.push(ready),
                Err(e) => {
                    batch.failure = Some(e);
                    break;
                }
            }
        }
        batch
    }

    async fn encode(&self, event: &StoredEvent) -> Result<Ready, RelayError> {
        let position_token = position_token(event.position);
        let out = self
            .publishers
            .encode(&self.db, &self.source, event, &position_token)
            .await
            .map_err(|e| match e {
                EncodeError::Read(ReadError::Sql(e)) => RelayError::Store(e),
                EncodeError::Read(ReadError::Decode(source)) => RelayError::Undecodable {
                    event_id: event.event_id,
                    position: position_token.clone(),
                    source,
                },
                EncodeError::Read(gap @ ReadError::Gap { .. }) => {
                    RelayError::History(Box::new(gap))
                }
                EncodeError::Serialize(e) => RelayError::Serialize(e),
            })?;
        Ok(Ready {
            position: event.position,
            position_token,
            body: out.body.into(),
            id: event.event_id.to_string(),
            subject: out.subject,
            degraded: out.degraded,
        })
    }
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
        // Bounded: a lock connection to a server that vanished must not hang the relay.
        let bound = Duration::from_secs(10);
        if let Some(conn) = self.leader.as_mut() {
            let alive = tokio::time::timeout(bound, sqlx::query("SELECT 1").execute(&mut *conn));
            if matches!(alive.await, Ok(Ok(_))) {
                return true;
            }
            tracing::warn!("lost the relay's lock connection; trying to lead again");
            self.leader = None;
        }
        // The server notices a vanished leader within about 25 s (keepalives on its side of
        // this connection) and frees the lock for a standby.
        let options = pool.connect_options().as_ref().clone().options([
            ("tcp_keepalives_idle", "10"),
            ("tcp_keepalives_interval", "5"),
            ("tcp_keepalives_count", "3"),
        ]);
        let mut conn =
            match tokio::time::timeout(bound, sqlx::PgConnection::connect_with(&options)).await {
                Ok(Ok(c)) => c,
                outcome => {
                    let error = match outcome {
                        Ok(Err(e)) => e.to_string(),
                        _ => "timed out".to_string(),
                    };
                    tracing::warn!(%error, "cannot open the relay's lock connection");
                    // Nobody may be publishing: that is a problem to show, not a standby.
                    self.metrics.update(|s| {
                        let (r, _) = ErrorReport::next(
                            s.last_error.as_ref(),
                            format!("{LOCK_ERROR}: {error}"),
                            None,
                            None,
                        );
                        s.last_error = Some(r);
                    });
                    return false;
                }
            };
        let key = format!("ferry:{}", self.config.checkpoint_name());
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
            .bind(key)
            .fetch_one(&mut conn)
            .await
            .unwrap_or(false);
        self.metrics.update(|s| {
            if s.last_error
                .as_ref()
                .is_some_and(|e| e.error.starts_with(LOCK_ERROR))
            {
                s.last_error = None;
            }
        });
        if got {
            tracing::info!("this instance leads the relay");
            self.leader = Some(conn);
        }
        got
    }

    async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        // The checkpoint row exists from the start, so that `/readyz` shows the relay's lag
        // even while NATS cannot be reached (a failure here is retried by the first step).
        if let Err(error) = load_checkpoint(&self.db, &self.config.checkpoint_name()).await {
            tracing::warn!(%error, "cannot read the relay's checkpoint yet");
        }
        let mut commits = self.db.subscribe_commits();
        let mut backoff = Duration::from_millis(100);
        let mut refusals = 0u32;
        let mut next_check = tokio::time::Instant::now() + self.config.check_interval;
        loop {
            if *shutdown.borrow() {
                return;
            }
            // A (re)connection may be to a server that lost messages: line up again.
            if self.connected.has_changed().unwrap_or(false) {
                self.connected.mark_unchanged();
                self.anchor = None;
            }
            if !self.lead().await {
                self.stand_by(&mut shutdown).await;
                continue;
            }
            let step = async {
                if self.anchor.is_none() {
                    self.prepare().await?;
                }
                if tokio::time::Instant::now() >= next_check {
                    self.check_stream().await?;
                    next_check = tokio::time::Instant::now() + self.config.check_interval;
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
                Ok(more) => {
                    backoff = Duration::from_millis(100);
                    refusals = 0;
                    self.metrics.update(|s| {
                        s.role = RelayRole::Leader;
                        s.last_error = None;
                    });
                    if more {
                        continue;
                    }
                }
                Err(RelayError::StreamChanged { expected }) if refusals < 3 => {
                    // Not a fault of the relay's: line up with what NATS really has, now.
                    refusals += 1;
                    self.metrics.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        expected_last_sequence = expected,
                        "NATS refused a publish: the stream is not as the relay left it; lining up again"
                    );
                    self.anchor = None;
                    continue;
                }
                Err(error) => {
                    let permanent = self.report_failure(&error, backoff);
                    // A reconnection ends the pause early: catch up as soon as NATS is back.
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = reconnected(&mut self.connected) => self.anchor = None,
                        _ = shutdown.changed() => {}
                    }
                    let cap = if permanent { 60 } else { 10 };
                    backoff = (backoff * 2).min(Duration::from_secs(cap));
                    continue;
                }
            }
            tokio::select! {
                _ = commits.changed() => {}
                _ = reconnected(&mut self.connected) => self.anchor = None,
                _ = tokio::time::sleep(self.config.poll) => {}
                _ = tokio::time::sleep_until(next_check) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// Another instance publishes: stand by until the next check (or shutdown). What this
    /// instance reported as leader is the leader's to report now.
    async fn stand_by(&mut self, shutdown: &mut watch::Receiver<bool>) {
        self.anchor = None;
        self.metrics.update(|s| {
            s.role = RelayRole::Standby;
            s.expected_last_sequence = None;
            if s.last_error
                .as_ref()
                .is_some_and(|e| !e.error.starts_with(LOCK_ERROR))
            {
                s.last_error = None;
            }
            if let Some(r) = s.stream_reset.as_mut() {
                r.open = false;
            }
        });
        tokio::select! {
            _ = tokio::time::sleep(self.config.poll.max(Duration::from_secs(1))) => {}
            _ = shutdown.changed() => {}
        }
    }

    /// Counts, reports and logs a failed step (the next retry in `backoff`); true when the
    /// failure is permanent until an operator acts (NATS named a remedy), so retries slow
    /// down further.
    fn report_failure(&mut self, error: &RelayError, backoff: Duration) -> bool {
        self.metrics.failures.fetch_add(1, Ordering::Relaxed);
        // Line up again after any failure: e.g. a checkpoint that could not be saved after
        // PubAcks must be moved forward, not published again.
        self.anchor = None;
        let (code, remedy) = match error {
            RelayError::Nats(f) => (f.code, f.remedy().map(str::to_string)),
            _ => (None, None),
        };
        let permanent = remedy.is_some();
        let mut new = false;
        let mut report = None;
        self.metrics.update(|s| {
            let (r, n) = ErrorReport::next(s.last_error.as_ref(), error.to_string(), code, remedy);
            new = n;
            report = Some(r.clone());
            s.last_error = Some(r);
        });
        if let Some(report) = &report {
            health::log_failure("the NATS relay", report, new, backoff.as_millis() as u64);
        }
        permanent
    }

    /// Creates or updates the stream, then lines the checkpoint up with the stream's newest
    /// Ferry message: behind it, NATS lost acknowledged messages (exactly those are
    /// republished); ahead of it, a crash came between PubAck and checkpoint (skip what is
    /// already stored, so nothing is duplicated even after the duplicate window). A stream
    /// with no Ferry message proves nothing: it is reported, and nothing is replayed.
    async fn prepare(&mut self) -> Result<(), RelayError> {
        let info = ensure_stream(&self.js, &self.config).await?;
        self.stored_subjects = info.config.subjects.clone();
        let stream = self
            .js
            .get_stream_no_info(&self.config.stream_name)
            .await
            .map_err(|e| {
                let code = health::get_stream_error_code(&e);
                NatsFailure::with_code(format!("open stream {}", self.config.stream_name), code, e)
            })?;
        let state = info.state.clone();
        let name = self.config.checkpoint_name();
        let checkpoint = load_checkpoint(&self.db, &name).await?;
        self.metrics
            .checkpoint
            .store(checkpoint.global_position, Ordering::Relaxed);
        // Under interest or work-queue retention, consumed messages leave the stream: a
        // missing tail proves nothing there, so nothing is republished.
        let limits = info.config.retention == stream::RetentionPolicy::Limits;
        let (last, newest_id) = newest_ferry_message_in(&stream, &state).await?;
        match last {
            LastPosition::Found(target)
                if target > checkpoint
                    && newest_id.is_some()
                    && event_id_at(&self.db, target.global_position).await? != newest_id =>
            {
                // The stream holds an event this store does not have at that position (e.g.
                // the store was restored from a backup behind the stream): skipping ahead
                // would leave the store's own events there unpublished.
                tracing::error!(
                    stream_last = %position_token(target),
                    checkpoint = %position_token(checkpoint),
                    message_id = newest_id.as_deref().unwrap_or_default(),
                    "the stream's newest Ferry message is not this store's event at that position \
                     (a store restored behind the stream?); publishing from the checkpoint, not skipping"
                );
            }
            LastPosition::Found(target) if target < checkpoint && !limits => {
                tracing::warn!(
                    stream_last = %position_token(target),
                    checkpoint = %position_token(checkpoint),
                    "the stream's retention removes consumed messages: not republishing"
                );
            }
            LastPosition::Found(target) if target < checkpoint => {
                let missing = count_between(&self.db, target, checkpoint).await?;
                tracing::warn!(
                    stream_last = %position_token(target),
                    checkpoint = %position_token(checkpoint),
                    missing,
                    "NATS lost events it had acknowledged; republishing exactly those"
                );
                move_checkpoint(&self.db, &name, target, true).await?;
                // Counted once the move is saved: a failed save is retried, not counted.
                self.metrics.rewound.fetch_add(missing, Ordering::Relaxed);
                self.metrics
                    .checkpoint
                    .store(target.global_position, Ordering::Relaxed);
                self.metrics.update(|s| {
                    s.last_repair = Some(Repair {
                        at: Utc::now(),
                        stream_last: position_token(target),
                        checkpoint: position_token(checkpoint),
                        events: missing,
                    })
                });
            }
            LastPosition::Found(target) if target > checkpoint => {
                let stored = count_between(&self.db, checkpoint, target).await?;
                tracing::info!(
                    stream_last = %position_token(target),
                    checkpoint = %position_token(checkpoint),
                    stored,
                    "the stream already holds events past the checkpoint; skipping them"
                );
                move_checkpoint(&self.db, &name, target, false).await?;
                self.metrics.skipped.fetch_add(stored, Ordering::Relaxed);
                self.metrics
                    .checkpoint
                    .store(target.global_position, Ordering::Relaxed);
            }
            LastPosition::Found(_) => {}
            LastPosition::NoFerryMessage => {
                if checkpoint > Position::default() {
                    self.report_reset(&info, checkpoint);
                }
            }
            LastPosition::Unknown => {
                tracing::warn!(
                    scanned = RECONCILE_SCAN,
                    "no Ferry message among the stream's newest; keeping the checkpoint"
                );
            }
        }
        self.anchor = Some(state.last_sequence);
        self.metrics.update(|s| {
            s.role = RelayRole::Leader;
            s.expected_last_sequence = Some(state.last_sequence);
        });
        Ok(())
    }

    /// While idle: does the stream still hold the relay's last message? A stream purged
    /// since (its last sequence is kept, so publishes would still be accepted) is reported.
    async fn check_stream(&mut self) -> Result<(), RelayError> {
        let Some(anchor) = self.anchor.filter(|a| *a > 0) else {
            return Ok(());
        };
        let already = self
            .metrics
            .status()
            .stream_reset
            .is_some_and(|r| r.open && r.stream_last_sequence >= anchor);
        if already {
            return Ok(());
        }
        let mut stream = self
            .js
            .get_stream(&self.config.stream_name)
            .await
            .map_err(|e| {
                let code = health::get_stream_error_code(&e);
                NatsFailure::with_code(format!("open stream {}", self.config.stream_name), code, e)
            })?;
        let info = stream
            .info()
            .await
            .map_err(|e| NatsFailure::new(format!("read stream {}", self.config.stream_name), e))?
            .clone();
        if info.state.messages == 0 || info.state.first_sequence > anchor {
            let checkpoint = load_checkpoint(&self.db, &self.config.checkpoint_name()).await?;
            if checkpoint > Position::default() {
                self.report_reset(&info, checkpoint);
            }
        }
        Ok(())
    }

    /// Reports a stream that holds none of the relay's messages: log, metric, `/readyz`.
    fn report_reset(&self, info: &stream::Info, checkpoint: Position) {
        // Lining up again (e.g. after a reconnection) finds the same state: reported already.
        let same = self.metrics.status().stream_reset.is_some_and(|r| {
            r.open
                && r.stream_first_sequence == info.state.first_sequence
                && r.stream_last_sequence == info.state.last_sequence
                && r.checkpoint == position_token(checkpoint)
        });
        if same {
            return;
        }
        let c = &info.config;
        let explained_by_limits = c.retention != stream::RetentionPolicy::Limits
            || !c.max_age.is_zero()
            || c.max_messages >= 0
            || c.max_bytes >= 0
            || c.max_messages_per_subject >= 0;
        self.metrics.stream_resets.fetch_add(1, Ordering::Relaxed);
        let message = "the stream holds none of the events the relay published; they are not \
            republished (consumers that had not read them will not see them); new events go on \
            from the checkpoint";
        let (stream, at, first, last, messages) = (
            &self.config.stream_name,
            position_token(checkpoint),
            info.state.first_sequence,
            info.state.last_sequence,
            info.state.messages,
        );
        if explained_by_limits {
            tracing::warn!(%stream, checkpoint = %at, first, last, messages, "{message} (the stream's limits remove old messages)");
        } else {
            tracing::error!(%stream, checkpoint = %at, first, last, messages, "{message} (the stream has no limits: it was purged or NATS lost its store)");
        }
        self.metrics.update(|s| {
            s.stream_reset = Some(StreamReset {
                at: Utc::now(),
                checkpoint: position_token(checkpoint),
                stream_first_sequence: info.state.first_sequence,
                stream_last_sequence: info.state.last_sequence,
                stream_messages: info.state.messages,
                explained_by_limits,
                open: true,
            })
        });
    }

    /// Publishes the events after the checkpoint, a batch at a time, for up to
    /// [`PUMP_FOR`]; returns true when there may be more to read.
    ///
    /// Publishes are pipelined (up to [`IN_FLIGHT`] PubAcks outstanding, across batches):
    /// NATS stores one connection's publishes in the order sent, so the k-th publish after
    /// the last PubAck expects the stream's last sequence to be that PubAck's plus k. A
    /// publish refused for its expectation leaves the stream as it was, so every later one
    /// is refused too: the stream never gets a gap. A publish without an expectation (the
    /// first of a new stream, or a subject another stream stores) is sent alone, after every
    /// earlier PubAck.
    ///
    /// Reading, encoding and publishing overlap: while one batch is published the next is
    /// encoded and the one after it read, each on a task of its own (one task doing all
    /// three in turn kept the publishing waiting for the database). What is read ahead
    /// belongs to this pump only: the next starts again from the saved checkpoint, so an
    /// operator's replay or another leader's progress is always seen.
    ///
    /// The checkpoint is saved once per pump, after the PubAcks: a crash before the save
    /// only means the line-up skips what NATS already stores.
    async fn pump(&mut self) -> Result<bool, RelayError> {
        let name = self.config.checkpoint_name();
        let from = load_checkpoint(&self.db, &name).await?;
        let until = tokio::time::Instant::now() + PUMP_FOR;
        let (batches_to, mut batches) = mpsc::channel(1);
        let encoder = Encoder {
            db: self.db.clone(),
            publishers: self.config.publishers.clone(),
            source: self.config.source.clone(),
            limit: self.config.batch,
        };
        let encoding = tokio::spawn(encoder.run(from, batches_to).in_current_span());
        let mut window = Window::default();
        let mut done: Option<Position> = None;
        let mut publish_failed = false;
        let result = loop {
            let batch = match batches.recv().await {
                Some(Ok(batch)) => batch,
                Some(Err(e)) => break Err(e),
                // The encoder ends after the last batch it sends; only a panic ends it early.
                None => break Err(RelayError::Stopped),
            };
            if let Err(e) = self.publish(batch.ready, &mut window, &mut done).await {
                publish_failed = true;
                break Err(e);
            }
            // An event that could not be encoded stops the relay at it.
            if let Some(failure) = batch.failure {
                break Err(failure);
            }
            if !batch.full {
                break Ok(false);
            }
            if tokio::time::Instant::now() >= until {
                break Ok(true);
            }
        };
        encoding.abort();
        // After a failed publish the rest in flight is refused too: it is not waited for.
        // Otherwise (a read or an event that failed) what is in flight is acknowledged
        // first, and a failure of those earlier publishes is the one to report.
        let settled = if publish_failed {
            Ok(())
        } else {
            self.settle(&mut window, &mut done).await
        };
        // Save what was acknowledged, also when a later publish failed.
        if let Some(to) = done {
            move_checkpoint(&self.db, &name, to, false).await?;
            self.metrics
                .checkpoint
                .store(to.global_position, Ordering::Relaxed);
        }
        settled?;
        result
    }

    /// Sends `ready` in order through the window; `done` is the position of the last
    /// message acknowledged. After a failed send, what is in flight is settled first (an
    /// earlier publish's failure is the one to report).
    async fn publish(
        &mut self,
        ready: Vec<Ready>,
        window: &mut Window,
        done: &mut Option<Position>,
    ) -> Result<(), RelayError> {
        for message in ready {
            let ours = self
                .stored_subjects
                .iter()
                .any(|p| subject_matches(p, &message.subject));
            let mut predicted = self.predicted(window, ours);
            if predicted.is_none() && !window.in_flight.is_empty() {
                // Sent alone: its place in the stream must not depend on earlier publishes.
                self.settle(window, done).await?;
                predicted = self.predicted(window, ours);
            }
            match self.send(message, predicted).await {
                Ok(sent) => window.push(sent),
                Err(e) => {
                    self.settle(window, done).await?;
                    return Err(e);
                }
            }
            if predicted.is_none() {
                self.settle(window, done).await?;
            } else if window.in_flight.len() >= IN_FLIGHT {
                // A sliding window: one PubAck out, one publish in, so the pipe stays full.
                let first = window.pop().expect("not empty");
                *done = Some(self.acknowledged(first).await?);
            }
        }
        Ok(())
    }

    /// The stream's last sequence that the next publish must expect, given what is in
    /// flight; `None` when it must carry no expectation.
    fn predicted(&self, window: &Window, ours: bool) -> Option<u64> {
        // NATS ignores 0, so the first message of a new stream carries none.
        let anchor = self.anchor.filter(|a| *a > 0 && ours)?;
        if window.unexpected > 0 {
            return None;
        }
        Some(anchor + window.in_flight.len() as u64)
    }

    /// Waits for every PubAck in flight, in order.
    async fn settle(
        &mut self,
        window: &mut Window,
        done: &mut Option<Position>,
    ) -> Result<(), RelayError> {
        while let Some(first) = window.pop() {
            *done = Some(self.acknowledged(first).await?);
        }
        Ok(())
    }

    /// Sends one event's message; its PubAck is awaited by [`Worker::acknowledged`].
    async fn send(&mut self, ready: Ready, expected: Option<u64>) -> Result<InFlight, RelayError> {
        if ready.degraded {
            self.metrics.degraded.fetch_add(1, Ordering::Relaxed);
        }
        let mut message = PublishMessage::build()
            .payload(ready.body)
            .message_id(ready.id.as_str())
            .header(POSITION_HEADER, ready.position_token.as_str());
        // The expectation is checked by the stream that stores the subject: only send it to
        // ours.
        if let Some(seq) = expected {
            message = message.expected_last_sequence(seq);
        }
        let ack = self
            .js
            .send_publish(ready.subject.clone(), message)
            .await
            .map_err(|e| publish_failure(&ready.subject, &ready.id, expected, e))?;
        Ok(InFlight {
            position: ready.position,
            subject: ready.subject,
            id: ready.id,
            expected,
            ack,
        })
    }

    /// Waits for one publish's PubAck and records it; returns its event's position.
    async fn acknowledged(&mut self, sent: InFlight) -> Result<Position, RelayError> {
        let InFlight {
            position,
            subject,
            id,
            expected,
            ack,
        } = sent;
        let ack = ack
            .await
            .map_err(|e| publish_failure(&subject, &id, expected, e))?;
        if ack.stream != self.config.stream_name {
            tracing::warn!(%subject, stream = %ack.stream, "subject stored by another stream");
        } else if !ack.duplicate {
            // A duplicate is not appended: the stream's last sequence did not move (the
            // next publish in flight, if any, is refused and the relay lines up again).
            self.anchor = Some(ack.sequence);
        }
        self.metrics.published.fetch_add(1, Ordering::Relaxed);
        if ack.duplicate {
            self.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
        }
        let anchor = self.anchor;
        self.metrics.update(|s| {
            s.expected_last_sequence = anchor;
            s.last_published_at = Some(Utc::now());
            if let Some(r) = s.stream_reset.as_mut() {
                r.open = false;
            }
        });
        tracing::debug!(%subject, %id, seq = ack.sequence, "published");
        Ok(position)
    }
}

/// PubAcks the relay waits for at most at once.
const IN_FLIGHT: usize = 256;

/// How long one pump goes on publishing batch after batch before the relay checks its
/// leadership, the stream and the checkpoint (an operator's replay) again.
const PUMP_FOR: Duration = Duration::from_millis(500);

/// The publishes in flight, oldest first.
#[derive(Default)]
struct Window {
    in_flight: VecDeque<InFlight>,
    /// How many in flight carry no expectation (while any does, the next carries none).
    unexpected: usize,
}

impl Window {
    fn push(&mut self, sent: InFlight) {
        self.unexpected += usize::from(sent.expected.is_none());
        self.in_flight.push_back(sent);
    }

    fn pop(&mut self) -> Option<InFlight> {
        let first = self.in_flight.pop_front()?;
        self.unexpected -= usize::from(first.expected.is_none());
        Some(first)
    }
}

/// A publish sent and not yet acknowledged.
struct InFlight {
    position: Position,
    subject: String,
    id: String,
    expected: Option<u64>,
    ack: jetstream::context::PublishAckFuture,
}

/// What a refused or failed publish means to the relay.
fn publish_failure(
    subject: &str,
    id: &str,
    expected: Option<u64>,
    e: jetstream::context::PublishError,
) -> RelayError {
    match (e.kind(), expected) {
        (jetstream::context::PublishErrorKind::WrongLastSequence, Some(expected)) => {
            RelayError::StreamChanged { expected }
        }
        (jetstream::context::PublishErrorKind::MaxPayloadExceeded, _) => RelayError::Nats(
            NatsFailure::new(format!("publish {subject} (event {id})"), e)
                .with_remedy(health::MAX_PAYLOAD_REMEDY),
        ),
        _ => RelayError::Nats(NatsFailure::new(format!("publish {subject}"), e)),
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
    let name = &config.stream_name;
    match js.get_stream(name).await {
        Ok(mut existing) => {
            let mut wanted = existing
                .info()
                .await
                .map_err(|e| NatsFailure::new(format!("read stream {name}"), e))?
                .config
                .clone();
            let mut changed = wanted.duplicate_window != config.duplicate_window;
            wanted.duplicate_window = config.duplicate_window;
            for s in &config.subjects {
                if !wanted.subjects.iter().any(|x| x == s) {
                    wanted.subjects.push(s.clone());
                    changed = true;
                }
            }
            if changed {
                match js.update_stream(wanted).await {
                    Ok(info) => Ok(info),
                    Err(e) => Err(stream_failure(js, config, "update", e).await),
                }
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
                    name: name.clone(),
                    subjects: config.subjects.clone(),
                    duplicate_window: config.duplicate_window,
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await;
            match created {
                Ok(created) => Ok(created.cached_info().clone()),
                Err(e) => Err(stream_failure(js, config, "create", e).await),
            }
        }
        Err(e) => {
            let code = health::get_stream_error_code(&e);
            Err(NatsFailure::with_code(format!("read stream {name}"), code, e).into())
        }
    }
}

/// A stream create/update failure; when the server says the subjects overlap another
/// stream's, the operation names the streams that hold them, so the remedy can be followed.
async fn stream_failure(
    js: &jetstream::Context,
    config: &RelayConfig,
    verb: &str,
    e: jetstream::context::CreateStreamError,
) -> RelayError {
    let code = health::stream_error_code(&e);
    let mut operation = format!(
        "{verb} stream {} with subjects {}",
        config.stream_name,
        config.subjects.join(", ")
    );
    if code == Some(jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP) {
        let mut holders = Vec::new();
        for subject in &config.subjects {
            if let Ok(other) = js.stream_by_subject(subject.clone()).await {
                if other != config.stream_name {
                    holders.push(format!("{subject} is stored by stream {other}"));
                }
            }
        }
        if !holders.is_empty() {
            operation.push_str(&format!(" ({})", holders.join("; ")));
        }
    }
    NatsFailure::with_code(operation, code, e).into()
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

/// Reads one stored message's headers by sequence: `Ok(None)` when the stream has no
/// message there (deleted), an error for anything else (a read that failed says nothing).
pub trait StreamTail: Sync {
    /// The headers of the message at `sequence`.
    fn headers_at(
        &self,
        sequence: u64,
    ) -> impl std::future::Future<Output = Result<Option<async_nats::HeaderMap>, NatsFailure>> + Send;
}

impl<I: Sync> StreamTail for stream::Stream<I> {
    async fn headers_at(
        &self,
        sequence: u64,
    ) -> Result<Option<async_nats::HeaderMap>, NatsFailure> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind as Kind;
        match self.get_raw_message(sequence).await {
            Ok(message) => Ok(Some(message.headers)),
            Err(e) => {
                let code = match e.kind() {
                    Kind::NoMessageFound => return Ok(None),
                    Kind::JetStream(j)
                        if j.error_code() == jetstream::ErrorCode::NO_MESSAGE_FOUND =>
                    {
                        return Ok(None)
                    }
                    Kind::JetStream(j) => Some(j.error_code()),
                    _ => None,
                };
                Err(NatsFailure::with_code(
                    format!("read message {sequence}"),
                    code,
                    e,
                ))
            }
        }
    }
}

/// The position of the newest message in the stream that Ferry published.
pub async fn last_ferry_position(
    js: &jetstream::Context,
    stream_name: &str,
) -> Result<LastPosition, RelayError> {
    let mut stream = js.get_stream(stream_name).await.map_err(|e| {
        let code = health::get_stream_error_code(&e);
        NatsFailure::with_code(format!("open stream {stream_name}"), code, e)
    })?;
    let state = stream
        .info()
        .await
        .map_err(|e| NatsFailure::new(format!("read stream {stream_name}"), e))?
        .state
        .clone();
    Ok(last_ferry_position_in(&stream, &state).await?)
}

/// The id of the stored event at `global_position`, if any.
async fn event_id_at(db: &Database, global_position: i64) -> Result<Option<String>, sqlx::Error> {
    let sql = db.sql("SELECT CAST(event_id AS text) FROM events WHERE global_position = $1");
    Ok(
        ferry_store::on_pool!(db, pool => sqlx::query_scalar::<_, String>(&sql)
        .bind(global_position)
        .fetch_optional(pool)
        .await?),
    )
}

/// The newest Ferry message among the newest [`RECONCILE_SCAN`] of a stream in `state`. A
/// deleted message in between is skipped; a read that fails is an error, never "none".
pub async fn last_ferry_position_in(
    tail: &impl StreamTail,
    state: &stream::State,
) -> Result<LastPosition, NatsFailure> {
    Ok(newest_ferry_message_in(tail, state).await?.0)
}

/// As [`last_ferry_position_in`], with the newest Ferry message's `Nats-Msg-Id`.
async fn newest_ferry_message_in(
    tail: &impl StreamTail,
    state: &stream::State,
) -> Result<(LastPosition, Option<String>), NatsFailure> {
    if state.messages == 0 {
        return Ok((LastPosition::NoFerryMessage, None));
    }
    let lowest = state
        .first_sequence
        .max(state.last_sequence.saturating_sub(RECONCILE_SCAN));
    let mut seq = state.last_sequence;
    while seq >= lowest && seq > 0 {
        if let Some(headers) = tail.headers_at(seq).await? {
            if let Some(p) = headers
                .get(POSITION_HEADER)
                .and_then(|v| parse_position(v.as_str()))
            {
                let id = headers.get("Nats-Msg-Id").map(|v| v.to_string());
                return Ok((LastPosition::Found(p), id));
            }
        }
        seq -= 1;
    }
    let last = if lowest <= state.first_sequence {
        LastPosition::NoFerryMessage
    } else {
        LastPosition::Unknown
    };
    Ok((last, None))
}

async fn load_checkpoint(db: &Database, name: &str) -> Result<Position, sqlx::Error> {
    let mut tx = Tx::begin(db).await?;
    let p = tx.claim_checkpoint(name).await?;
    tx.commit().await?;
    Ok(p)
}

/// Moves the checkpoint to `to`; only forward unless `backward` (the line-up's rewind to
/// what NATS proved lost), so that a slower second relay never undoes a faster one's progress.
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

/// Why an operator's replay was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] sqlx::Error),
    /// Moving forward would skip events: a replay only goes back.
    #[error("the relay has published only up to {checkpoint}: replaying after {after} would skip events, not repeat them")]
    Forward {
        /// Where the relay stands.
        checkpoint: String,
        /// The position asked for.
        after: String,
    },
}

/// An operator's replay: the relay of `stream_name` republishes every event after `after`
/// (e.g. after a reported stream reset, for consumers that need the history again). NATS
/// drops those still inside its duplicate window. Returns how many events will go out
/// again. A running relay picks the new checkpoint up with its next batch.
pub async fn replay_after(
    db: &Database,
    stream_name: &str,
    after: Position,
) -> Result<u64, ReplayError> {
    let name = RelayConfig {
        stream_name: stream_name.to_string(),
        ..RelayConfig::default()
    }
    .checkpoint_name();
    let checkpoint = load_checkpoint(db, &name).await?;
    if after > checkpoint {
        return Err(ReplayError::Forward {
            checkpoint: position_token(checkpoint),
            after: position_token(after),
        });
    }
    let events = count_between(db, after, checkpoint).await?;
    move_checkpoint(db, &name, after, true).await?;
    tracing::warn!(
        stream = stream_name,
        after = %position_token(after),
        events,
        "an operator asked the relay to publish again"
    );
    Ok(events)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn reset(explained_by_limits: bool, open: bool) -> StreamReset {
        StreamReset {
            at: Utc::now(),
            checkpoint: "812.17".to_string(),
            stream_first_sequence: 18,
            stream_last_sequence: 17,
            stream_messages: 0,
            explained_by_limits,
            open,
        }
    }

    #[test]
    fn an_emptied_stream_is_a_problem_unless_its_limits_explain_it_or_the_relay_published_since() {
        let metrics = RelayMetrics::default();
        assert!(metrics.problems("S").is_empty());
        metrics.update(|s| s.stream_reset = Some(reset(false, true)));
        let problems = metrics.problems("S");
        assert_eq!(problems.len(), 1);
        assert!(problems[0].contains("812.17") && problems[0].contains("purged"));
        metrics.update(|s| s.stream_reset = Some(reset(true, true)));
        assert!(
            metrics.problems("S").is_empty(),
            "aged out by its own limits"
        );
        metrics.update(|s| s.stream_reset = Some(reset(false, false)));
        assert!(metrics.problems("S").is_empty(), "published since");
    }
}

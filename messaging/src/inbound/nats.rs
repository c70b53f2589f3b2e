//! Durable pull consumers (explicit ack) for the inbound subjects.
//!
//! One consumer per subject (`ferry-inbound-<event>`), so that each works on servers before
//! 2.10 (no multi-subject filters) and one slow kind does not hold up the others. A subject
//! must be stored by some stream: the one already covering it (found with
//! `stream_by_subject`), else `FERRY_INBOUND`, which Ferry creates. Subjects under Ferry's
//! own stream (`provisioning.>`) wait for the relay's stream
//! rather than create an overlapping one.

use super::{process, InboundContext, InboundHandler, InboundMetrics, Outcome};
use crate::health::{self, ConsumerStatuses, ErrorReport, NatsFailure};
use crate::subjects::{kebab, STREAM_SUBJECTS};
use async_nats::jetstream::{self, consumer, stream, AckKind};
use ferry_store::Database;
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

/// Settings of the inbound consumers. Suggested environment: `NATS_URL`,
/// `FERRY_NATS_INBOUND_STREAM`.
#[derive(Debug, Clone)]
pub struct InboundConfig {
    /// NATS server URL(s).
    pub nats_url: String,
    /// Ferry's NATS user and TLS.
    pub nats_auth: crate::nats::NatsAuth,
    /// The stream Ferry creates for inbound subjects no other stream covers.
    pub inbound_stream: String,
    /// Prefix of the durable consumer names.
    pub durable_prefix: String,
    /// Subjects to consume; empty (the default) is every subject the handler hears
    /// ([`InboundContext::kinds`]).
    pub subjects: Vec<String>,
    /// How long NATS waits for an ack before redelivering.
    pub ack_wait: Duration,
    /// Duplicate window of the inbound stream Ferry creates.
    pub duplicate_window: Duration,
    /// How often each consumer reads its pending count from NATS (for `/readyz`).
    pub status_interval: Duration,
}

impl InboundConfig {
    /// Defaults for `nats_url`.
    pub fn new(nats_url: &str) -> Self {
        Self {
            nats_url: nats_url.to_string(),
            nats_auth: crate::nats::NatsAuth::default(),
            inbound_stream: "FERRY_INBOUND".to_string(),
            durable_prefix: "ferry-inbound".to_string(),
            subjects: Vec::new(),
            ack_wait: Duration::from_secs(60),
            duplicate_window: Duration::from_secs(2 * 60 * 60),
            status_interval: Duration::from_secs(5),
        }
    }
}

/// Why the consumers could not start.
#[derive(Debug, thiserror::Error)]
pub enum InboundStartError {
    /// The NATS client could not be set up.
    #[error(transparent)]
    Connect(#[from] crate::nats::ConnectError),
}

/// The running inbound consumers.
pub struct Inbound {
    handles: Vec<JoinHandle<()>>,
    metrics: Arc<InboundMetrics>,
    context: InboundContext,
    statuses: Arc<ConsumerStatuses>,
}

impl Inbound {
    /// Starts one consumer per inbound subject with default settings.
    pub async fn start(
        db: Database,
        nats_url: &str,
        handler: Arc<dyn InboundHandler>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Self, InboundStartError> {
        Self::start_with(
            InboundContext::new(db, handler),
            InboundConfig::new(nats_url),
            shutdown,
        )
        .await
    }

    /// Starts the consumers with `config`, sharing `context` (and its counters) with the
    /// HTTP endpoint. Returns at once, also when NATS is unreachable.
    pub async fn start_with(
        context: InboundContext,
        config: InboundConfig,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Self, InboundStartError> {
        let mut config = config;
        if config.subjects.is_empty() {
            config.subjects = context.kinds.subjects();
        }
        let connection =
            crate::nats::connect(&config.nats_url, &config.nats_auth, "ferry-inbound").await?;
        let js = jetstream::new(connection.client);
        let setup = Arc::new(tokio::sync::Mutex::new(()));
        let statuses = Arc::new(ConsumerStatuses::default());
        for subject in &config.subjects {
            statuses.update(subject, |_| {});
        }
        let handles = config
            .subjects
            .iter()
            .map(|subject| {
                let worker = Consumer {
                    js: js.clone(),
                    ctx: context.clone(),
                    config: config.clone(),
                    subject: subject.clone(),
                    setup: setup.clone(),
                    status: statuses.clone(),
                };
                let span = tracing::info_span!("nats_inbound", subject = %subject);
                tokio::spawn(worker.run(shutdown.clone()).instrument(span))
            })
            .collect();
        Ok(Self {
            handles,
            metrics: context.metrics.clone(),
            context,
            statuses,
        })
    }

    /// Each consumer's state, lag and last error (for `/readyz` and `/metrics`).
    pub fn statuses(&self) -> Arc<ConsumerStatuses> {
        self.statuses.clone()
    }

    /// The counters (shared with [`Inbound::context`]).
    pub fn metrics(&self) -> Arc<InboundMetrics> {
        self.metrics.clone()
    }

    /// The processing context, to hand to the HTTP endpoint.
    pub fn context(&self) -> InboundContext {
        self.context.clone()
    }

    /// Waits until every consumer stopped (after `shutdown` turned true).
    pub async fn join(self) {
        for handle in self.handles {
            if let Err(error) = handle.await {
                tracing::error!(%error, "inbound consumer ended abnormally");
            }
        }
    }
}

/// Whether NATS subject `subject` matches `pattern` (`*` one token, `>` the rest).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

struct Consumer {
    js: jetstream::Context,
    ctx: InboundContext,
    config: InboundConfig,
    subject: String,
    /// Serializes stream creation and updates: two concurrent updates of the subject list
    /// would each drop the other's subject.
    setup: Arc<tokio::sync::Mutex<()>>,
    /// Where this consumer reports its state.
    status: Arc<ConsumerStatuses>,
}

/// Why a consumer is not consuming.
#[derive(Debug, thiserror::Error)]
enum ConsumeError {
    /// No stream stores the subject yet (the relay creates Ferry's own).
    #[error("{0}")]
    Waiting(String),
    /// NATS refused or did not answer.
    #[error(transparent)]
    Nats(#[from] NatsFailure),
}

impl Consumer {
    async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut backoff = Duration::from_millis(200);
        loop {
            if *shutdown.borrow() {
                return;
            }
            let mut cap = Duration::from_secs(10);
            match self.consume(&mut shutdown).await {
                Ok(()) => return,
                Err(ConsumeError::Waiting(reason)) => {
                    tracing::debug!(%reason, "inbound consumer waits for its stream");
                    self.status.update(&self.subject, |s| {
                        s.state = "waiting";
                        s.waiting_for = Some(reason);
                        s.last_error = None;
                    });
                }
                Err(ConsumeError::Nats(failure)) => {
                    let remedy = failure.remedy().map(str::to_string);
                    let permanent = remedy.is_some();
                    let (code, error) = (failure.code, failure.to_string());
                    let mut logged = None;
                    self.status.update(&self.subject, |s| {
                        let (report, new) =
                            ErrorReport::next(s.last_error.as_ref(), error, code, remedy);
                        s.state = "failing";
                        s.last_error = Some(report.clone());
                        logged = Some((report, new));
                    });
                    if let Some((report, new)) = logged {
                        let component = format!("the inbound consumer for {}", self.subject);
                        health::log_failure(&component, &report, new, backoff.as_millis() as u64);
                    }
                    if permanent {
                        cap = Duration::from_secs(60);
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.changed() => {}
            }
            backoff = (backoff * 2).min(cap);
        }
    }

    /// The stream storing the subject, creating `FERRY_INBOUND` for it when none does.
    async fn stream_for_subject(&self) -> Result<stream::Stream, ConsumeError> {
        if let Some(name) = self.stream_storing(&self.subject).await? {
            return self.open(&name).await;
        }
        if STREAM_SUBJECTS
            .iter()
            .any(|p| subject_matches(p, &self.subject))
        {
            return Err(ConsumeError::Waiting(format!(
                "no stream stores {} yet (the relay creates it)",
                self.subject
            )));
        }
        let _guard = self.setup.lock().await;
        // Another consumer may have added it while this one waited for the lock.
        if let Ok(name) = self.js.stream_by_subject(self.subject.clone()).await {
            return self.open(&name).await;
        }
        // Every configured subject no stream stores yet (not only this one), in one update.
        let mut missing = Vec::new();
        for subject in &self.config.subjects {
            let ours = STREAM_SUBJECTS.iter().any(|p| subject_matches(p, subject));
            if !ours && self.js.stream_by_subject(subject.clone()).await.is_err() {
                missing.push(subject.clone());
            }
        }
        let name = &self.config.inbound_stream;
        let failure = |verb: &str, subjects: &[String], e| {
            let code = health::stream_error_code(&e);
            let operation = format!("{verb} stream {name} with subjects {}", subjects.join(", "));
            ConsumeError::Nats(NatsFailure::with_code(operation, code, e))
        };
        match self.js.get_stream(name).await {
            Ok(mut existing) => {
                let mut config = existing
                    .info()
                    .await
                    .map_err(|e| NatsFailure::new(format!("read stream {name}"), e))?
                    .config
                    .clone();
                let before = config.subjects.len();
                for subject in missing {
                    if !config.subjects.iter().any(|s| subject_matches(s, &subject)) {
                        config.subjects.push(subject);
                    }
                }
                if config.subjects.len() != before {
                    let subjects = config.subjects.clone();
                    self.js
                        .update_stream(config)
                        .await
                        .map_err(|e| failure("update", &subjects, e))?;
                }
                self.open(name).await
            }
            Err(_) => self
                .js
                .create_stream(stream::Config {
                    name: name.clone(),
                    subjects: missing.clone(),
                    duplicate_window: self.config.duplicate_window,
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(|e| failure("create", &missing, e)),
        }
    }

    /// The stream that stores `subject`; `None` when none does (a failed lookup is an error,
    /// not "none": NATS may be unreachable).
    async fn stream_storing(&self, subject: &str) -> Result<Option<String>, ConsumeError> {
        use async_nats::jetstream::context::GetStreamByNameErrorKind as Kind;
        match self.js.stream_by_subject(subject.to_string()).await {
            Ok(name) => Ok(Some(name)),
            Err(e) if matches!(e.kind(), Kind::NotFound) => Ok(None),
            Err(e) => Err(NatsFailure::new(format!("find the stream storing {subject}"), e).into()),
        }
    }

    async fn open(&self, name: &str) -> Result<stream::Stream, ConsumeError> {
        self.js.get_stream(name).await.map_err(|e| {
            let code = health::get_stream_error_code(&e);
            ConsumeError::Nats(NatsFailure::with_code(
                format!("open stream {name}"),
                code,
                e,
            ))
        })
    }

    async fn consume(&self, shutdown: &mut watch::Receiver<bool>) -> Result<(), ConsumeError> {
        let stream = self.stream_for_subject().await?;
        let stream_name = stream.cached_info().config.name.clone();
        let name = format!(
            "{}-{}",
            self.config.durable_prefix,
            self.ctx
                .kinds
                .find(&self.subject)
                .map_or_else(|| kebab(&self.subject), |k| kebab(k.name()))
        );
        let mut consumer: consumer::PullConsumer = stream
            .get_or_create_consumer(
                &name,
                consumer::pull::Config {
                    durable_name: Some(name.clone()),
                    filter_subject: self.subject.clone(),
                    ack_policy: consumer::AckPolicy::Explicit,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_wait: self.config.ack_wait,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| {
                let code = match e.kind() {
                    async_nats::jetstream::stream::ConsumerErrorKind::JetStream(j) => {
                        Some(j.error_code())
                    }
                    _ => None,
                };
                NatsFailure::with_code(format!("create consumer {name} on {stream_name}"), code, e)
            })?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| NatsFailure::new(format!("pull from consumer {name}"), e))?;
        tracing::info!(consumer = %name, "consuming");
        self.status.update(&self.subject, |s| {
            s.state = "consuming";
            s.stream = Some(stream_name.clone());
            s.consumer = Some(name.clone());
            s.waiting_for = None;
            s.last_error = None;
        });
        let mut status_tick = tokio::time::interval(self.config.status_interval);
        loop {
            let next = tokio::select! {
                m = messages.next() => m,
                _ = status_tick.tick() => {
                    self.refresh_pending(&mut consumer).await;
                    continue;
                }
                _ = shutdown.changed() => return Ok(()),
            };
            let message = match next {
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    return Err(NatsFailure::new(format!("receive from consumer {name}"), e).into())
                }
                None => {
                    let ended = std::io::Error::other("the message stream ended");
                    return Err(
                        NatsFailure::new(format!("receive from consumer {name}"), ended).into(),
                    );
                }
            };
            let delivered = message.info().map(|i| i.delivered).unwrap_or(1);
            let outcome = process(
                &self.ctx,
                "nats",
                Some(message.subject.as_str()),
                None,
                &message.payload,
            )
            .await;
            let ack = match &outcome {
                Outcome::Handled { .. } | Outcome::Duplicate { .. } => AckKind::Ack,
                Outcome::Malformed(_) | Outcome::Rejected(_) | Outcome::Forbidden(_) => {
                    AckKind::Term
                }
                Outcome::Busy(_) => AckKind::Nak(Some(Duration::from_secs(5))),
                Outcome::Transient(reason) => {
                    tracing::warn!(%reason, delivered, "inbound message will be retried");
                    AckKind::Nak(Some(nak_delay(delivered)))
                }
            };
            if let Err(error) = message.ack_with(ack).await {
                // The message comes back after ack_wait; the table keeps it from a second effect.
                tracing::warn!(%error, "cannot acknowledge an inbound message");
            }
        }
    }
}

impl Consumer {
    /// Reads the consumer's pending and unacknowledged counts for `/readyz` (a failed read
    /// keeps the last figures: the message loop reports real failures).
    async fn refresh_pending(&self, consumer: &mut consumer::PullConsumer) {
        match consumer.info().await {
            Ok(info) => {
                let (pending, ack_pending) = (info.num_pending, info.num_ack_pending as u64);
                self.status.update(&self.subject, |s| {
                    s.pending = Some(pending);
                    s.ack_pending = Some(ack_pending);
                    s.checked_at = Some(chrono::Utc::now());
                });
            }
            Err(error) => tracing::debug!(%error, "cannot read the consumer's pending count"),
        }
    }
}

/// Retry delay after a transient failure: 1 s, 2 s, 4 s, … at most one minute.
fn nak_delay(delivered: i64) -> Duration {
    let exp = u32::try_from(delivered.clamp(1, 7) - 1).unwrap_or(0);
    Duration::from_secs(2u64.pow(exp)).min(Duration::from_secs(60))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_match_wildcards() {
        assert!(subject_matches(
            "provisioning.>",
            "provisioning.runs.v1.provisioning-applied"
        ));
        assert!(subject_matches(
            "environments.v1.*",
            "environments.v1.environment-created"
        ));
        assert!(!subject_matches("environments.v1.*", "environments.v1.a.b"));
        assert!(!subject_matches(
            "releases.promotions.>",
            "releases.releases.v1.release-ready"
        ));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a"));
    }

    #[test]
    fn retry_delays_grow_and_stop_growing() {
        assert_eq!(nak_delay(1), Duration::from_secs(1));
        assert_eq!(nak_delay(3), Duration::from_secs(4));
        assert_eq!(nak_delay(100), Duration::from_secs(60));
    }
}

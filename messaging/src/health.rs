//! What the relay and the inbound consumers report about themselves, for `/readyz` and
//! `/metrics`: their state, their lag and their last error, with the change an operator must
//! make when the error is one that retrying will not fix.
//!
//! A transient failure (NATS unreachable, a timeout) is retried and logged as a warning. A
//! permanent one (the server refuses Ferry's stream or consumer for a reason only a change of
//! configuration fixes) is logged once as an error naming what to change, and still retried
//! slowly, so that the fix takes effect without a restart.

use crate::metrics::{Family, ScrapeCollector};
use async_nats::jetstream;
use chrono::{DateTime, Utc};
use prometheus::proto::MetricFamily;
use prometheus::Registry;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A JetStream failure: what Ferry was doing and, when the server said, its error code.
#[derive(Debug, thiserror::Error)]
#[error("{operation}: {source}")]
pub struct NatsFailure {
    /// What Ferry was doing (e.g. `create stream FERRY_EVENTS`).
    pub operation: String,
    /// JetStream's error code (`err_code`), when the server answered with one.
    pub code: Option<u64>,
    /// The client's error.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
    /// What to change, for a failure the client names without a JetStream code.
    pub fixed_remedy: Option<&'static str>,
}

impl NatsFailure {
    /// Wraps a client error that carries no JetStream error code.
    pub fn new(
        operation: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            operation: operation.into(),
            code: None,
            source: Box::new(source),
            fixed_remedy: None,
        }
    }

    /// Names what to change for a failure that retrying will not fix.
    pub fn with_remedy(mut self, remedy: &'static str) -> Self {
        self.fixed_remedy = Some(remedy);
        self
    }

    /// Wraps a client error with the JetStream error code found in it.
    pub fn with_code(
        operation: impl Into<String>,
        code: Option<jetstream::ErrorCode>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            operation: operation.into(),
            code: code.map(|c| c.0),
            source: Box::new(source),
            fixed_remedy: None,
        }
    }

    /// The change that fixes this failure, when retrying alone will not.
    pub fn remedy(&self) -> Option<&'static str> {
        self.fixed_remedy.or_else(|| self.code.and_then(remedy))
    }
}

/// The code of a stream create/update error.
pub fn stream_error_code(
    e: &jetstream::context::CreateStreamError,
) -> Option<jetstream::ErrorCode> {
    match e.kind() {
        jetstream::context::CreateStreamErrorKind::JetStream(j) => Some(j.error_code()),
        _ => None,
    }
}

/// The code of a stream lookup error.
pub fn get_stream_error_code(
    e: &jetstream::context::GetStreamError,
) -> Option<jetstream::ErrorCode> {
    match e.kind() {
        jetstream::context::GetStreamErrorKind::JetStream(j) => Some(j.error_code()),
        _ => None,
    }
}

/// What an operator must change for a JetStream error that retrying does not fix; `None` for
/// errors that may go away by themselves (races between instances, a cluster short of peers).
pub fn remedy(code: u64) -> Option<&'static str> {
    Some(match code {
        10065 => {
            "another stream already stores some of these subjects (named above): remove them \
             from that stream (for the relay's stream, or set FERRY_NATS_STREAM to another name)"
        }
        10039 | 10076 => {
            "JetStream is not enabled: start nats-server with -js, or enable JetStream for \
             Ferry's account"
        }
        10002 | 10026 | 10027 | 10028 | 10047 => {
            "a JetStream limit is reached (streams, consumers, storage or memory): raise the \
             account's limits or free space"
        }
        10052 | 10053 | 10055 | 10069 => {
            "the existing stream's configuration cannot take Ferry's settings (subjects, \
             duplicate window): change that stream's configuration"
        }
        _ => return None,
    })
}

/// A publish NATS refuses because the message exceeds the server's `max_payload`: the relay
/// cannot move past that event until the limit is raised.
pub const MAX_PAYLOAD_REMEDY: &str =
    "an event is larger than the NATS server's max_payload: raise max_payload (server configuration)";

/// The last error of a component, kept until it succeeds again.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorReport {
    /// The error.
    pub error: String,
    /// JetStream's error code, when the server gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<u64>,
    /// True when retrying will not help: `remedy` says what to change.
    pub permanent: bool,
    /// What to change, for a permanent error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remedy: Option<String>,
    /// When this error (the same text) was first seen.
    pub since: DateTime<Utc>,
    /// When it was last seen.
    pub last: DateTime<Utc>,
    /// How many times in a row.
    pub attempts: u64,
}

impl ErrorReport {
    /// Records `error` after `previous`: the same error again counts up, another one starts
    /// a new report. Returns the report and whether it is new (to log it once).
    pub fn next(
        previous: Option<&ErrorReport>,
        error: String,
        code: Option<u64>,
        remedy: Option<String>,
    ) -> (Self, bool) {
        let now = Utc::now();
        match previous {
            Some(p) if p.error == error => {
                let mut r = p.clone();
                r.last = now;
                r.attempts += 1;
                (r, false)
            }
            _ => (
                Self {
                    error,
                    code,
                    permanent: remedy.is_some(),
                    remedy,
                    since: now,
                    last: now,
                    attempts: 1,
                },
                true,
            ),
        }
    }

    /// The line `/readyz` lists among its problems.
    pub fn problem(&self, component: &str) -> String {
        match &self.remedy {
            Some(remedy) => format!(
                "{component} cannot work until its configuration changes ({} attempts since {}): {}; to fix: {remedy}",
                self.attempts,
                self.since.to_rfc3339(),
                self.error
            ),
            None => format!(
                "{component} is failing ({} attempts since {}, retrying): {}",
                self.attempts,
                self.since.to_rfc3339(),
                self.error
            ),
        }
    }
}

/// Logs a failure: a new permanent one once as an error with its remedy; the same permanent
/// one again only at debug level; a transient one as a warning.
pub fn log_failure(component: &str, report: &ErrorReport, new: bool, retry_in_ms: u64) {
    match (&report.remedy, new) {
        (Some(remedy), true) => tracing::error!(
            component,
            error = %report.error,
            code = report.code,
            remedy,
            retry_in_ms,
            "{component} cannot work until its configuration changes"
        ),
        (Some(_), false) => tracing::debug!(
            component,
            error = %report.error,
            attempts = report.attempts,
            "{component} still failing (permanent error, reported)"
        ),
        (None, _) => tracing::warn!(
            component,
            error = %report.error,
            attempts = report.attempts,
            retry_in_ms,
            "{component} step failed; retrying"
        ),
    }
}

/// One inbound consumer's state, for `/readyz`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerStatus {
    /// The subject it consumes.
    pub subject: String,
    /// `starting`, `waiting` (no stream stores the subject yet), `consuming` or `failing`.
    pub state: &'static str,
    /// The stream it reads, once known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    /// Its durable name, once created.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    /// Messages stored but not yet delivered (the consumer's lag), as NATS last said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending: Option<u64>,
    /// Messages delivered and not yet acknowledged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ack_pending: Option<u64>,
    /// When `pending` was read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checked_at: Option<DateTime<Utc>>,
    /// Why it waits, while `waiting`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
    /// Its last error, until it consumes again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<ErrorReport>,
}

impl ConsumerStatus {
    fn new(subject: &str) -> Self {
        Self {
            subject: subject.to_string(),
            state: "starting",
            stream: None,
            consumer: None,
            pending: None,
            ack_pending: None,
            checked_at: None,
            waiting_for: None,
            last_error: None,
        }
    }
}

/// The states of every inbound consumer, shared by the consumers and `/readyz`.
#[derive(Debug, Default)]
pub struct ConsumerStatuses {
    by_subject: Mutex<BTreeMap<String, ConsumerStatus>>,
}

impl ConsumerStatuses {
    /// Changes the status of `subject`'s consumer.
    pub fn update(&self, subject: &str, change: impl FnOnce(&mut ConsumerStatus)) {
        let mut map = self
            .by_subject
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        change(
            map.entry(subject.to_string())
                .or_insert_with(|| ConsumerStatus::new(subject)),
        );
    }

    /// Every consumer's status, by subject.
    pub fn snapshot(&self) -> Vec<ConsumerStatus> {
        self.by_subject
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// The lines `/readyz` lists among its problems: consumers that fail.
    pub fn problems(&self) -> Vec<String> {
        self.snapshot()
            .iter()
            .filter_map(|c| {
                c.last_error
                    .as_ref()
                    .map(|e| e.problem(&format!("inbound consumer for {}", c.subject)))
            })
            .collect()
    }

    /// `ferry_nats_inbound_pending{subject}` (once read from NATS) and
    /// `ferry_nats_inbound_failing{subject}`, as the consumers are now.
    fn families(&self) -> Vec<MetricFamily> {
        let all = self.snapshot();
        let pending = INBOUND_PENDING.with(
            all.iter()
                .filter_map(|c| c.pending.map(|p| (vec![c.subject.as_str()], p as f64))),
        );
        let failing = INBOUND_FAILING.with(all.iter().map(|c| {
            let v = match &c.last_error {
                None => 0.0,
                Some(e) if e.permanent => 2.0,
                Some(_) => 1.0,
            };
            (vec![c.subject.as_str()], v)
        }));
        vec![pending, failing]
    }

    /// The consumers' gauges in the Prometheus text format.
    pub fn render(&self) -> String {
        crate::metrics::encode(self.families())
    }

    /// Registers the consumers' gauges in `registry` (the process's, served at `/metrics`);
    /// they are read at each scrape.
    pub fn register(self: &Arc<Self>, registry: &Registry) -> prometheus::Result<()> {
        let statuses = self.clone();
        registry.register(Box::new(ScrapeCollector::new(
            [&INBOUND_PENDING, &INBOUND_FAILING],
            move || statuses.families(),
        )?))
    }
}

const INBOUND_PENDING: Family = Family::gauge(
    "ferry_nats_inbound_pending",
    "Messages stored for an inbound consumer and not yet delivered.",
    &["subject"],
);
const INBOUND_FAILING: Family = Family::gauge(
    "ferry_nats_inbound_failing",
    "1 while an inbound consumer fails (2: until its configuration changes).",
    &["subject"],
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_error_counts_up_and_another_starts_over() {
        let (first, new) = ErrorReport::next(None, "boom".into(), None, None);
        assert!(new && !first.permanent && first.attempts == 1);
        let (again, new) = ErrorReport::next(Some(&first), "boom".into(), None, None);
        assert!(!new);
        assert_eq!((again.attempts, again.since), (2, first.since));
        let (other, new) = ErrorReport::next(
            Some(&again),
            "overlap".into(),
            Some(10065),
            remedy(10065).map(str::to_string),
        );
        assert!(new && other.permanent && other.attempts == 1);
        assert!(other.problem("relay").contains("to fix: another stream"));
    }

    #[test]
    fn only_configuration_errors_are_permanent() {
        assert!(remedy(10065).is_some(), "subjects overlap");
        assert!(remedy(10076).is_some(), "JetStream off");
        assert!(
            remedy(10071).is_none(),
            "wrong last sequence is a repair, not a fault"
        );
        assert!(remedy(10037).is_none(), "no message found");
        assert!(remedy(10058).is_none(), "a create race between instances");
        assert!(
            remedy(10023).is_none(),
            "a cluster short of peers for a while"
        );
    }
}

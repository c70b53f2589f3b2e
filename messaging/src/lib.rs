//! Ferry's events out to and in from NATS JetStream, as CloudEvents 1.0 (JSON structured
//! mode), plus the same without NATS (HTTP in, Server-Sent Events out).
//!
//! * [`relay`]: [`Relay::start`] publishes every stored event, in global stream order, with
//!   `Nats-Msg-Id` = event id and `Nats-Expected-Last-Sequence` = its previous PubAck's
//!   sequence, moving its checkpoint only after the PubAck; it republishes exactly what NATS
//!   lost after acknowledging it, and reports (never replays into) a stream found empty.
//! * [`health`]: what the relay and the inbound consumers report to `/readyz` and `/metrics`
//!   (state, lag, last error, and the remedy for errors only a configuration change fixes).
//! * [`inbound`]: [`Inbound::start`] runs durable pull consumers (explicit ack) for the
//!   events Ferry reacts to; [`accept_cloud_event`] takes the same events over HTTP. Both
//!   check the source is trusted, dedupe by CloudEvent source and id (the mark committed
//!   with the effect) and dead-letter what is malformed.
//! * [`publish`]: each aggregate's [`Publisher`] turns its events into subjects and data;
//!   the process registers them ([`Publishers`]) and the relay and SSE stream use them. The
//!   publishers themselves belong to the bounded contexts (in `ferry-app`); [`outbound`]
//!   has the pieces they share.
//! * [`sse`]: [`sse_stream`] serves the live stream to `GET /factory/events/stream`.
//! * [`schemas`]: [`published_schemas`] is the JSON Schema of every payload and the
//!   AsyncAPI document, written to the repository's `schemas/`.
//!
//! # Subjects
//!
//! Ferry's outbound subjects are published by the bounded contexts' publishers
//! (provisioning's `provisioning.*.v1.*`, promotions' `releases.promotions.v1.*`); the
//! inbound ones are consumed here.
//!
//! | subject | payload (under `schemas/`) | direction |
//! |---|---|---|
//! | `provisioning.specifications.v1.specification-declared` | `events/specification-declared.schema.json` | out |
//! | `provisioning.runs.v1.provisioning-planned` | `events/provisioning-planned.schema.json` | out |
//! | `provisioning.runs.v1.provisioning-applied` | `events/provisioning-applied.schema.json` | out, and in (promotions) |
//! | `provisioning.runs.v1.provisioning-failed` | `events/provisioning-failed.schema.json` | out, and in (promotions) |
//! | `ferry.events.<aggregate>.<event>` (e.g. `ferry.events.provisioning-run.provisioning-cancelled`) | `events/ferry/<aggregate>.<event>.schema.json` (the domain event's inner object) | out |
//! | `releases.promotions.v1.promotion-requested`, `-approved`, `-completed`, `-failed`, `rollback-completed` | `events/promotion-requested.schema.json`, … (the promotions context's publisher) | out |
//! | `environments.v1.environment-created` | `events/inbound/environment-created.schema.json` | in |
//! | `environments.v1.environment-state-changed` | `events/inbound/environment-state-changed.schema.json` | in |
//! | `runcontrol.approvals.v1.approval-decided` | `events/inbound/approval-decided.schema.json` | in |
//! | `releases.releases.v1.release-ready` | `events/inbound/release-ready.schema.json` | in |
//! | `releases.releases.v1.release-withdrawn` | `events/inbound/release-withdrawn.schema.json` | in |
//!
//! Every message's envelope is `events/cloudevent.schema.json`; `asyncapi.json` lists all
//! of them. Ferry's stream is `FERRY_EVENTS` (`provisioning.>` and `ferry.events.>`; only
//! Ferry publishes into it); inbound subjects no other stream stores go to `FERRY_INBOUND`.
//! Over HTTP the CloudEvent `type` names the event (its subject or its name, e.g.
//! `ReleaseReady`).
//!
//! # Tables (migration `0003_messaging.sql`)
//!
//! * `inbound_messages`: one row per (tenant, CloudEvent source, id) handled or being
//!   handled (migration `0004_ownership.sql` changed the key).
//! * `inbound_dead_letters`: malformed, unknown or refused messages with their reason.
//! * The relay's checkpoint is the `subscription_checkpoints` row `nats-relay:<stream>`.
//!
//! # Wiring (for `ferry serve` and the api crate)
//!
//! * `NATS_URL` set: [`Relay::start`] with [`RelayConfig`] (`FERRY_NATS_STREAM` →
//!   `stream_name`; the other fields keep their defaults: source `urn:ferry`, a two-hour
//!   duplicate window), and [`Inbound::start`], whose [`InboundContext`] the HTTP endpoint
//!   shares. Both connect through [`nats::connect`] as Ferry's NATS user
//!   ([`nats::NatsAuth`], the `FERRY_NATS_*` settings). Both return at once even when NATS is down and stop when the shutdown signal
//!   turns true.
//! * `POST /factory/events` (scope-protected): [`accept_cloud_event`] with the token's
//!   tenant; the API maps each [`IntakeError`] to one problem+json status.
//! * `GET /factory/events/stream`: `Sse::new(sse_stream(db, tenant, start_position(
//!   last_event_id_header, after_query), db.subscribe_commits())).keep_alive(..)`.
//! * `/metrics`: [`RelayMetrics::register`], [`InboundMetrics::register`] and
//!   [`health::ConsumerStatuses::register`] put their families in the process's Prometheus
//!   registry, read at each scrape (`render` gives one part's text alone). The relay's lag
//!   is in `subscription_status` (checkpoint `nats-relay:<stream>`).
//! * `/readyz`: [`RelayMetrics::status`] and [`RelayMetrics::problems`], [`Inbound::statuses`].
//! * `ferry schemas`: [`write_schemas`] into `schemas/`.
#![forbid(unsafe_code)]

pub use ferry_domain::cloudevent;
pub mod health;
pub mod inbound;
mod metrics;
pub mod nats;
pub mod outbound;
pub mod publish;
pub mod relay;
pub mod schemas;
pub mod sse;
pub mod subjects;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use cloudevent::CloudEvent;
pub use inbound::{
    accept_cloud_event, Accepted, Handled, Inbound, InboundClash, InboundConfig, InboundContext,
    InboundEnvelope, InboundError, InboundEvent, InboundHandler, InboundKind, InboundKinds,
    InboundMetrics, IntakeError, Poster, SourceIdentities, TrustedSources,
};
pub use outbound::{parse_position, position_token, Outbound};
pub use publish::{DomainEvents, EncodeError, Encoded, Message, Publisher, Publishers};
pub use relay::{Relay, RelayConfig, RelayError, RelayMetrics};
pub use schemas::{published_schemas, write_schemas};
pub use sse::{sse_stream, start_position};

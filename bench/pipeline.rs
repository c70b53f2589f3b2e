//! The store and messaging side of `bench/run.sh`:
//!
//! * `seed <database-url> <events> <tenant>`: grows the events table to `events` rows by
//!   copying the tenant's events (written by the load generator through the API) under new
//!   tenants `bt-<n>` with new ids, in stream order, so that every copy decodes and
//!   projects like the original (figures e and g need a million real events);
//! * `scan <database-url>`: reads every event in stream order (id, payload, metadata), the
//!   floor any replay must pay (figure e's comparison);
//! * `raw <nats-url> <messages> <bytes> [<sequential messages>]`: raw JetStream publishing
//!   with async-nats, the client library the relay uses, into a new stream: `messages`
//!   pipelined (256 acks outstanding, ids only), and `sequential messages` (all, unless
//!   given) one at a time awaiting each ack with an id and an expected last sequence (as
//!   the relay publishes): figure d's comparison. `bench/run.sh` publishes as many
//!   pipelined messages as the relay's stream holds, since a short burst goes faster than
//!   a sustained stream (on one machine 86,788/s for 20,000 messages, 58,110/s for 300,000).
//!
//! * `drop-stream <nats-url> <stream>`: prints the stream's messages, bytes and the seconds
//!   from its first message stored to its last, then deletes it (the relay's stream of a
//!   benchmark run).
//!
//! Each prints one JSON object.
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout, clippy::unwrap_used, missing_docs)] // a command-line report

use async_nats::jetstream::{self, message::PublishMessage};
use futures::TryStreamExt;
use serde_json::json;
use std::collections::VecDeque;
use std::time::Instant;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: pipeline seed <db> <events> <tenant> | scan <db> | raw <nats> <messages> <bytes> [<sequential messages>] | drop-stream <nats> <stream>";
    match args.get(1).map(String::as_str) {
        Some("seed") => {
            seed(
                &args[2],
                args[3].parse().expect(usage),
                args.get(4).expect(usage),
            )
            .await
        }
        Some("scan") => scan(&args[2]).await,
        Some("drop-stream") => drop_stream(&args[2], args.get(3).expect(usage)).await,
        Some("raw") => {
            let messages: u64 = args[3].parse().expect(usage);
            let sequential = args.get(5).map_or(messages, |n| n.parse().expect(usage));
            raw(
                &args[2],
                messages,
                args[4].parse().expect(usage),
                sequential.min(messages),
            )
            .await
        }
        _ => panic!("{usage}"),
    }
}

/// Rewrites every UUID in `text` to the one the copy `n` gives it (v5 of the original), so
/// that references between the copied aggregates hold.
fn remap_uuids(text: &str, namespace: &uuid::Uuid) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if i + 36 <= bytes.len() && text.is_char_boundary(i) && text.is_char_boundary(i + 36) {
            if let Ok(id) = uuid::Uuid::parse_str(&text[i..i + 36]) {
                if text[i..i + 36].contains('-') {
                    out.push_str(&uuid::Uuid::new_v5(namespace, id.as_bytes()).to_string());
                    i += 36;
                    continue;
                }
            }
        }
        let c = text[i..].chars().next().unwrap();
        out.push(c);
        i += c.len_utf8();
    }
    out
}

type Row = (String, String, i64, String, String, String, String);

async fn seed(url: &str, target: i64, tenant: &str) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .unwrap();
    let template: Vec<Row> = sqlx::query_as(
        "SELECT aggregate_type, aggregate_id, sequence, event_type, event_version, payload::text, metadata::text
           FROM events WHERE metadata->>'tenantId' = $1 OR aggregate_id LIKE $2
          ORDER BY transaction_id, global_position",
    )
    .bind(tenant)
    .bind(format!("{tenant}/%"))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(!template.is_empty(), "no events of tenant {tenant} to copy");
    let started = Instant::now();
    let mut total: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .unwrap();
    let mut copy = 0u64;
    while total < target {
        copy += 1;
        let namespace = uuid::Uuid::new_v5(
            &uuid::Uuid::NAMESPACE_OID,
            format!("ferry-bench-{copy}").as_bytes(),
        );
        let name = format!("bt-{copy}");
        let rewrite = |s: &str| remap_uuids(&s.replace(tenant, &name), &namespace);
        let take = usize::try_from(target - total).unwrap().min(template.len());
        let mut columns: [Vec<String>; 6] = Default::default();
        let mut sequences = Vec::with_capacity(take);
        for (kind, id, sequence, event_type, version, payload, metadata) in &template[..take] {
            columns[0].push(kind.clone());
            columns[1].push(rewrite(id));
            sequences.push(*sequence);
            columns[2].push(event_type.clone());
            columns[3].push(version.clone());
            columns[4].push(rewrite(payload));
            columns[5].push(rewrite(metadata));
        }
        // One transaction per copy, in the template's stream order.
        sqlx::query(
            "INSERT INTO events (aggregate_type, aggregate_id, sequence, event_type, event_version, payload, metadata)
             SELECT k, i, s, t, v, p::jsonb, m::jsonb
               FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::text[], $7::text[])
                    WITH ORDINALITY AS u(k, i, s, t, v, p, m, o) ORDER BY o",
        )
        .bind(&columns[0])
        .bind(&columns[1])
        .bind(&sequences)
        .bind(&columns[2])
        .bind(&columns[3])
        .bind(&columns[4])
        .bind(&columns[5])
        .execute(&pool)
        .await
        .unwrap();
        total += take as i64;
    }
    println!(
        "{}",
        json!({"events": total, "copies": copy, "templateEvents": template.len(),
               "seconds": (started.elapsed().as_secs_f64() * 10.0).round() / 10.0})
    );
}

async fn scan(url: &str) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .unwrap();
    let started = Instant::now();
    let mut rows = sqlx::query_as::<_, (uuid::Uuid, serde_json::Value, serde_json::Value)>(
        "SELECT event_id, payload, metadata FROM events ORDER BY transaction_id, global_position",
    )
    .fetch(&pool);
    let (mut events, mut bytes) = (0u64, 0usize);
    while let Some((_, payload, metadata)) = rows.try_next().await.unwrap() {
        events += 1;
        bytes += payload.as_object().map_or(0, |o| o.len())
            + metadata.as_object().map_or(0, |o| o.len());
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({"events": events, "seconds": (seconds * 100.0).round() / 100.0,
               "eventsPerSecond": (events as f64 / seconds).round(), "fields": bytes})
    );
}

/// Publishes `messages` messages of `bytes` bytes with 256 PubAcks in flight, and
/// `sequential` of them one at a time (each waiting for its PubAck), each to a new stream.
async fn raw(url: &str, messages: u64, bytes: usize, sequential: u64) {
    let client = async_nats::connect(url).await.unwrap();
    let js = jetstream::new(client);
    let run = uuid::Uuid::new_v4().simple().to_string();
    let body: bytes::Bytes = "x".repeat(bytes).into();
    let mut results = serde_json::Map::new();
    for mode in ["sequential", "pipelined"] {
        let stream = format!("BENCH_RAW_{mode}_{run}");
        let subject = format!("benchraw.{mode}.{run}");
        js.create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{subject}.>")],
            duplicate_window: std::time::Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();
        let count = if mode == "sequential" {
            sequential
        } else {
            messages
        };
        let started = Instant::now();
        let mut in_flight = VecDeque::new();
        for n in 0..count {
            let mut message = PublishMessage::build()
                .payload(body.clone())
                .message_id(uuid::Uuid::new_v4().to_string());
            if mode == "sequential" {
                if n > 0 {
                    message = message.expected_last_sequence(n);
                }
                js.send_publish(format!("{subject}.e"), message)
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            } else {
                in_flight.push_back(
                    js.send_publish(format!("{subject}.e"), message)
                        .await
                        .unwrap(),
                );
                if in_flight.len() >= 256 {
                    in_flight.pop_front().unwrap().await.unwrap();
                }
            }
        }
        for ack in in_flight {
            ack.await.unwrap();
        }
        let seconds = started.elapsed().as_secs_f64();
        results.insert(
            format!("{mode}PerSecond"),
            json!((count as f64 / seconds).round()),
        );
        results.insert(format!("{mode}Messages"), json!(count));
        js.delete_stream(&stream).await.unwrap();
    }
    results.insert("messages".into(), json!(messages));
    results.insert("bytes".into(), json!(bytes));
    println!("{}", serde_json::Value::Object(results));
}

async fn drop_stream(url: &str, name: &str) {
    let js = jetstream::new(async_nats::connect(url).await.unwrap());
    let mut stream = js.get_stream(name).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    js.delete_stream(name).await.unwrap();
    // The stream's own clock: from the first message stored to the last, whatever the
    // caller's polling cost or its window's idle end.
    let stored_seconds = (state.last_timestamp - state.first_timestamp).as_seconds_f64();
    println!(
        "{}",
        json!({"messages": state.messages, "bytes": state.bytes,
               "averageBytes": state.bytes.checked_div(state.messages).unwrap_or(0),
               "storedSeconds": stored_seconds})
    );
}

//! The inbound tables: processed messages (dedupe with a lease) and dead letters.
//!
//! A message is claimed by inserting its row as `processing` with a lease. A delivery that
//! finds the row `done` or `rejected` has no effect; one that finds it `processing` waits
//! unless the lease expired (the worker that claimed it died), then takes it over.

use ferry_store::{Database, Param};
use std::time::Duration;

/// The state of one message after a claim attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This delivery handles it now.
    Claimed,
    /// Handled before.
    Done,
    /// Refused before, with the reason.
    Rejected(String),
    /// Another delivery is handling it right now.
    Busy,
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn now_sql(db: &Database) -> &'static str {
    match db.backend() {
        ferry_store::Backend::Postgres => "now()",
        ferry_store::Backend::Sqlite => "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
    }
}

async fn execute(db: &Database, sql: &str, params: &[Param]) -> Result<u64, sqlx::Error> {
    let sql = db.sql(sql);
    Ok(
        ferry_store::on_pool!(db, pool => ferry_store::bind_params!(sqlx::query(&sql), params)
        .execute(pool).await?.rows_affected()),
    )
}

/// Claims message `id` of `tenant` for `lease`.
pub async fn claim(
    db: &Database,
    tenant: &str,
    id: &str,
    source: &str,
    event_type: &str,
    lease: Duration,
) -> Result<Claim, sqlx::Error> {
    let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX / 2);
    let until = now_ms().saturating_add(lease_ms);
    let key = [
        Param::Text(Some(tenant.to_string())),
        Param::Text(Some(id.to_string())),
    ];
    let inserted = execute(
        db,
        "INSERT INTO inbound_messages (tenant_id, message_id, source, event_type, status, claimed_until_ms)
         VALUES ($1, $2, $3, $4, 'processing', $5) ON CONFLICT (tenant_id, message_id) DO NOTHING",
        &[
            key[0].clone(),
            key[1].clone(),
            Param::Text(Some(source.to_string())),
            Param::Text(Some(event_type.to_string())),
            Param::Int(Some(until)),
        ],
    )
    .await?;
    if inserted == 1 {
        return Ok(Claim::Claimed);
    }
    // Take over an abandoned claim; the condition makes this atomic between deliveries.
    let taken = execute(
        db,
        "UPDATE inbound_messages SET claimed_until_ms = $3, attempts = attempts + 1
          WHERE tenant_id = $1 AND message_id = $2 AND status = 'processing' AND claimed_until_ms < $4",
        &[
            key[0].clone(),
            key[1].clone(),
            Param::Int(Some(until)),
            Param::Int(Some(now_ms())),
        ],
    )
    .await?;
    if taken == 1 {
        return Ok(Claim::Claimed);
    }
    let sql = db.sql(
        "SELECT status, outcome FROM inbound_messages WHERE tenant_id = $1 AND message_id = $2",
    );
    let row: Option<(String, Option<String>)> = ferry_store::on_pool!(db, pool =>
        sqlx::query_as(&sql).bind(tenant).bind(id).fetch_optional(pool).await?);
    Ok(match row {
        Some((status, _)) if status == "done" => Claim::Done,
        Some((status, outcome)) if status == "rejected" => {
            Claim::Rejected(outcome.unwrap_or_default())
        }
        // Processing elsewhere, or deleted in between (retry later either way).
        _ => Claim::Busy,
    })
}

/// Marks a claimed message handled (`done`) or refused (`rejected`, with the reason).
pub async fn finish(
    db: &Database,
    tenant: &str,
    id: &str,
    rejected: Option<&str>,
) -> Result<(), sqlx::Error> {
    let sql = format!(
        "UPDATE inbound_messages SET status = $3, outcome = $4, processed_at = {}
          WHERE tenant_id = $1 AND message_id = $2",
        now_sql(db)
    );
    execute(
        db,
        &sql,
        &[
            Param::Text(Some(tenant.to_string())),
            Param::Text(Some(id.to_string())),
            Param::Text(Some(
                if rejected.is_some() {
                    "rejected"
                } else {
                    "done"
                }
                .to_string(),
            )),
            Param::Text(rejected.map(str::to_string)),
        ],
    )
    .await
    .map(|_| ())
}

/// Gives a claim back after a transient failure, so the next delivery need not wait.
pub async fn release(db: &Database, tenant: &str, id: &str) -> Result<(), sqlx::Error> {
    execute(
        db,
        "UPDATE inbound_messages SET claimed_until_ms = 0
          WHERE tenant_id = $1 AND message_id = $2 AND status = 'processing'",
        &[
            Param::Text(Some(tenant.to_string())),
            Param::Text(Some(id.to_string())),
        ],
    )
    .await
    .map(|_| ())
}

/// One dead letter to record.
#[derive(Debug, Clone)]
pub struct DeadLetter<'a> {
    /// `nats` or `http`.
    pub via: &'a str,
    /// The NATS subject, or the CloudEvent type over HTTP.
    pub subject: &'a str,
    /// The CloudEvent id, when it could be read.
    pub message_id: Option<&'a str>,
    /// The tenant, when known.
    pub tenant_id: Option<&'a str>,
    /// Why it was refused.
    pub reason: &'a str,
    /// The raw body (invalid UTF-8 replaced).
    pub payload: &'a [u8],
}

/// Records a dead letter.
pub async fn dead_letter(db: &Database, letter: &DeadLetter<'_>) -> Result<(), sqlx::Error> {
    execute(
        db,
        "INSERT INTO inbound_dead_letters (via, subject, message_id, tenant_id, reason, payload)
         VALUES ($1, $2, $3, $4, $5, $6)",
        &[
            Param::Text(Some(letter.via.to_string())),
            Param::Text(Some(letter.subject.to_string())),
            Param::Text(letter.message_id.map(str::to_string)),
            Param::Text(letter.tenant_id.map(str::to_string)),
            Param::Text(Some(letter.reason.to_string())),
            Param::Text(Some(String::from_utf8_lossy(letter.payload).into_owned())),
        ],
    )
    .await
    .map(|_| ())
}

/// A recorded dead letter, for operators and tests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterRow {
    /// `nats` or `http`.
    pub via: String,
    /// Subject or type.
    pub subject: String,
    /// The CloudEvent id, when known.
    pub message_id: Option<String>,
    /// The tenant, when known.
    pub tenant_id: Option<String>,
    /// Why.
    pub reason: String,
    /// The raw body.
    pub payload: String,
}

/// The newest dead letters first, at most `limit`.
pub async fn dead_letters(db: &Database, limit: i64) -> Result<Vec<DeadLetterRow>, sqlx::Error> {
    let sql = db.sql(
        "SELECT via, subject, message_id, tenant_id, reason, payload FROM inbound_dead_letters
          ORDER BY id DESC LIMIT $1",
    );
    Ok(
        ferry_store::on_pool!(db, pool => sqlx::query_as::<_, DeadLetterRow>(&sql)
        .bind(limit).fetch_all(pool).await?),
    )
}

//! The inbound tables: processed messages (dedupe with a lease) and dead letters.
//!
//! A message is keyed by tenant, CloudEvent `source` and `id` (CloudEvents make the pair
//! unique). It is claimed by inserting its row as `processing` with a lease and a fresh
//! claim token. A delivery that finds the row `done` or `rejected` has no effect; one that
//! finds it `processing` waits unless the lease expired (the worker that claimed it died),
//! then takes it over with a new token. Marking the message handled
//! ([`handled_mark`]) is conditioned on the token and committed in the same transaction as
//! the message's effect, so an effect and its "handled" record exist together or not at all,
//! and a delivery that lost its claim cannot commit an effect.

use ferry_store::{Database, LinkedWrite, Param};
use std::time::Duration;

/// The state of one message after a claim attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This delivery handles it now, holding the claim with this token.
    Claimed(String),
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

/// One inbound message: tenant, CloudEvent source and id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageKey<'a> {
    /// The tenant (`tenantid`).
    pub tenant: &'a str,
    /// The CloudEvent `source`.
    pub source: &'a str,
    /// The CloudEvent `id`.
    pub id: &'a str,
}

impl MessageKey<'_> {
    fn params(&self) -> [Param; 3] {
        [
            Param::Text(Some(self.tenant.to_string())),
            Param::Text(Some(self.source.to_string())),
            Param::Text(Some(self.id.to_string())),
        ]
    }
}

/// Claims message `key` for `lease`.
pub async fn claim(
    db: &Database,
    key: MessageKey<'_>,
    event_type: &str,
    lease: Duration,
) -> Result<Claim, sqlx::Error> {
    let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX / 2);
    let until = now_ms().saturating_add(lease_ms);
    let token = uuid::Uuid::new_v4().to_string();
    let [tenant, source, id] = key.params();
    let inserted = execute(
        db,
        "INSERT INTO inbound_messages (tenant_id, source, message_id, event_type, status, claimed_until_ms, claim_token)
         VALUES ($1, $2, $3, $4, 'processing', $5, $6) ON CONFLICT (tenant_id, source, message_id) DO NOTHING",
        &[
            tenant.clone(),
            source.clone(),
            id.clone(),
            Param::Text(Some(event_type.to_string())),
            Param::Int(Some(until)),
            Param::Text(Some(token.clone())),
        ],
    )
    .await?;
    if inserted == 1 {
        return Ok(Claim::Claimed(token));
    }
    // Take over an abandoned claim with a new token; the condition makes this atomic
    // between deliveries, and the old holder's mark no longer matches.
    let taken = execute(
        db,
        "UPDATE inbound_messages SET claimed_until_ms = $4, attempts = attempts + 1, claim_token = $6
          WHERE tenant_id = $1 AND source = $2 AND message_id = $3 AND status = 'processing'
            AND claimed_until_ms < $5",
        &[
            tenant,
            source,
            id,
            Param::Int(Some(until)),
            Param::Int(Some(now_ms())),
            Param::Text(Some(token.clone())),
        ],
    )
    .await?;
    if taken == 1 {
        return Ok(Claim::Claimed(token));
    }
    let sql = db.sql(
        "SELECT status, outcome FROM inbound_messages
          WHERE tenant_id = $1 AND source = $2 AND message_id = $3",
    );
    let row: Option<(String, Option<String>)> = ferry_store::on_pool!(db, pool =>
        sqlx::query_as(&sql).bind(key.tenant).bind(key.source).bind(key.id)
            .fetch_optional(pool).await?);
    Ok(match row {
        Some((status, _)) if status == "done" => Claim::Done,
        Some((status, outcome)) if status == "rejected" => {
            Claim::Rejected(outcome.unwrap_or_default())
        }
        // Processing elsewhere, or deleted in between (retry later either way).
        _ => Claim::Busy,
    })
}

const MARK: &str = "UPDATE inbound_messages SET status = $5, outcome = $6, processed_at = {now}
  WHERE tenant_id = $1 AND source = $2 AND message_id = $3 AND claim_token = $4
    AND status = 'processing'";

fn mark_params(key: MessageKey<'_>, token: &str, rejected: Option<&str>) -> Vec<Param> {
    let [tenant, source, id] = key.params();
    vec![
        tenant,
        source,
        id,
        Param::Text(Some(token.to_string())),
        Param::Text(Some(
            if rejected.is_some() {
                "rejected"
            } else {
                "done"
            }
            .to_string(),
        )),
        Param::Text(rejected.map(str::to_string)),
    ]
}

/// The statement that marks a claimed message handled, to commit with its effect
/// ([`ferry_store::Repository::execute_linked`]). It affects no row, and so rolls the effect
/// back, when this delivery no longer holds the claim.
pub fn handled_mark(db: &Database, key: MessageKey<'_>, token: &str) -> LinkedWrite {
    LinkedWrite {
        sql: MARK.replace("{now}", now_sql(db)),
        params: mark_params(key, token, None),
        expect_rows: 1,
    }
}

/// Marks a claimed message handled (`done`) or refused (`rejected`, with the reason) on its
/// own, for a message whose handling wrote nothing else. False when the claim was lost.
pub async fn finish(
    db: &Database,
    key: MessageKey<'_>,
    token: &str,
    rejected: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let sql = MARK.replace("{now}", now_sql(db));
    Ok(execute(db, &sql, &mark_params(key, token, rejected)).await? == 1)
}

/// Gives a claim back after a transient failure, so the next delivery need not wait.
pub async fn release(db: &Database, key: MessageKey<'_>, token: &str) -> Result<(), sqlx::Error> {
    let [tenant, source, id] = key.params();
    execute(
        db,
        "UPDATE inbound_messages SET claimed_until_ms = 0
          WHERE tenant_id = $1 AND source = $2 AND message_id = $3 AND claim_token = $4
            AND status = 'processing'",
        &[tenant, source, id, Param::Text(Some(token.to_string()))],
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

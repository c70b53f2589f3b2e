//! `Idempotency-Key` for command POSTs: the first request with a key records its body hash;
//! a retry with the same body returns the first response; another body is refused.
//!
//! A reservation belongs to the request that made it (`owner`): only that request may give
//! it back after a failure, so a concurrent retry that fails can never free the key under
//! the first request.

use crate::database::Database;
use serde_json::Value;

/// What the key table says about a request.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyState {
    /// First use: the key is now reserved for this body and resource.
    Fresh,
    /// Seen before with the same body; the first response if it was recorded.
    Replay {
        /// The resource the first request created.
        resource_id: String,
        /// The first response (status, body), if it was stored.
        response: Option<(u16, Value)>,
    },
    /// Seen before with a different body or operation.
    Mismatch,
}

/// Reserves `key` for this request (`owner`, e.g. its request id) or reports what it was
/// used for.
pub async fn reserve(
    db: &Database,
    tenant: &str,
    key: &str,
    operation: &str,
    request_hash: &str,
    resource_id: &str,
    owner: &str,
) -> Result<KeyState, sqlx::Error> {
    let insert = db.sql(
        "INSERT INTO idempotency_keys (tenant_id, idempotency_key, operation, request_hash, resource_id, owner)
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant_id, idempotency_key) DO NOTHING",
    );
    let inserted = crate::on_pool!(db, pool => sqlx::query(&insert)
        .bind(tenant).bind(key).bind(operation).bind(request_hash).bind(resource_id).bind(owner)
        .execute(pool).await?.rows_affected());
    if inserted == 1 {
        return Ok(KeyState::Fresh);
    }
    let select = db.sql(
        "SELECT operation, request_hash, resource_id, response_status, response_body
           FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2",
    );
    let row: (
        String,
        String,
        String,
        Option<i32>,
        Option<sqlx::types::Json<Value>>,
    ) = crate::on_pool!(db, pool => sqlx::query_as(&select).bind(tenant).bind(key).fetch_one(pool).await?);
    let (op, hash, resource_id, status, body) = row;
    if op != operation || hash != request_hash {
        return Ok(KeyState::Mismatch);
    }
    let response = match (status, body) {
        (Some(s), Some(b)) => u16::try_from(s).ok().map(|s| (s, b.0)),
        _ => None,
    };
    Ok(KeyState::Replay {
        resource_id,
        response,
    })
}

/// Stores the response of the first request with `key` (the first recorded response wins:
/// every request that may record one ran the same command with the same body).
pub async fn record_response(
    db: &Database,
    tenant: &str,
    key: &str,
    status: u16,
    body: &Value,
) -> Result<(), sqlx::Error> {
    let update = db.sql(
        "UPDATE idempotency_keys SET response_status = $3, response_body = $4
          WHERE tenant_id = $1 AND idempotency_key = $2 AND response_status IS NULL",
    );
    crate::on_pool!(db, pool => sqlx::query(&update)
        .bind(tenant).bind(key).bind(i32::from(status)).bind(sqlx::types::Json(body))
        .execute(pool).await?.rows_affected());
    Ok(())
}

/// Frees `key` after the request that reserved it (`owner`) failed, so that a retry runs
/// again. A request that did not reserve the key frees nothing.
pub async fn release(
    db: &Database,
    tenant: &str,
    key: &str,
    owner: &str,
) -> Result<(), sqlx::Error> {
    let delete = db.sql(
        "DELETE FROM idempotency_keys
          WHERE tenant_id = $1 AND idempotency_key = $2 AND owner = $3 AND response_status IS NULL",
    );
    crate::on_pool!(db, pool => sqlx::query(&delete).bind(tenant).bind(key).bind(owner)
        .execute(pool).await?.rows_affected());
    Ok(())
}

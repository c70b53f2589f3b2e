//! The idempotent-command pattern every use case that creates a resource shares: the
//! caller's `Idempotency-Key` names the resource, is reserved for this request, is given
//! back when the command fails so that a retry runs again, and keeps the answer so that a
//! retry gets the first one. HTTP and gRPC reach it through the use cases alike.

use crate::extract::{IdempotentRequest, Reservation};
use crate::problem::ApiError;
use ferry_domain::{IdError, PromotionId, ProvisioningRunId, TenantId};
use ferry_store::{idempotency, Database};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::fmt::Display;
use std::future::Future;

/// A caller's `Idempotency-Key`: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The key, checked; `field` names it in the refusal (a header or a message field).
    pub fn parse(field: &str, raw: &str) -> Result<Self, ApiError> {
        let key = raw.trim();
        // As a header value may carry it: visible ASCII, inner spaces and tabs allowed.
        let visible = key
            .bytes()
            .all(|b| b.is_ascii_graphic() || b == b' ' || b == b'\t');
        if key.is_empty() || key.len() > 255 || !visible {
            return Err(ApiError::bad_field(
                field,
                "must be 1 to 255 visible ASCII characters",
            ));
        }
        Ok(Self(key.to_string()))
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A caller's key with the request it is bound to: the request as the caller sent it (over
/// HTTP, the body as parsed), so that a retry is recognised whatever version of Ferry
/// stored the key.
#[derive(Debug, Clone, Copy)]
pub struct Keyed<'a> {
    /// The key.
    pub key: &'a IdempotencyKey,
    /// The request it is bound to.
    pub request: &'a Value,
}

/// What a creating use case answers: the resource this request created, or, for a retry,
/// the first request's answer as it was stored (kept as sent, whatever the view's shape in
/// this version).
#[derive(Debug)]
pub enum Created<V> {
    /// This request created it.
    New {
        /// The resource's id.
        id: String,
        /// The resource as the command that created it recorded it.
        view: V,
    },
    /// A retry whose first request answered.
    Replayed {
        /// The resource's id.
        id: String,
        /// The first answer's body.
        answer: Value,
    },
}

impl<V> Created<V> {
    /// The resource's id.
    pub fn id(&self) -> &str {
        match self {
            Self::New { id, .. } | Self::Replayed { id, .. } => id,
        }
    }
}

impl<V: DeserializeOwned> Created<V> {
    /// The resource as a view (a replayed answer decoded), for a transport that needs it typed.
    pub fn into_view(self) -> Result<V, ApiError> {
        match self {
            Self::New { view, .. } => Ok(view),
            Self::Replayed { answer, .. } => {
                serde_json::from_value(answer).map_err(ApiError::internal)
            }
        }
    }
}

/// The id of a resource a creating command makes: name-based under the caller's key (a
/// retry after a crash lands on the same resource), else random.
pub trait CreatedId: Display + Sized {
    /// The id the key names in the tenant.
    fn for_key(tenant: &TenantId, key: &str) -> Self;
    /// A fresh random id.
    fn random() -> Self;
    /// The id a key's record holds.
    fn parse_recorded(recorded: &str) -> Result<Self, IdError>;
}

impl CreatedId for ProvisioningRunId {
    fn for_key(tenant: &TenantId, key: &str) -> Self {
        Self::for_idempotency_key(tenant, key)
    }
    fn random() -> Self {
        Self::new_random()
    }
    fn parse_recorded(recorded: &str) -> Result<Self, IdError> {
        Self::parse(recorded)
    }
}

impl CreatedId for PromotionId {
    fn for_key(tenant: &TenantId, key: &str) -> Self {
        Self::for_idempotency_key(tenant, key)
    }
    fn random() -> Self {
        Self::new_random()
    }
    fn parse_recorded(recorded: &str) -> Result<Self, IdError> {
        Self::parse(recorded)
    }
}

/// One creating command under an optional idempotency key.
pub struct IdempotentCommand<'a> {
    /// The store holding the keys.
    pub db: &'a Database,
    /// The caller's tenant (keys are per tenant).
    pub tenant: &'a TenantId,
    /// The key and its request, if the caller sent a key.
    pub keyed: Option<Keyed<'a>>,
    /// The operation (a key is bound to one).
    pub operation: &'static str,
    /// This request (only it may give the key back).
    pub owner: String,
}

impl IdempotentCommand<'_> {
    /// Runs `command` on the resource the caller's key names, or on a new one without a key
    /// (see [`Self::run`]): the one helper every creating use case goes through.
    pub async fn create<Id, V, Fut>(
        self,
        command: impl FnOnce(Id) -> Fut,
    ) -> Result<Created<V>, ApiError>
    where
        Id: CreatedId,
        V: Serialize,
        Fut: Future<Output = Result<V, ApiError>>,
    {
        let fresh = match &self.keyed {
            Some(keyed) => Id::for_key(self.tenant, keyed.key.as_str()),
            None => Id::random(),
        };
        self.run(
            fresh,
            |recorded| Id::parse_recorded(recorded).map_err(ApiError::internal),
            command,
        )
        .await
    }

    /// Runs `command` on the resource id the key names (`fresh` for a new key or no key, the
    /// first request's when it reserved one and has not answered), gives the key back when
    /// it fails, and stores its answer; a retry whose first request answered gets that
    /// answer, and the same key with another request or operation is refused.
    pub async fn run<Id, V, Fut>(
        self,
        fresh: Id,
        parse: impl FnOnce(&str) -> Result<Id, ApiError>,
        command: impl FnOnce(Id) -> Fut,
    ) -> Result<Created<V>, ApiError>
    where
        Id: Display,
        V: Serialize,
        Fut: Future<Output = Result<V, ApiError>>,
    {
        let Some(Keyed { key, request }) = self.keyed else {
            let id = fresh.to_string();
            return Ok(Created::New {
                view: command(fresh).await?,
                id,
            });
        };
        let reservation = IdempotentRequest {
            key: key.as_str(),
            operation: self.operation,
            body: request,
            resource_id: &fresh.to_string(),
            owner: &self.owner,
        };
        let id = match reservation.reserve(self.db, self.tenant.as_str()).await? {
            Reservation::Replay { resource_id, body } => {
                return Ok(Created::Replayed {
                    id: resource_id,
                    answer: body,
                })
            }
            // The first request's resource, made under whichever names its version derived.
            Reservation::Proceed(recorded) => parse(&recorded)?,
        };
        let id_text = id.to_string();
        match command(id).await {
            Ok(view) => {
                let body = serde_json::to_value(&view).map_err(ApiError::internal)?;
                idempotency::record_response(
                    self.db,
                    self.tenant.as_str(),
                    key.as_str(),
                    201,
                    &body,
                )
                .await?;
                Ok(Created::New { id: id_text, view })
            }
            Err(e) => {
                idempotency::release(self.db, self.tenant.as_str(), key.as_str(), &self.owner)
                    .await?;
                Err(e)
            }
        }
    }
}

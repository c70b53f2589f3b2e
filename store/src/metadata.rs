//! The metadata stored with every event: who did it, for which tenant, and which request,
//! correlation and causation it belongs to.

use ferry_domain::{Actor, TenantId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use uuid::Uuid;

/// Metadata of one command's events (ARCHITECTURE.md, The path of one request). The event id is a column of its own,
/// unique per event; the stream reader puts it back beside these fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EventMetadata {
    /// The tenant the command ran for.
    pub tenant_id: TenantId,
    /// The `sub` of the caller's token, or `system:<worker>`.
    pub actor: Actor,
    /// Ties together everything done for one business operation.
    pub correlation_id: Uuid,
    /// The event or request that caused this command.
    pub causation_id: Uuid,
    /// The HTTP request (or message) id.
    pub request_id: Uuid,
}

impl EventMetadata {
    /// Metadata for a command caused directly by request `request_id`.
    pub fn for_request(tenant_id: TenantId, actor: Actor, request_id: Uuid) -> Self {
        Self {
            tenant_id,
            actor,
            correlation_id: request_id,
            causation_id: request_id,
            request_id,
        }
    }

    /// The flat map cqrs-es stores.
    pub fn to_map(&self) -> HashMap<String, String> {
        HashMap::from([
            ("tenantId".to_string(), self.tenant_id.to_string()),
            ("actor".to_string(), self.actor.to_string()),
            ("correlationId".to_string(), self.correlation_id.to_string()),
            ("causationId".to_string(), self.causation_id.to_string()),
            ("requestId".to_string(), self.request_id.to_string()),
        ])
    }
}

//! The provisioning context's integration event payloads and their subjects, field for
//! field as other services expect them.
//!
//! Fields a domain event does not carry (a run's environment, kind, promotion, project and
//! specification version) come from the run's `ProvisioningRequested` event.

use ferry_domain::{
    EnvironmentId, ProjectId, PromotionId, ProvisioningKind, ProvisioningRunId, SpecificationId,
    SpecificationKind, TenantId,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// `SpecificationDeclared` (integration).
pub const SPECIFICATION_DECLARED: &str = "provisioning.specifications.v1.specification-declared";
/// `ProvisioningPlanned` (integration).
pub const PROVISIONING_PLANNED: &str = "provisioning.runs.v1.provisioning-planned";
/// `ProvisioningApplied` (integration).
pub const PROVISIONING_APPLIED: &str = "provisioning.runs.v1.provisioning-applied";
/// `ProvisioningFailed` (integration).
pub const PROVISIONING_FAILED: &str = "provisioning.runs.v1.provisioning-failed";

/// `provisioning.specifications.v1.specification-declared`: a desired-state version exists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SpecificationDeclaredPayload {
    /// The specification.
    pub specification_id: SpecificationId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Environment or workload.
    pub kind: SpecificationKind,
    /// The new version (1, 2, …).
    pub version: u32,
    /// The commit of the program.
    pub program_version: String,
}

/// What a plan would do, in numbers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlanSummary {
    /// Resources to create.
    pub adds: u32,
    /// Resources to update in place.
    pub changes: u32,
    /// Resources to delete.
    pub deletes: u32,
    /// Resources to replace.
    pub replaces: u32,
    /// Resources the plan lists (all operations, unchanged ones included).
    pub resources: u32,
}

/// `provisioning.runs.v1.provisioning-planned`: a plan exists and may await approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProvisioningPlannedPayload {
    /// The run.
    pub provisioning_run_id: ProvisioningRunId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Why the run exists.
    pub kind: ProvisioningKind,
    /// The promotion that asked for it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion_id: Option<PromotionId>,
    /// Adds, changes, deletes, replaces and the resource count.
    pub plan_summary: PlanSummary,
}

/// `provisioning.runs.v1.provisioning-applied`: the desired state was applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProvisioningAppliedPayload {
    /// The run.
    pub provisioning_run_id: ProvisioningRunId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The project of the specification.
    pub project_id: ProjectId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Why the run exists.
    pub kind: ProvisioningKind,
    /// The promotion that asked for it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion_id: Option<PromotionId>,
    /// The specification version applied.
    pub specification_version: u32,
    /// The program's outputs.
    pub outputs: BTreeMap<String, Value>,
}

/// `provisioning.runs.v1.provisioning-failed`: planning or the apply failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProvisioningFailedPayload {
    /// The run.
    pub provisioning_run_id: ProvisioningRunId,
    /// The owning tenant.
    pub tenant_id: TenantId,
    /// The environment.
    pub environment_id: EnvironmentId,
    /// Why the run exists.
    pub kind: ProvisioningKind,
    /// The promotion that asked for it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion_id: Option<PromotionId>,
    /// Why it failed (names the failing resource or reference where known).
    pub reason: String,
}

// Ferry's own run outcomes come back through the inbound consumers when an operator's
// stream stores them; the promotions context registers them (`InboundKind::echo`).
impl ferry_messaging::InboundEvent for ProvisioningAppliedPayload {
    const NAME: &'static str = "ProvisioningApplied";
    const SUBJECT: &'static str = PROVISIONING_APPLIED;
    const SUMMARY: &'static str =
        "Provisioning reports the desired state applied (promotions start verification).";
    fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }
}

impl ferry_messaging::InboundEvent for ProvisioningFailedPayload {
    const NAME: &'static str = "ProvisioningFailed";
    const SUBJECT: &'static str = PROVISIONING_FAILED;
    const SUMMARY: &'static str = "Provisioning reports failure (promotions fail).";
    fn tenant_id(&self) -> &TenantId {
        &self.tenant_id
    }
}

//! Ports for what a plan is made of and where its artifacts go: the program source (Git),
//! secrets, configuration, policy, and the artifact store.

use super::SecretValue;
use crate::confinement::Refusal;
use crate::ids::TenantId;
use crate::receipts::PolicyDecision;
use crate::values::{
    ConfigRef, EnvironmentClass, ProgramRef, ProgramVersion, ProvisioningKind, SecretRef,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Why a program could not be read. The reason names the reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// The repository could not be opened or fetched.
    #[error("repository {repository} cannot be read: {reason}")]
    Repository {
        /// The repository part of the reference.
        repository: String,
        /// Why.
        reason: String,
    },
    /// The commit does not exist in the repository.
    #[error("commit {commit} not found in {repository}")]
    CommitNotFound {
        /// The repository.
        repository: String,
        /// The commit.
        commit: String,
    },
    /// The tenant may not read this program (see [`crate::confinement`]).
    #[error("program {reference} refused: {refusal}")]
    Refused {
        /// The program reference.
        reference: String,
        /// Which rule refused it.
        #[source]
        refusal: Refusal,
    },
    /// The folder does not exist at that commit.
    #[error("folder {folder} not found at commit {commit} of {repository}")]
    FolderNotFound {
        /// The repository.
        repository: String,
        /// The commit.
        commit: String,
        /// The folder.
        folder: String,
    },
    /// The tree holds an entry that cannot be checked out without leaving the program's
    /// folder (or that is unsafe or too big to write): the whole checkout is refused.
    #[error(
        "repository {repository} at commit {commit}: entry {entry} cannot be checked out: {reason}"
    )]
    Entry {
        /// The repository.
        repository: String,
        /// The commit.
        commit: String,
        /// The entry's path in the repository.
        entry: String,
        /// Why.
        reason: String,
    },
}

/// A program checked out at a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkout {
    /// The program's folder on disk.
    pub program_dir: PathBuf,
    /// The full commit id that was checked out.
    pub commit: String,
}

/// Reads programs from Git, for one tenant: only what the tenant may reach.
#[async_trait::async_trait]
pub trait ProgramSource: Send + Sync {
    /// Writes the tree of `version` (the folder of `program`) under `into` and says where.
    async fn checkout(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
        into: &Path,
    ) -> Result<Checkout, SourceError>;

    /// Whether `version` exists and holds the folder of `program`, found as a checkout
    /// would find it, without writing or fetching anything: `CommitNotFound` or
    /// `FolderNotFound` when it does not, `Repository` when that cannot be told here (a
    /// remote repository not cached, or a commit not fetched yet).
    async fn locate(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
    ) -> Result<(), SourceError>;
}

/// A secret, resolved, with a version that changes when the secret does but reveals
/// nothing about it (goes into the inputs hash).
#[derive(Debug, Clone)]
pub struct ResolvedSecret {
    /// The value.
    pub value: SecretValue,
    /// A version or fingerprint that is safe to store.
    pub version: String,
}

/// Why a secret could not be resolved (never contains the value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("secret {reference}: {reason}")]
pub struct SecretError {
    /// The reference.
    pub reference: String,
    /// Why.
    pub reason: String,
}

/// Resolves secret references at the moment a runner needs them, for one tenant: only what
/// the tenant may reach.
#[async_trait::async_trait]
pub trait SecretResolver: Send + Sync {
    /// Resolves one reference of `tenant`.
    async fn resolve(
        &self,
        tenant: &TenantId,
        reference: &SecretRef,
    ) -> Result<ResolvedSecret, SecretError>;
}

/// Configuration values gathered from the references, with warnings for degraded ones.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResolvedConfig {
    /// Values by configuration name.
    pub values: BTreeMap<String, serde_json::Value>,
    /// E.g. "app: https://… unreachable; using the last known good values from …".
    pub warnings: Vec<String>,
}

/// Why configuration could not be resolved (no last known good value to fall back on).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("configuration {name} ({reference}): {reason}")]
pub struct ConfigError {
    /// The configuration name.
    pub name: String,
    /// The reference.
    pub reference: String,
    /// Why.
    pub reason: String,
}

/// Resolves configuration references (failure mode: degrade to the last known good values),
/// for one tenant: only what the tenant may reach (a refused reference never degrades).
#[async_trait::async_trait]
pub trait ConfigSource: Send + Sync {
    /// Resolves every reference for an environment of `tenant`.
    async fn resolve(
        &self,
        tenant: &TenantId,
        environment_id: &str,
        refs: &BTreeMap<String, ConfigRef>,
    ) -> Result<ResolvedConfig, ConfigError>;
}

/// What policy sees of a plan.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyInput {
    /// The environment.
    pub environment_id: String,
    /// Its class; `None` = unknown (treated as production).
    pub environment_class: Option<EnvironmentClass>,
    /// The run's kind.
    pub kind: ProvisioningKind,
    /// Whether the run carries the promotion's approval.
    pub has_promotion_approval: bool,
    /// Whether the run restores the previous release under a rollback's authority.
    pub rollback: bool,
    /// Plan counts.
    pub adds: u32,
    /// Plan counts.
    pub changes: u32,
    /// Plan counts.
    pub deletes: u32,
    /// Plan counts.
    pub replaces: u32,
    /// The resources (urn, type, op).
    pub resources: Vec<crate::receipts::PlannedResource>,
}

/// Why policy could not decide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy evaluation failed: {0}")]
pub struct PolicyError(pub String);

/// Evaluates policy on every plan.
pub trait PolicyEngine: Send + Sync {
    /// allow / require_approval / deny, with the reasons as evidence.
    fn evaluate(&self, input: &PolicyInput) -> Result<PolicyDecision, PolicyError>;
}

/// What deployment-domain policy sees of a promotion (package `ferry.deployment`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeploymentPolicyInput {
    /// The environment.
    pub environment_id: String,
    /// Its class; absent = unknown (treated as production).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub environment_class: Option<EnvironmentClass>,
    /// The release's project.
    pub project_id: String,
    /// The release.
    pub release_id: String,
    /// The release's version.
    pub release_version: String,
    /// The hotfix reason; absent unless the promotion is a hotfix (Rego counts `null` as
    /// true, so it is left out rather than sent as `null`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hotfix: Option<String>,
    /// True for a rollback (a promotion of the release last completed there).
    pub rollback: bool,
    /// True when the release carries agent-generated assets.
    pub has_agent_generated_assets: bool,
}

/// A deployment-domain decision: allow, require an approval or deny, with reasons; and
/// whether a hotfix may skip the prior environment class (the `hotfix` set's reasons; empty
/// = not allowed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeploymentDecision {
    /// The decision and its reasons.
    pub decision: PolicyDecision,
    /// Why a hotfix may skip the promotion path; empty when it may not.
    pub hotfix_allowed: Vec<String>,
}

/// Evaluates deployment-domain policy on every promotion.
pub trait DeploymentPolicy: Send + Sync {
    /// The decision for `input`.
    fn evaluate_promotion(
        &self,
        input: &DeploymentPolicyInput,
    ) -> Result<DeploymentDecision, PolicyError>;
}

/// Why an artifact could not be stored or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("artifact {key}: {reason}")]
pub struct ArtifactError {
    /// The artifact key.
    pub key: String,
    /// Why.
    pub reason: String,
}

/// Stores logs and state snapshots (local folder, S3, Azure Blob, GCS).
#[async_trait::async_trait]
pub trait ArtifactStore: Send + Sync {
    /// Stores `bytes` under `key`; returns the reference to keep on the run (`logsRef`).
    async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<String, ArtifactError>;
    /// Reads an artifact back by its reference.
    async fn get(&self, reference: &str) -> Result<Vec<u8>, ArtifactError>;
}

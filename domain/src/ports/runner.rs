//! The IaC runner port: plan (preview) and apply a program checked out on disk, for one
//! stack (= environment). Adapters: `pulumi` (the CLI), `simulated` (a Pulumi YAML
//! evaluator against a local simulated cloud), `http` (a remote runner).

use super::SecretValue;
use crate::receipts::PlannedResource;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Everything a runner needs for one preview or apply.
#[derive(Debug, Clone)]
pub struct RunnerInput {
    /// The environment; also the stack name.
    pub environment_id: String,
    /// The checked-out program folder (the `<folder>` of the program reference).
    pub program_dir: PathBuf,
    /// Resolved configuration values by key.
    pub config: BTreeMap<String, serde_json::Value>,
    /// Resolved secret values by key; never logged or stored.
    pub secrets: BTreeMap<String, SecretValue>,
    /// Give up after this long.
    pub timeout: Duration,
}

/// A parsed plan: counts and the resource list (the core of the plan receipt).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PlanSummary {
    /// Resources to create.
    pub adds: u32,
    /// Resources to update in place.
    pub changes: u32,
    /// Resources to delete.
    pub deletes: u32,
    /// Resources to replace.
    pub replaces: u32,
    /// Every resource the plan touches, with its operation (unchanged ones included).
    pub resources: Vec<PlannedResource>,
}

/// What a preview produced.
#[derive(Debug, Clone)]
pub struct PreviewOutcome {
    /// The parsed plan.
    pub plan: PlanSummary,
    /// The raw runner output (redact before storing).
    pub log: String,
}

/// What a successful apply produced.
#[derive(Debug, Clone)]
pub struct ApplyOutcome {
    /// The program's outputs.
    pub outputs: BTreeMap<String, serde_json::Value>,
    /// The raw runner output (redact before storing).
    pub log: String,
}

/// Why a runner failed. Each carries a reason a person can act on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RunnerError {
    /// The runner binary or service is not there.
    #[error("runner unavailable: {0}")]
    Unavailable(String),
    /// The runner did not finish in time.
    #[error("runner timed out after {0:?}")]
    TimedOut(Duration),
    /// The program failed; `resource` names the failing resource where the output does.
    #[error("{reason}")]
    ProgramFailed {
        /// What went wrong.
        reason: String,
        /// The failing resource (URN or name), if known.
        resource: Option<String>,
        /// The raw output (redact before storing).
        log: String,
    },
    /// The runner's output could not be understood.
    #[error("runner output not understood: {0}")]
    BadOutput(String),
    /// The program itself is invalid (e.g. a Pulumi.yaml that does not parse).
    #[error("invalid program: {0}")]
    InvalidProgram(String),
}

/// An IaC runner.
#[async_trait::async_trait]
pub trait Runner: Send + Sync {
    /// `pulumi`, `simulated` or `http`: recorded on every receipt.
    fn name(&self) -> &'static str;
    /// The runner's version, recorded on every receipt.
    async fn version(&self) -> Result<String, RunnerError>;
    /// Plans the program against the environment's current state.
    async fn preview(&self, input: &RunnerInput) -> Result<PreviewOutcome, RunnerError>;
    /// Applies the program; returns the outputs.
    async fn apply(&self, input: &RunnerInput) -> Result<ApplyOutcome, RunnerError>;
}

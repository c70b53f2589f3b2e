//! The IaC runner port: plan (preview) and apply a program checked out on disk, for one
//! stack (one tenant's environment, [`StackName`]). Adapters: `pulumi` (the CLI),
//! `simulated` (a Pulumi YAML evaluator against a local simulated cloud), `http` (a remote
//! runner).

use super::identity::RunnerIdentity;
use super::SecretValue;
use crate::ids::{EnvironmentId, TenantId};
use crate::receipts::PlannedResource;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// The stack of one tenant's environment: `<tenant>.<environment>`, where `_`, `.` and `:`
/// of either id are written `_5F`, `_2E` and `_3A`. Only `[A-Za-z0-9_.-]`, as Pulumi stack
/// names must be, and injective: the one `.` left separates the two ids and every `_`
/// starts an escape, so tenant A's `prod` and tenant B's `prod` are two stacks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StackName(String);

impl StackName {
    /// The stack of `environment` of `tenant`.
    pub fn for_environment(tenant: &TenantId, environment: &EnvironmentId) -> Self {
        fn encode(id: &str, out: &mut String) {
            for c in id.chars() {
                match c {
                    '_' | '.' | ':' => out.push_str(&format!("_{:02X}", u32::from(c))),
                    c => out.push(c),
                }
            }
        }
        let mut name = String::new();
        encode(tenant.as_str(), &mut name);
        name.push('.');
        encode(environment.as_str(), &mut name);
        Self(name)
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StackName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Everything a runner needs for one preview or apply.
#[derive(Debug, Clone)]
pub struct RunnerInput {
    /// The tenant the run belongs to: runner state is kept per tenant.
    pub tenant: TenantId,
    /// The environment.
    pub environment_id: String,
    /// The stack: the tenant's environment ([`StackName::for_environment`]).
    pub stack: StackName,
    /// The checked-out program folder (the `<folder>` of the program reference).
    pub program_dir: PathBuf,
    /// Resolved configuration values by key.
    pub config: BTreeMap<String, serde_json::Value>,
    /// Resolved secret values by key; never logged or stored.
    pub secrets: BTreeMap<String, SecretValue>,
    /// Give up after this long.
    pub timeout: Duration,
    /// Read the resources' real state before planning or applying (reconciliation runs, so
    /// that drift made outside Ferry shows: `pulumi preview --refresh`).
    pub refresh: bool,
    /// Resources (URNs) to leave alone: the differences ignore rules left out of the plan
    /// (`pulumi up --exclude`).
    pub exclude: Vec<String>,
    /// The tenant's runner identity (backend, passphrase, credentials), resolved for this
    /// run when the runner [needs one](Runner::needs_identity); never logged or stored.
    /// A runner that needs one refuses to run without it.
    pub identity: Option<RunnerIdentity>,
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
    /// The run has no runner identity of its tenant (names the missing setting).
    #[error("{0}")]
    NoIdentity(String),
}

/// An IaC runner.
#[async_trait::async_trait]
pub trait Runner: Send + Sync {
    /// `pulumi`, `simulated` or `http`: recorded on every receipt.
    fn name(&self) -> &'static str;
    /// Whether the program runs with a tenant's runner identity (a real backend and cloud):
    /// then every run must carry its tenant's ([`RunnerInput::identity`]). The simulated
    /// runner needs none.
    fn needs_identity(&self) -> bool {
        false
    }
    /// The runner's version, recorded on every receipt.
    async fn version(&self) -> Result<String, RunnerError>;
    /// Plans the program against the environment's current state.
    async fn preview(&self, input: &RunnerInput) -> Result<PreviewOutcome, RunnerError>;
    /// Applies the program; returns the outputs.
    async fn apply(&self, input: &RunnerInput) -> Result<ApplyOutcome, RunnerError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(tenant: &str, environment: &str) -> String {
        StackName::for_environment(
            &TenantId::parse(tenant).unwrap_or_else(|e| panic!("{e}")),
            &EnvironmentId::parse(environment).unwrap_or_else(|e| panic!("{e}")),
        )
        .as_str()
        .to_string()
    }

    #[test]
    fn stack_names_are_pulumi_names_and_injective() {
        assert_eq!(stack("acme", "prod"), "acme.prod");
        assert_eq!(stack("acme", "payments-prod"), "acme.payments-prod");
        assert_eq!(stack("a.b", "c"), "a_2Eb.c");
        assert_eq!(stack("a", "b.c"), "a.b_2Ec");
        assert_eq!(stack("t:1", "x_y"), "t_3A1.x_5Fy");
        let ids = [
            "a", "b", "a.b", "b.a", "a_2Eb", "a_", "_a", "a:b", "a-b", "A",
        ];
        let mut seen = std::collections::HashMap::new();
        for t in ids {
            for e in ids {
                let name = stack(t, e);
                assert!(
                    name.chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')),
                    "{name}"
                );
                if let Some(other) = seen.insert(name.clone(), (t, e)) {
                    panic!("{name}: both {other:?} and {:?}", (t, e));
                }
            }
        }
    }
}

//! The simulated runner: evaluates a Pulumi YAML program against a local simulated cloud.
//!
//! * [`program`]: the `Pulumi.yaml` model.
//! * [`eval`]: interpolation and dependency order (secrets kept masked).
//! * [`cloud`]: the state file of a tenant's environment,
//!   `<data_dir>/simulated-cloud/<tenant>/<env>/state.json`.
//! * [`diff`]: desired vs stored, rendered as a `pulumi preview --json` document.
//!
//! `preview` emits that document and parses it with the same [`parse_preview`] the Pulumi
//! runner uses, so one parser serves both. `apply` re-plans, then applies step by step,
//! writing state atomically.
//!
//! **Off the async runtime.** Reading, parsing and planning a program is CPU work that grows
//! with the program (a tenant's program at the size limits takes seconds); it runs on a
//! blocking thread (`spawn_blocking`), never on the runtime's workers, so one tenant's large
//! plan does not stall every other request of the process.
//!
//! **Cancellation.** `apply` takes the data dir's apply lock and hands it, with the whole
//! apply, to a blocking task: a dropped (cancelled) apply either stopped before it read or
//! wrote any state, or its task runs to its end, still holding the lock. A cancellation
//! never leaves a half-applied state behind, nor lets another apply in meanwhile.
//!
//! **Simulation knob:** a resource whose properties contain `simulateFailure: "<message>"`
//! fails at apply with `ProgramFailed { resource: Some(<urn>), reason: "<name>: <message>" }`;
//! the resources applied before it stay in state (a partial apply, as a real cloud would).
//!
//! **Refresh and exclude.** The simulated cloud's state file *is* the cloud (edit it by hand
//! to make drift), so every plan reads the real state and `refresh` has nothing more to
//! read. Resources in `exclude` are left out of the plan and the apply, as `pulumi up
//! --exclude` leaves them: the cloud keeps what it has.
//!
//! Not simulated: the `pulumi:pulumi:Stack` root resource, providers, `fn::` invokes.

pub mod cloud;
pub mod diff;
pub mod eval;
pub mod program;

use crate::preview::parse_preview;
use diff::StepOp;
use ferry_domain::ports::redact;
use ferry_domain::ports::runner::{ApplyOutcome, PreviewOutcome, Runner, RunnerError, RunnerInput};
use ferry_domain::TenantId;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The simulated runner; keeps its cloud under `data_dir`.
#[derive(Debug)]
pub struct SimulatedRunner {
    data_dir: PathBuf,
    // Applies to one data dir are serialised so two runs never interleave state writes.
    apply_lock: Arc<tokio::sync::Mutex<()>>,
}

impl SimulatedRunner {
    /// A runner whose simulated cloud lives under `data_dir/simulated-cloud/`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            apply_lock: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// The state file of a tenant's environment (for inspection and tests).
    pub fn state_path(
        &self,
        tenant: &TenantId,
        environment_id: &str,
    ) -> Result<PathBuf, RunnerError> {
        cloud::state_path(&self.data_dir, tenant, environment_id)
    }
}

/// Runs `work` on a blocking thread (see the module doc).
async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, RunnerError> + Send + 'static,
) -> Result<T, RunnerError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| RunnerError::Unavailable(format!("the simulated runner's task failed: {e}")))?
}

/// Loads program and state, and plans; returns the plan, the state and its path.
fn plan(
    data_dir: &Path,
    input: &RunnerInput,
) -> Result<(diff::Plan, cloud::CloudState, PathBuf), RunnerError> {
    let program = program::Program::load(&input.program_dir)?;
    let path = cloud::state_path(data_dir, &input.tenant, &input.environment_id)?;
    let state = cloud::load(&path)?;
    let mut plan = diff::plan(&program, input, &state)?;
    // `--exclude`: an excluded resource keeps what the cloud has, whatever the program says.
    plan.changes
        .retain(|c| c.op == StepOp::Same || !input.exclude.contains(&c.urn));
    Ok((plan, state, path))
}

fn render(plan: &diff::Plan) -> Result<String, RunnerError> {
    serde_json::to_string_pretty(&diff::to_document(plan))
        .map_err(|e| RunnerError::BadOutput(format!("cannot render preview: {e}")))
}

#[async_trait::async_trait]
impl Runner for SimulatedRunner {
    fn name(&self) -> &'static str {
        "simulated"
    }

    async fn version(&self) -> Result<String, RunnerError> {
        Ok(format!("{}-simulated", env!("CARGO_PKG_VERSION")))
    }

    #[tracing::instrument(skip_all, fields(runner = "simulated", tenant = %input.tenant, env = %input.environment_id))]
    async fn preview(&self, input: &RunnerInput) -> Result<PreviewOutcome, RunnerError> {
        let (data_dir, owned) = (self.data_dir.clone(), input.clone());
        let (summary, log) = off_runtime(move || {
            let (plan, _, _) = plan(&data_dir, &owned)?;
            let json = render(&plan)?;
            let summary = parse_preview(json.as_bytes())?;
            Ok((summary, redact(&json, owned.secrets.values())))
        })
        .await?;
        tracing::info!(
            adds = summary.adds,
            changes = summary.changes,
            deletes = summary.deletes,
            replaces = summary.replaces,
            "simulated preview"
        );
        Ok(PreviewOutcome { plan: summary, log })
    }

    #[tracing::instrument(skip_all, fields(runner = "simulated", tenant = %input.tenant, env = %input.environment_id))]
    async fn apply(&self, input: &RunnerInput) -> Result<ApplyOutcome, RunnerError> {
        let guard = self.apply_lock.clone().lock_owned().await;
        let (data_dir, input) = (self.data_dir.clone(), input.clone());
        off_runtime(move || {
            let _guard = guard;
            apply(&data_dir, &input)
        })
        .await
    }
}

/// The apply itself, under the apply lock (see the module doc).
fn apply(data_dir: &Path, input: &RunnerInput) -> Result<ApplyOutcome, RunnerError> {
    let (plan, mut state, path) = plan(data_dir, input)?;
    let mut log = render(&plan)?;
    log.push('\n');
    state.tenant_id = input.tenant.to_string();
    state.environment_id = input.environment_id.clone();
    state.stack = input.stack.to_string();
    for change in &plan.changes {
        match (change.op, &change.desired) {
            // Unchanged inputs; options (protect, dependencies) may still have changed.
            (StepOp::Same, Some(desired)) => {
                state
                    .resources
                    .insert(change.urn.clone(), diff::stored_form(desired));
                continue;
            }
            (StepOp::Delete, _) | (_, None) => {
                state.resources.remove(&change.urn);
            }
            (_, Some(desired)) => {
                if let Some(message) = desired.inputs.masked.get("simulateFailure") {
                    let message = message
                        .as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| message.to_string());
                    let _ = writeln!(log, "error: {}: {message}", change.urn);
                    cloud::save(&path, &state)?;
                    tracing::warn!(urn = %change.urn, "simulated apply failure");
                    return Err(RunnerError::ProgramFailed {
                        reason: redact(
                            &format!("{}: {message}", desired.name),
                            input.secrets.values(),
                        ),
                        resource: Some(change.urn.clone()),
                        log: redact(&log, input.secrets.values()),
                    });
                }
                state
                    .resources
                    .insert(change.urn.clone(), diff::stored_form(desired));
            }
        }
        let _ = writeln!(log, "{:?} {}", change.op, change.urn);
    }
    let outputs: BTreeMap<String, serde_json::Value> = plan
        .outputs
        .iter()
        .map(|(k, v)| (k.clone(), v.masked.clone()))
        .collect();
    state.outputs = outputs.clone();
    cloud::save(&path, &state)?;
    tracing::info!(resources = state.resources.len(), "simulated apply done");
    Ok(ApplyOutcome {
        outputs,
        log: redact(&log, input.secrets.values()),
    })
}

//! The Pulumi CLI runner: runs `pulumi` as a child process in the program folder, with the
//! tenant's environment as the stack (`<stack>`: [`StackName`](ferry_domain::ports::runner::StackName), e.g. `acme.payments-prod`, so
//! that two tenants' environments of the same name are two stacks).
//!
//! * plan: `pulumi preview --json --stack <stack> --non-interactive`, parsed with
//!   [`parse_preview`];
//! * apply: `pulumi up --yes --skip-preview --json --stack <stack> --non-interactive`, then
//!   `pulumi stack output --json --show-secrets --stack <stack> --non-interactive`;
//! * version: `pulumi version`.
//!
//! **Configuration and secrets** never touch the disk in clear and never appear on the
//! command line (argv is world-readable in `/proc`). When the run has any, Ferry writes a
//! stack settings document (`config: {<project>:<key>: <value>}`) to the child's **stdin**
//! and passes `--config-file /dev/stdin`: a pipe, readable only by the child, gone when it
//! exits. (Pulumi has no environment variable for stack config: `PULUMI_CONFIG` is set by
//! the CLI itself for the language host and would be overwritten; the child's environment
//! is also readable through `/proc/<pid>/environ` by the same user.) Keys without a
//! namespace get the project's name from `Pulumi.yaml`. Consequences: the stack's own
//! `Pulumi.<stack>.yaml` is not read when Ferry supplies configuration, and values arrive
//! as plain (not `secure:`) config, so Ferry redacts every secret value from the output
//! it returns.
//!
//! **The child's environment** is built from nothing (docs/trust-model.md): the program is
//! a tenant's, and Ferry's process holds what no tenant may have (its Vault token, database
//! and NATS credentials, whatever cloud credentials or Pulumi backend the host gave it). The
//! child gets only
//!
//! * from Ferry's environment, what running `pulumi` needs and holds no credential: `PATH`
//!   (pulumi finds its language hosts, plugins, `node`/`python` through it), the locale
//!   (`LANG`, `LC_*`, `TZ`: UTF-8 output and timestamps) and the CA bundle location
//!   (`SSL_CERT_FILE`, `SSL_CERT_DIR`: reaching the backend behind a private CA). Proxy
//!   variables are not passed (their URLs may hold credentials): an identity may set them;
//! * `HOME`, `PULUMI_HOME` and `TMPDIR` in a folder of the tenant's own that Ferry owns
//!   (`<homes>/tenants/<tenant>`, mode 700): pulumi keeps its logins, plugins and workspace
//!   settings there, so one tenant's program can neither read another's login nor plant a
//!   plugin another tenant's run would execute, nor guess another's temporary files;
//! * the run's [`RunnerIdentity`](ferry_domain::ports::identity::RunnerIdentity): its
//!   tenant's backend, passphrase and credentials (`FERRY_RUNNER_IDENTITIES`), or the
//!   shared identity the operator declared. A run without one fails naming the setting.
//!
//! The child runs in a process group of its own. A timeout, or dropping the `preview` or
//! `apply` future before the child exited (the workers do when they lose the apply's lease),
//! kills that whole group (pulumi and the plugins it started), and the child itself through
//! `kill_on_drop`. A non-zero exit is `ProgramFailed`, naming the failing resource when the
//! JSON diagnostics or engine events carry a URN.

use crate::preview::parse_preview;
use ferry_domain::ports::identity::{missing_identity, RunnerIdentity};
use ferry_domain::ports::redact;
use ferry_domain::ports::runner::{ApplyOutcome, PreviewOutcome, Runner, RunnerError, RunnerInput};
use ferry_domain::ports::SecretValue;
use serde_json::Value;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// How long `pulumi version` may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(30);

/// The most a child may write to its standard output (a preview's JSON for a plan at the
/// resource limit fits many times over) and to its standard error: past it, the child is
/// stopped and the run fails, so a program printing without end cannot take Ferry's memory.
pub const MAX_STDOUT_BYTES: u64 = 256 * 1024 * 1024;
/// See [`MAX_STDOUT_BYTES`].
pub const MAX_STDERR_BYTES: u64 = 16 * 1024 * 1024;

/// The Pulumi CLI runner.
#[derive(Debug, Clone)]
pub struct PulumiRunner {
    binary: PathBuf,
    /// Where each tenant's home folder is made (absolute: the child runs elsewhere).
    homes: PathBuf,
    /// The variables of Ferry's environment every child gets ([`is_inherited`]).
    inherited: BTreeMap<OsString, OsString>,
    /// The most read of the child's standard output and standard error.
    output_limits: (u64, u64),
}

/// Reads a child's pipe to its end, or fails once it passed `limit` bytes.
async fn read_bounded(
    pipe: Option<impl tokio::io::AsyncRead + Unpin>,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, RunnerError> {
    use tokio::io::AsyncReadExt;
    let mut bytes = Vec::new();
    if let Some(pipe) = pipe {
        pipe.take(limit.saturating_add(1))
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| RunnerError::Unavailable(format!("reading pulumi's {what}: {e}")))?;
    }
    if bytes.len() as u64 > limit {
        tracing::warn!(limit, what, "pulumi wrote too much; stopping it");
        return Err(RunnerError::BadOutput(format!(
            "pulumi wrote more than {limit} bytes to its {what}; it was stopped"
        )));
    }
    Ok(bytes)
}

/// Whether a variable of Ferry's environment is passed to the child (see the module doc):
/// what pulumi needs to run and that holds no credential.
fn is_inherited(name: &str) -> bool {
    matches!(
        name,
        "PATH" | "LANG" | "TZ" | "SSL_CERT_FILE" | "SSL_CERT_DIR"
    ) || name.starts_with("LC_")
}

/// The child's environment for one run: its home folder and its identity.
struct ChildEnv<'a> {
    home: PathBuf,
    identity: Option<&'a RunnerIdentity>,
}

/// What a finished child printed.
struct Finished {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
}

impl PulumiRunner {
    /// A runner calling the `pulumi` binary at `binary_path`, with each tenant's home under
    /// `homes` (a folder Ferry owns, e.g. `<data dir>/runner-homes`), passing on the
    /// allowed variables of this process's environment.
    pub fn new(binary_path: impl Into<PathBuf>, homes: impl Into<PathBuf>) -> Self {
        Self::with_parent_env(binary_path, homes, std::env::vars_os())
    }

    /// As [`PulumiRunner::new`], with `parent` standing for this process's environment
    /// (only its allowed variables are kept).
    pub fn with_parent_env<K: Into<OsString>, V: Into<OsString>>(
        binary_path: impl Into<PathBuf>,
        homes: impl Into<PathBuf>,
        parent: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        let homes = homes.into();
        let inherited = parent
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .filter(|(k, _): &(OsString, OsString)| k.to_str().is_some_and(is_inherited))
            .collect();
        Self {
            binary: binary_path.into(),
            homes: std::path::absolute(&homes).unwrap_or(homes),
            inherited,
            output_limits: (MAX_STDOUT_BYTES, MAX_STDERR_BYTES),
        }
    }

    /// The same runner reading at most `stdout` and `stderr` bytes of a child's output
    /// (defaults [`MAX_STDOUT_BYTES`], [`MAX_STDERR_BYTES`]).
    pub fn with_output_limits(mut self, stdout: u64, stderr: u64) -> Self {
        self.output_limits = (stdout, stderr);
        self
    }

    /// The home folder of a tenant's runs (or of Ferry's own `pulumi version`), made
    /// owner-only if it is not there yet.
    fn home(&self, tenant: Option<&ferry_domain::TenantId>) -> Result<PathBuf, RunnerError> {
        // Ferry's own folder lies beside the tenants' folder, never in it.
        let home = match tenant {
            Some(t) => self.homes.join("tenants").join(t.path_component()),
            None => self.homes.join("%ferry"),
        };
        for dir in [home.join(".pulumi"), home.join("tmp")] {
            let mut builder = std::fs::DirBuilder::new();
            builder.recursive(true);
            #[cfg(unix)]
            std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
            builder.create(&dir).map_err(|e| {
                RunnerError::Unavailable(format!(
                    "cannot create the runner home {}: {e}",
                    dir.display()
                ))
            })?;
        }
        Ok(home)
    }

    /// The environment of a run of `input`: its tenant's home and identity. Without an
    /// identity the run does not start.
    fn child_env<'a>(&self, input: &'a RunnerInput) -> Result<ChildEnv<'a>, RunnerError> {
        let identity = input
            .identity
            .as_ref()
            .ok_or_else(|| RunnerError::NoIdentity(missing_identity(&input.tenant)))?;
        Ok(ChildEnv {
            home: self.home(Some(&input.tenant))?,
            identity: Some(identity),
        })
    }

    /// Runs the binary with `args` in `dir`, feeding `stdin`, within `timeout`.
    async fn run(
        &self,
        args: &[&str],
        dir: &Path,
        stdin: Option<Vec<u8>>,
        timeout: Duration,
        env: &ChildEnv<'_>,
    ) -> Result<Finished, RunnerError> {
        let mut cmd = Command::new(&self.binary);
        // Built from nothing: see the module doc for each variable and why.
        cmd.env_clear().envs(&self.inherited);
        if let Some(identity) = env.identity {
            cmd.envs(identity.vars().iter().map(|(k, v)| (k, v.expose())));
        }
        cmd.args(args)
            .current_dir(dir)
            .env("HOME", &env.home)
            .env("PULUMI_HOME", env.home.join(".pulumi"))
            .env("TMPDIR", env.home.join("tmp"))
            .env("PULUMI_SKIP_UPDATE_CHECK", "true")
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // Its own process group, so a timeout can kill the plugins pulumi started too.
        #[cfg(unix)]
        cmd.process_group(0);
        let mut child = spawn(&mut cmd, &self.binary).await?;
        let mut group = GroupGuard(child.id());
        if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // Written concurrently with reading the output, so a full pipe cannot deadlock;
            // a child that exits without reading is not an error of ours.
            tokio::spawn(async move {
                let _ = pipe.write_all(&bytes).await;
                let _ = pipe.shutdown().await;
            });
        }
        // On timeout, on too much output, or when this future is dropped, `group` kills the
        // process group and the dropped child is killed by kill_on_drop.
        let (stdout_limit, stderr_limit) = self.output_limits;
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let finished = async {
            let (stdout, stderr) = tokio::try_join!(
                read_bounded(stdout, stdout_limit, "standard output"),
                read_bounded(stderr, stderr_limit, "standard error"),
            )?;
            let status = child.wait().await.map_err(|e| {
                RunnerError::Unavailable(format!("waiting for {}: {e}", self.binary.display()))
            })?;
            Ok::<_, RunnerError>((status, stdout, stderr))
        };
        let (status, stdout, stderr) =
            tokio::time::timeout(timeout, finished)
                .await
                .map_err(|_| {
                    tracing::warn!(?timeout, args = ?args, "pulumi timed out; killing it");
                    RunnerError::TimedOut(timeout)
                })??;
        // It exited by itself: its group id may be reused from now on, never kill it.
        group.0 = None;
        Ok(Finished {
            status,
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        })
    }

    fn stack_args<'a>(
        command: &[&'a str],
        input: &'a RunnerInput,
        with_config: bool,
    ) -> Vec<&'a str> {
        let mut args = command.to_vec();
        args.extend(["--stack", input.stack.as_str(), "--non-interactive"]);
        if with_config {
            args.extend(["--config-file", "/dev/stdin"]);
        }
        args
    }

    /// The flags a preview and an `up` share: `--refresh` for a reconciliation (drift made
    /// outside Ferry shows), `--exclude <urn>` for each resource an ignore rule leaves alone.
    fn change_args<'a>(args: &mut Vec<&'a str>, input: &'a RunnerInput) {
        if input.refresh {
            args.push("--refresh");
        }
        for urn in &input.exclude {
            args.extend(["--exclude", urn.as_str()]);
        }
    }
}

/// Kills the process group led by the child when dropped, unless cleared once the child
/// exited by itself: a timed-out or dropped run leaves no process behind. (A group's id is
/// not reused while a member lives, so the kill only reaches the child's own group.)
struct GroupGuard(Option<u32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            tracing::warn!(pid, "pulumi did not finish; killing its process group");
            kill_group(Some(pid));
        }
    }
}

/// Kills the process group led by `pid` (the child dropped afterwards is killed anyway).
fn kill_group(pid: Option<u32>) {
    #[cfg(unix)]
    if let Some(pgid) = pid.and_then(|p| i32::try_from(p).ok()) {
        let pgid = nix::unistd::Pid::from_raw(pgid);
        if let Err(e) = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL) {
            tracing::debug!(%e, "process group already gone");
        }
    }
    #[cfg(not(unix))]
    let _ = pid;
}

/// Spawns, retrying briefly on "text file busy" (a just-written executable can be held
/// open for writing by a concurrent fork for a moment).
async fn spawn(cmd: &mut Command, binary: &Path) -> Result<tokio::process::Child, RunnerError> {
    let mut attempts = 0;
    loop {
        match cmd.spawn() {
            Ok(child) => return Ok(child),
            Err(e) if e.raw_os_error() == Some(26) && attempts < 5 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(RunnerError::Unavailable(format!(
                    "pulumi binary not found at {}",
                    binary.display()
                )))
            }
            Err(e) => {
                return Err(RunnerError::Unavailable(format!(
                    "cannot run pulumi binary {}: {e}",
                    binary.display()
                )))
            }
        }
    }
}

/// The stack settings document handed over on stdin, or `None` when the run has no
/// configuration (then the stack's own config file is used).
fn config_document(input: &RunnerInput) -> Result<Option<Vec<u8>>, RunnerError> {
    if input.config.is_empty() && input.secrets.is_empty() {
        return Ok(None);
    }
    let project = project_name(&input.program_dir)?;
    let key = |k: &str| {
        if k.contains(':') {
            k.to_string()
        } else {
            format!("{project}:{k}")
        }
    };
    let mut config = serde_yaml::Mapping::new();
    for (k, v) in &input.config {
        let v = serde_yaml::to_value(v).map_err(|e| {
            RunnerError::InvalidProgram(format!("config '{k}' cannot be written as YAML: {e}"))
        })?;
        config.insert(serde_yaml::Value::from(key(k)), v);
    }
    for (k, s) in &input.secrets {
        config.insert(
            serde_yaml::Value::from(key(k)),
            serde_yaml::Value::from(s.expose()),
        );
    }
    let mut doc = serde_yaml::Mapping::new();
    doc.insert("config".into(), serde_yaml::Value::Mapping(config));
    serde_yaml::to_string(&doc)
        .map(|s| Some(s.into_bytes()))
        .map_err(|e| RunnerError::InvalidProgram(format!("cannot write stack config: {e}")))
}

/// The project name from `Pulumi.yaml` (needed to namespace config keys), read inside the
/// program folder only.
fn project_name(dir: &Path) -> Result<String, RunnerError> {
    let text = crate::checkout::read_project_file(dir)?;
    let doc: serde_yaml::Value = serde_yaml::from_str(&text)
        .map_err(|e| RunnerError::InvalidProgram(format!("Pulumi.yaml does not parse: {e}")))?;
    doc.get("name")
        .and_then(|n| n.as_str())
        .map(str::to_string)
        .ok_or_else(|| RunnerError::InvalidProgram("Pulumi.yaml has no project `name`".into()))
}

fn combined_log(f: &Finished, secrets: &BTreeMap<String, SecretValue>) -> String {
    let mut log = f.stdout.clone();
    if !f.stderr.is_empty() {
        log.push_str("\n--- stderr ---\n");
        log.push_str(&f.stderr);
    }
    redact(&log, secrets.values())
}

/// The failure of a non-zero exit: reason and failing resource from the JSON diagnostics
/// or engine events where there are any, else from the text.
fn failure(what: &str, f: &Finished, secrets: &BTreeMap<String, SecretValue>) -> RunnerError {
    let mut docs: Vec<Value> = Vec::new();
    if let Ok(v) = serde_json::from_str::<Value>(&f.stdout) {
        docs.push(v);
    } else {
        docs.extend(
            f.stdout
                .lines()
                .chain(f.stderr.lines())
                .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok()),
        );
    }
    let mut errors = Vec::new();
    for d in &docs {
        collect_errors(d, &mut errors);
    }
    // Prefer an error that names a resource.
    let best = errors
        .iter()
        .find(|(_, urn)| urn.is_some())
        .or_else(|| errors.first())
        .cloned();
    let resource = best
        .as_ref()
        .and_then(|(_, urn)| urn.clone())
        .or_else(|| urn_in_text(&f.stderr))
        .or_else(|| urn_in_text(&f.stdout));
    let detail = best.map(|(m, _)| m).unwrap_or_else(|| {
        f.stderr
            .lines()
            .chain(f.stdout.lines())
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .unwrap_or("no output")
            .to_string()
    });
    let status = f
        .status
        .code()
        .map(|c| format!("status {c}"))
        .unwrap_or_else(|| "a signal".into());
    RunnerError::ProgramFailed {
        reason: redact(
            &format!("pulumi {what} failed ({status}): {detail}"),
            secrets.values(),
        ),
        resource,
        log: combined_log(f, secrets),
    }
}

/// Error diagnostics anywhere in a JSON value: `{severity: "error", message, urn?}`
/// (preview `diagnostics[]`, `diagnosticEvent`) and `resOpFailedEvent.metadata.urn`.
fn collect_errors(v: &Value, out: &mut Vec<(String, Option<String>)>) {
    match v {
        Value::Object(m) => {
            let nonempty = |x: Option<&Value>| {
                x.and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
            };
            if m.get("severity").and_then(Value::as_str) == Some("error") {
                if let Some(msg) = nonempty(m.get("message")) {
                    out.push((msg.trim().to_string(), nonempty(m.get("urn"))));
                }
            }
            if let Some(failed) = m.get("resOpFailedEvent") {
                if let Some(urn) = nonempty(failed.pointer("/metadata/urn")) {
                    out.push((format!("operation failed on {urn}"), Some(urn)));
                }
            }
            m.values().for_each(|x| collect_errors(x, out));
        }
        Value::Array(items) => items.iter().for_each(|x| collect_errors(x, out)),
        _ => {}
    }
}

fn urn_in_text(text: &str) -> Option<String> {
    let start = text.find("urn:pulumi:")?;
    let urn: String = text[start..]
        .chars()
        .take_while(|c| !c.is_whitespace() && !matches!(c, '"' | '\'' | ')' | ','))
        .collect();
    Some(urn)
}

/// Replaces secret values inside every string of a JSON value.
pub(crate) fn redact_json(v: Value, secrets: &BTreeMap<String, SecretValue>) -> Value {
    match v {
        Value::String(s) => Value::String(redact(&s, secrets.values())),
        Value::Array(items) => {
            Value::Array(items.into_iter().map(|x| redact_json(x, secrets)).collect())
        }
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, x)| (k, redact_json(x, secrets)))
                .collect(),
        ),
        other => other,
    }
}

/// Everything to redact from a run's output: its secrets and its identity's values.
fn redactions(input: &RunnerInput) -> BTreeMap<String, SecretValue> {
    let mut all = input.secrets.clone();
    if let Some(identity) = &input.identity {
        for (name, value) in identity.vars() {
            all.insert(format!("identity:{name}"), value.clone());
        }
    }
    all
}

fn remaining(deadline: Instant, timeout: Duration) -> Result<Duration, RunnerError> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or(RunnerError::TimedOut(timeout))
}

#[async_trait::async_trait]
impl Runner for PulumiRunner {
    fn name(&self) -> &'static str {
        "pulumi"
    }

    fn needs_identity(&self) -> bool {
        true
    }

    async fn version(&self) -> Result<String, RunnerError> {
        // No tenant's: Ferry's own home, and no identity.
        let env = ChildEnv {
            home: self.home(None)?,
            identity: None,
        };
        let f = self
            .run(&["version"], &env.home, None, VERSION_TIMEOUT, &env)
            .await?;
        let version = f.stdout.trim();
        if !f.status.success() || version.is_empty() {
            return Err(RunnerError::Unavailable(format!(
                "`{} version` failed: {}",
                self.binary.display(),
                f.stderr.trim()
            )));
        }
        Ok(version.trim_start_matches('v').to_string())
    }

    #[tracing::instrument(skip_all, fields(runner = "pulumi", stack = %input.stack))]
    async fn preview(&self, input: &RunnerInput) -> Result<PreviewOutcome, RunnerError> {
        let env = self.child_env(input)?;
        let secrets = &redactions(input);
        let config = config_document(input)?;
        let mut args = Self::stack_args(&["preview", "--json"], input, config.is_some());
        Self::change_args(&mut args, input);
        let f = self
            .run(&args, &input.program_dir, config, input.timeout, &env)
            .await?;
        if !f.status.success() {
            return Err(failure("preview", &f, secrets));
        }
        let plan = parse_preview(f.stdout.as_bytes())?;
        tracing::info!(
            adds = plan.adds,
            changes = plan.changes,
            deletes = plan.deletes,
            replaces = plan.replaces,
            "pulumi preview"
        );
        Ok(PreviewOutcome {
            plan,
            log: combined_log(&f, secrets),
        })
    }

    #[tracing::instrument(skip_all, fields(runner = "pulumi", stack = %input.stack))]
    async fn apply(&self, input: &RunnerInput) -> Result<ApplyOutcome, RunnerError> {
        let deadline = Instant::now() + input.timeout;
        let env = self.child_env(input)?;
        let secrets = &redactions(input);
        let config = config_document(input)?;
        let mut args = Self::stack_args(
            &["up", "--yes", "--skip-preview", "--json"],
            input,
            config.is_some(),
        );
        Self::change_args(&mut args, input);
        let up = self
            .run(&args, &input.program_dir, config, input.timeout, &env)
            .await?;
        if !up.status.success() {
            return Err(failure("up", &up, secrets));
        }
        let args = Self::stack_args(
            &["stack", "output", "--json", "--show-secrets"],
            input,
            false,
        );
        let out = self
            .run(
                &args,
                &input.program_dir,
                None,
                remaining(deadline, input.timeout)?,
                &env,
            )
            .await?;
        if !out.status.success() {
            return Err(failure("stack output", &out, secrets));
        }
        let outputs = match serde_json::from_str::<Value>(&out.stdout) {
            Ok(Value::Object(m)) => m
                .into_iter()
                .map(|(k, v)| (k, redact_json(v, secrets)))
                .collect(),
            _ => {
                return Err(RunnerError::BadOutput(format!(
                    "`pulumi stack output --json` did not print a JSON object: {}",
                    redact(out.stdout.trim(), secrets.values())
                )))
            }
        };
        Ok(ApplyOutcome {
            outputs,
            log: combined_log(&up, secrets),
        })
    }
}

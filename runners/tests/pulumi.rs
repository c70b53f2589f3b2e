//! The Pulumi CLI runner's process handling, against fake `pulumi` shell scripts.
// Test helpers outside #[test] functions unwrap too: a failed setup is a failed test.
#![allow(clippy::unwrap_used)]

use ferry_domain::ports::runner::{Runner, RunnerError, RunnerInput, StackName};
use ferry_domain::ports::SecretValue;
use ferry_domain::{EnvironmentId, TenantId};
use ferry_runners::PulumiRunner;
use serde_json::json;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tempfile::TempDir;

const SECRET: &str = "s3cr3t-token-value";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pulumi")
        .join(name)
}

/// A folder with a program and a fake `pulumi` whose body is `script`.
struct Fake {
    dir: TempDir,
    runner: PulumiRunner,
}

impl Fake {
    fn new(script: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("pulumi");
        std::fs::write(&bin, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(dir.path().join("program")).unwrap();
        std::fs::write(
            dir.path().join("program/Pulumi.yaml"),
            "name: shop\nruntime: yaml\n",
        )
        .unwrap();
        let env = BTreeMap::from([("FAKE_DIR".to_string(), dir.path().display().to_string())]);
        Self {
            runner: PulumiRunner::new(bin, env),
            dir,
        }
    }
    fn input(&self, timeout: Duration) -> RunnerInput {
        let tenant = TenantId::parse("acme").unwrap();
        let stack = StackName::for_environment(&tenant, &EnvironmentId::parse("dev").unwrap());
        RunnerInput {
            tenant,
            environment_id: "dev".into(),
            stack,
            program_dir: self.dir.path().join("program"),
            config: BTreeMap::from([
                ("region".into(), json!("eu-west-1")),
                ("aws:profile".into(), json!("ci")),
            ]),
            secrets: BTreeMap::from([("apiToken".into(), SecretValue::new(SECRET))]),
            timeout,
            refresh: false,
            exclude: Vec::new(),
        }
    }
    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap()
    }
}

/// The tenant's program never sees Ferry's own settings in its environment.
#[tokio::test]
async fn ferrys_own_variables_stay_out_of_the_programs_environment() {
    std::env::set_var("FERRY_PULUMI_TEST_SIGNING_KEY", "ferry-own-value");
    let script = format!(
        r#"env > "$FAKE_DIR/env"; cat '{}'"#,
        fixture("preview-update.json").display()
    );
    let fake = Fake::new(&script);
    fake.runner
        .preview(&fake.input(Duration::from_secs(10)))
        .await
        .unwrap();
    let env = fake.read("env");
    assert!(
        env.contains("FAKE_DIR="),
        "the runner's own environment is set"
    );
    assert!(!env.contains("ferry-own-value"), "{env}");
    assert!(!env.contains("FERRY_"), "{env}");
    assert!(!env.contains("DATABASE_URL="), "{env}");
}

#[tokio::test]
async fn preview_parses_the_cli_output_and_hands_config_over_stdin() {
    let script = format!(
        r#"echo "$@" > "$FAKE_DIR/args"; pwd > "$FAKE_DIR/cwd"; cat > "$FAKE_DIR/stdin"; cat '{}'"#,
        fixture("preview-update.json").display()
    );
    let fake = Fake::new(&script);
    assert_eq!(fake.runner.name(), "pulumi");
    let out = fake
        .runner
        .preview(&fake.input(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(
        (
            out.plan.adds,
            out.plan.changes,
            out.plan.deletes,
            out.plan.replaces
        ),
        (0, 1, 0, 0)
    );
    assert_eq!(out.plan.resources.len(), 16);
    assert!(out.log.contains("changeSummary"));
    let args = fake.read("args");
    assert_eq!(
        args.trim(),
        "preview --json --stack acme.dev --non-interactive --config-file /dev/stdin"
    );
    assert!(
        !args.contains(SECRET),
        "secrets are not on the command line"
    );
    assert!(fake.read("cwd").trim().ends_with("/program"));
    let stdin: serde_yaml::Value = serde_yaml::from_str(&fake.read("stdin")).unwrap();
    assert_eq!(
        stdin["config"]["shop:region"],
        serde_yaml::Value::from("eu-west-1")
    );
    assert_eq!(
        stdin["config"]["aws:profile"],
        serde_yaml::Value::from("ci")
    );
    assert_eq!(
        stdin["config"]["shop:apiToken"],
        serde_yaml::Value::from(SECRET)
    );
    // Nothing but what the fake itself wrote is in the program folder.
    let files: Vec<_> = std::fs::read_dir(fake.dir.path().join("program"))
        .unwrap()
        .collect();
    assert_eq!(files.len(), 1);
}

#[tokio::test]
async fn without_config_the_stack_file_is_used() {
    let script = format!(
        r#"echo "$@" > "$FAKE_DIR/args"; cat '{}'"#,
        fixture("preview-creates.json").display()
    );
    let fake = Fake::new(&script);
    let mut input = fake.input(Duration::from_secs(10));
    input.config.clear();
    input.secrets.clear();
    let out = fake.runner.preview(&input).await.unwrap();
    assert_eq!(out.plan.adds, 16);
    assert_eq!(
        fake.read("args").trim(),
        "preview --json --stack acme.dev --non-interactive"
    );
    // A reconciliation refreshes first; ignored resources are excluded.
    input.refresh = true;
    input.exclude = vec!["urn:pulumi:dev::sample::aws:s3/bucket:Bucket::docs".into()];
    fake.runner.preview(&input).await.unwrap();
    assert_eq!(
        fake.read("args").trim(),
        "preview --json --stack acme.dev --non-interactive --refresh --exclude urn:pulumi:dev::sample::aws:s3/bucket:Bucket::docs"
    );
}

#[tokio::test]
async fn apply_runs_up_then_reads_outputs() {
    let script = r#"echo "$@" >> "$FAKE_DIR/calls"
case "$1" in
  up) cat > /dev/null; echo '{"result":"succeeded"}' ;;
  stack) printf '{"url":"https://shop.example","token":"%s","n":3}' "s3cr3t-token-value" ;;
  *) exit 9 ;;
esac"#;
    let fake = Fake::new(script);
    let out = fake
        .runner
        .apply(&fake.input(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(out.outputs["url"], json!("https://shop.example"));
    assert_eq!(out.outputs["n"], json!(3));
    assert_eq!(
        out.outputs["token"],
        json!("***"),
        "secret outputs are redacted"
    );
    assert_eq!(
        fake.read("calls"),
        "up --yes --skip-preview --json --stack acme.dev --non-interactive --config-file /dev/stdin\n\
         stack output --json --show-secrets --stack acme.dev --non-interactive\n"
    );
}

#[tokio::test]
async fn failure_names_the_resource_and_redacts_secrets() {
    let script = r#"cat > /dev/null
echo '{"steps":[],"diagnostics":[{"urn":"urn:pulumi:dev::shop::aws:s3/bucket:Bucket::assets","prefix":"error: ","message":"creating bucket: AccessDenied for token s3cr3t-token-value","severity":"error"}]}'
echo 'error: preview failed' >&2
exit 1"#;
    let fake = Fake::new(script);
    match fake
        .runner
        .preview(&fake.input(Duration::from_secs(10)))
        .await
    {
        Err(RunnerError::ProgramFailed {
            reason,
            resource,
            log,
        }) => {
            assert_eq!(
                resource.as_deref(),
                Some("urn:pulumi:dev::shop::aws:s3/bucket:Bucket::assets")
            );
            assert!(
                reason.contains("AccessDenied") && reason.contains("status 1"),
                "{reason}"
            );
            assert!(!reason.contains(SECRET) && !log.contains(SECRET));
            assert!(reason.contains("***"));
            assert!(log.contains("preview failed"));
        }
        other => panic!("expected ProgramFailed, got {other:?}"),
    }
}

#[tokio::test]
async fn up_failure_from_engine_events() {
    let script = r#"cat > /dev/null
echo '{"sequence":1,"resourcePreEvent":{"metadata":{"op":"create","urn":"urn:pulumi:dev::shop::aws:s3/bucket:Bucket::assets"}}}'
echo '{"sequence":2,"diagnosticEvent":{"urn":"urn:pulumi:dev::shop::aws:rds/instance:Instance::db","message":"quota exceeded","severity":"error"}}'
echo '{"sequence":3,"diagnosticEvent":{"message":"update failed","severity":"error"}}'
exit 255"#;
    let fake = Fake::new(script);
    match fake
        .runner
        .apply(&fake.input(Duration::from_secs(10)))
        .await
    {
        Err(RunnerError::ProgramFailed {
            reason, resource, ..
        }) => {
            assert_eq!(
                resource.as_deref(),
                Some("urn:pulumi:dev::shop::aws:rds/instance:Instance::db")
            );
            assert!(reason.contains("quota exceeded"), "{reason}");
            assert!(reason.starts_with("pulumi up failed"), "{reason}");
        }
        other => panic!("expected ProgramFailed, got {other:?}"),
    }
}

#[tokio::test]
async fn plain_text_failure_still_has_a_reason() {
    let fake = Fake::new("echo 'error: no stack named dev found' >&2; exit 2");
    match fake
        .runner
        .preview(&fake.input(Duration::from_secs(10)))
        .await
    {
        Err(RunnerError::ProgramFailed {
            reason, resource, ..
        }) => {
            assert!(reason.contains("no stack named dev found"), "{reason}");
            assert_eq!(resource, None);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn timeout_kills_the_child() {
    let fake = Fake::new("exec sleep 30");
    let started = Instant::now();
    let result = fake
        .runner
        .preview(&fake.input(Duration::from_millis(300)))
        .await;
    assert_eq!(
        result.unwrap_err(),
        RunnerError::TimedOut(Duration::from_millis(300))
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn timeout_kills_the_processes_pulumi_started() {
    let fake = Fake::new(r#"sleep 30 & echo $! > "$FAKE_DIR/grandchild"; wait"#);
    let result = fake
        .runner
        .preview(&fake.input(Duration::from_millis(500)))
        .await;
    assert!(matches!(result, Err(RunnerError::TimedOut(_))));
    wait_gone(fake.read("grandchild").trim()).await;
}

/// The state letter of a process, `None` once it no longer exists.
fn process_state(pid: &str) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit(')').next()?.trim_start().chars().next()
}

/// Waits (at most 3 s) until `pid` is killed: gone, or a zombie until it is reaped.
async fn wait_gone(pid: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let state = process_state(pid);
        if matches!(state, None | Some('Z') | Some('X')) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "process {pid} still running ({state:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (at most 5 s) until the fake wrote a pid into `name`.
async fn wait_pid(fake: &Fake, name: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pid = std::fs::read_to_string(fake.dir.path().join(name)).unwrap_or_default();
        if pid.ends_with('\n') {
            return pid.trim().to_string();
        }
        assert!(Instant::now() < deadline, "no pid in {name}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn dropping_an_apply_kills_pulumi_and_the_processes_it_started() {
    // `up` starts a long child, records both pids, and waits: an apply that never ends.
    let fake = Fake::new(
        r#"cat > /dev/null; sleep 300 & echo $! > "$FAKE_DIR/child.tmp"; mv "$FAKE_DIR/child.tmp" "$FAKE_DIR/child"; echo $$ > "$FAKE_DIR/leader.tmp"; mv "$FAKE_DIR/leader.tmp" "$FAKE_DIR/leader"; wait"#,
    );
    let runner = fake.runner.clone();
    let input = fake.input(Duration::from_secs(600));
    let apply = tokio::spawn(async move { runner.apply(&input).await });
    let leader = wait_pid(&fake, "leader").await;
    let child = wait_pid(&fake, "child").await;
    assert_eq!(
        process_state(&child),
        Some('S'),
        "the child runs before the drop"
    );
    // What the workers do when they lose the lease: drop the apply's future.
    apply.abort();
    assert!(apply.await.unwrap_err().is_cancelled());
    wait_gone(&leader).await;
    wait_gone(&child).await;
}

#[tokio::test]
async fn garbage_output_is_bad_output() {
    let fake = Fake::new("cat > /dev/null; echo 'this is not json'");
    assert!(matches!(
        fake.runner
            .preview(&fake.input(Duration::from_secs(10)))
            .await,
        Err(RunnerError::BadOutput(_))
    ));
    let fake = Fake::new("cat > /dev/null; case \"$1\" in up) echo ok;; *) echo '[garbage';; esac");
    match fake
        .runner
        .apply(&fake.input(Duration::from_secs(10)))
        .await
    {
        Err(RunnerError::BadOutput(r)) => assert!(r.contains("stack output"), "{r}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn missing_binary_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-pulumi");
    let runner = PulumiRunner::new(&missing, BTreeMap::new());
    let tenant = TenantId::parse("acme").unwrap();
    let stack = StackName::for_environment(&tenant, &EnvironmentId::parse("dev").unwrap());
    let input = RunnerInput {
        tenant,
        environment_id: "dev".into(),
        stack,
        program_dir: dir.path().to_path_buf(),
        config: BTreeMap::new(),
        secrets: BTreeMap::new(),
        timeout: Duration::from_secs(5),
        refresh: false,
        exclude: Vec::new(),
    };
    for result in [
        runner.version().await.map(|_| ()),
        runner.preview(&input).await.map(|_| ()),
        runner.apply(&input).await.map(|_| ()),
    ] {
        match result {
            Err(RunnerError::Unavailable(r)) => {
                assert!(r.contains(&missing.display().to_string()), "{r}")
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn version_comes_from_pulumi_version() {
    let fake = Fake::new("[ \"$1\" = version ] && echo v3.150.0");
    assert_eq!(fake.runner.version().await.unwrap(), "3.150.0");
    let broken = Fake::new("echo boom >&2; exit 1");
    assert!(
        matches!(broken.runner.version().await, Err(RunnerError::Unavailable(r)) if r.contains("boom"))
    );
}

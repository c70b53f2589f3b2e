//! The Pulumi CLI runner's process handling and the environment its child gets, against
//! fake `pulumi` shell scripts.
// Test helpers outside #[test] functions unwrap too: a failed setup is a failed test.
#![allow(clippy::unwrap_used)]

use ferry_domain::confinement::{Confinement, ConfinementSettings, FerryFiles};
use ferry_domain::ports::identity::{
    IdentitySpec, RunnerIdentities, RunnerIdentity, VariableName, IDENTITIES_SETTING,
    SHARED_SETTING,
};
use ferry_domain::ports::runner::{Runner, RunnerError, RunnerInput, StackName};
use ferry_domain::ports::sources::{ResolvedSecret, SecretError, SecretResolver};
use ferry_domain::ports::SecretValue;
use ferry_domain::SecretRef;
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

/// What the server's own environment holds and no tenant's program may get: Ferry's
/// settings, its Vault token, the host's cloud credentials and Pulumi backend, a proxy with
/// a password, anything else, and its own home and temporary folder.
const HOST_ENV: &[(&str, &str)] = &[
    ("VAULT_TOKEN", "host-vault-token"),
    ("AWS_ACCESS_KEY_ID", "host-aws-key-id"),
    ("AWS_SECRET_ACCESS_KEY", "host-aws-secret"),
    ("AWS_PROFILE", "host-aws-profile"),
    (
        "GOOGLE_APPLICATION_CREDENTIALS",
        "/etc/host-gcp-credentials.json",
    ),
    ("AZURE_CLIENT_SECRET", "host-azure-secret"),
    ("PULUMI_BACKEND_URL", "s3://host-state"),
    ("PULUMI_CONFIG_PASSPHRASE", "host-passphrase"),
    ("PULUMI_ACCESS_TOKEN", "host-pulumi-token"),
    ("PULUMI_HOME", "/host-pulumi-home"),
    ("FERRY_JWT_HS256_KEY", "host-signing-key"),
    ("FERRY_VAULT_TOKEN", "host-ferry-vault-token"),
    ("DATABASE_URL", "postgres://host-db"),
    ("NATS_URL", "nats://host-nats"),
    ("HTTPS_PROXY", "http://user:host-proxy-pass@proxy"),
    ("SOME_ARBITRARY_VARIABLE", "host-arbitrary"),
    ("HOME", "/host-home"),
    ("TMPDIR", "/host-tmp"),
    ("LANG", "C.UTF-8"),
    ("LC_ALL", "C.UTF-8"),
];

/// The server's environment as the runner is handed it: [`HOST_ENV`] and this test's
/// `PATH` (the fake needs `cat`, `env`, `sleep`).
fn host_env() -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = HOST_ENV
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.push(("PATH".into(), std::env::var("PATH").unwrap()));
    env
}

/// A tenant's identity, its values naming the tenant.
fn identity_of(tenant: &str) -> RunnerIdentity {
    RunnerIdentity::new(BTreeMap::from([
        (
            "PULUMI_BACKEND_URL".into(),
            SecretValue::new(format!("s3://state-{tenant}")),
        ),
        (
            "PULUMI_CONFIG_PASSPHRASE".into(),
            SecretValue::new(format!("pass-{tenant}")),
        ),
        (
            "AWS_ACCESS_KEY_ID".into(),
            SecretValue::new(format!("key-{tenant}")),
        ),
    ]))
}

/// A folder with a program and a fake `pulumi` whose body is `script` (`$FAKE_DIR` is the
/// folder: the child's environment has no room for it).
struct Fake {
    dir: TempDir,
    runner: PulumiRunner,
}

impl Fake {
    fn new(script: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("pulumi");
        std::fs::write(
            &bin,
            format!("#!/bin/sh\nFAKE_DIR='{}'\n{script}\n", dir.path().display()),
        )
        .unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(dir.path().join("program")).unwrap();
        std::fs::write(
            dir.path().join("program/Pulumi.yaml"),
            "name: shop\nruntime: yaml\n",
        )
        .unwrap();
        Self {
            runner: PulumiRunner::with_parent_env(bin, dir.path().join("homes"), host_env()),
            dir,
        }
    }
    fn input(&self, timeout: Duration) -> RunnerInput {
        self.input_for("acme", timeout)
    }
    fn input_for(&self, tenant: &str, timeout: Duration) -> RunnerInput {
        let identity = identity_of(tenant);
        let tenant = TenantId::parse(tenant).unwrap();
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
            identity: Some(identity),
        }
    }
    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap()
    }
    /// The environment the fake wrote into `name` (`env` output), without the variables
    /// the shell sets itself.
    fn env(&self, name: &str) -> BTreeMap<String, String> {
        self.read(name)
            .lines()
            .filter_map(|l| l.split_once('='))
            .filter(|(k, _)| !matches!(*k, "PWD" | "OLDPWD" | "SHLVL" | "_"))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

/// A fake that writes its environment to `env.<stack>` and plans.
fn env_dumping_fake() -> Fake {
    Fake::new(&format!(
        r#"env > "$FAKE_DIR/env.$4"; cat > /dev/null; cat '{}'"#,
        fixture("preview-update.json").display()
    ))
}

/// The program gets what pulumi needs to run, its tenant's identity, and nothing of the
/// server's: no Vault token, cloud credentials, backend, Ferry setting or any other
/// variable; its home and temporary folder are its tenant's own.
#[tokio::test]
async fn a_tenants_program_gets_its_identity_and_nothing_of_the_servers() {
    let fake = env_dumping_fake();
    fake.runner
        .preview(&fake.input(Duration::from_secs(10)))
        .await
        .unwrap();
    let env = fake.env("env.acme.dev");
    let home = fake.dir.path().join("homes/tenants/acme");
    let expected = BTreeMap::from([
        ("PATH".to_string(), std::env::var("PATH").unwrap()),
        ("LANG".to_string(), "C.UTF-8".to_string()),
        ("LC_ALL".to_string(), "C.UTF-8".to_string()),
        ("HOME".to_string(), home.display().to_string()),
        (
            "PULUMI_HOME".to_string(),
            home.join(".pulumi").display().to_string(),
        ),
        ("TMPDIR".to_string(), home.join("tmp").display().to_string()),
        ("PULUMI_SKIP_UPDATE_CHECK".to_string(), "true".to_string()),
        (
            "PULUMI_BACKEND_URL".to_string(),
            "s3://state-acme".to_string(),
        ),
        (
            "PULUMI_CONFIG_PASSPHRASE".to_string(),
            "pass-acme".to_string(),
        ),
        ("AWS_ACCESS_KEY_ID".to_string(), "key-acme".to_string()),
    ]);
    assert_eq!(env, expected);
    let raw = fake.read("env.acme.dev");
    for (name, value) in HOST_ENV {
        if !value.starts_with("C.") {
            assert!(
                !raw.contains(value),
                "{name}'s value reached the program: {raw}"
            );
        }
    }
    // The home is the tenant's alone.
    let mode = std::fs::metadata(&home).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
}

/// Two tenants' programs run with two identities and two homes, neither seeing the other's.
#[tokio::test]
async fn two_tenants_run_with_their_own_identities() {
    let fake = env_dumping_fake();
    for tenant in ["acme", "globex"] {
        fake.runner
            .preview(&fake.input_for(tenant, Duration::from_secs(10)))
            .await
            .unwrap();
    }
    let (acme, globex) = (fake.env("env.acme.dev"), fake.env("env.globex.dev"));
    for name in [
        "PULUMI_BACKEND_URL",
        "PULUMI_CONFIG_PASSPHRASE",
        "AWS_ACCESS_KEY_ID",
        "HOME",
        "TMPDIR",
    ] {
        assert_ne!(acme[name], globex[name], "{name}");
    }
    assert_eq!(globex["PULUMI_BACKEND_URL"], "s3://state-globex");
    let raw = fake.read("env.globex.dev");
    assert!(!raw.contains("acme"), "{raw}");
}

/// The identity's values are redacted from what a failed run reports, as secrets are.
#[tokio::test]
async fn identity_values_never_show_in_the_output() {
    let fake = Fake::new(
        r#"cat > /dev/null; echo "backend $PULUMI_BACKEND_URL pass $PULUMI_CONFIG_PASSPHRASE key $AWS_ACCESS_KEY_ID" >&2; exit 1"#,
    );
    match fake
        .runner
        .preview(&fake.input(Duration::from_secs(10)))
        .await
    {
        Err(RunnerError::ProgramFailed { reason, log, .. }) => {
            for value in ["s3://state-acme", "pass-acme", "key-acme"] {
                assert!(
                    !reason.contains(value) && !log.contains(value),
                    "{reason} {log}"
                );
            }
        }
        other => panic!("{other:?}"),
    }
}

/// A run without an identity never starts the program: it fails naming the setting.
#[tokio::test]
async fn a_run_without_an_identity_fails_naming_the_setting() {
    let fake = Fake::new(r#"echo ran > "$FAKE_DIR/ran"; cat > /dev/null; echo '{}'"#);
    let mut input = fake.input(Duration::from_secs(10));
    input.identity = None;
    for result in [
        fake.runner.preview(&input).await.map(|_| ()),
        fake.runner.apply(&input).await.map(|_| ()),
    ] {
        match result {
            Err(RunnerError::NoIdentity(reason)) => {
                assert!(reason.contains(IDENTITIES_SETTING), "{reason}");
                assert!(reason.contains("acme"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(!fake.dir.path().join("ran").exists());
}

/// Resolves `env://` references from a fixed map, confined per tenant as Ferry's resolver is.
struct TenantSecrets(Confinement, BTreeMap<&'static str, &'static str>);

#[async_trait::async_trait]
impl SecretResolver for TenantSecrets {
    async fn resolve(
        &self,
        tenant: &TenantId,
        reference: &SecretRef,
    ) -> Result<ResolvedSecret, SecretError> {
        let refuse = |reason: String| SecretError {
            reference: reference.to_string(),
            reason,
        };
        self.0
            .check_secret(tenant, reference)
            .map_err(|r| refuse(r.to_string()))?;
        let name = reference.as_str().trim_start_matches("env://");
        let value = self.1.get(name).ok_or_else(|| refuse("unset".into()))?;
        Ok(ResolvedSecret {
            value: SecretValue::new(*value),
            version: "v1".into(),
        })
    }
}

/// From the operator's setting to the child: acme's references resolve in acme's scope;
/// globex, without an identity, gets none unless a shared identity is declared, and then
/// exactly the shared variables of the server, never the others.
#[tokio::test]
async fn the_shared_identity_serves_tenants_without_one_only_when_declared() {
    let confinement = Confinement::new(ConfinementSettings {
        ferry: FerryFiles {
            data_dir: "/var/lib/ferry".into(),
            ..Default::default()
        },
        env_prefix: "TENANT_{tenant}".into(),
        vault_prefix: "{tenant}/".into(),
        ..Default::default()
    })
    .unwrap();
    let secrets = TenantSecrets(
        confinement.clone(),
        BTreeMap::from([
            ("TENANT_acme__PASSPHRASE", "acme-passphrase"),
            ("TENANT_acme__AWS_KEY", "acme-aws-key"),
        ]),
    );
    let acme = IdentitySpec {
        backend: "s3://state-acme".into(),
        passphrase: Some(SecretRef::parse("env://TENANT_acme__PASSPHRASE").unwrap()),
        env: BTreeMap::from([(
            VariableName::parse("AWS_ACCESS_KEY_ID").unwrap(),
            SecretRef::parse("env://TENANT_acme__AWS_KEY").unwrap(),
        )]),
    };
    let tenants = BTreeMap::from([(TenantId::parse("acme").unwrap(), acme)]);
    let fake = env_dumping_fake();
    let run = |identities: RunnerIdentities, tenant: &'static str| {
        let mut input = fake.input_for(tenant, Duration::from_secs(10));
        let secrets = &secrets;
        let runner = fake.runner.clone();
        async move {
            let identity = identities.resolve(&input.tenant, secrets).await;
            input.identity = Some(identity.map_err(|e| e.to_string())?);
            runner.preview(&input).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(())
        }
    };
    let unshared = RunnerIdentities::new(tenants.clone(), None, &confinement).unwrap();
    run(unshared.clone(), "acme").await.unwrap();
    let env = fake.env("env.acme.dev");
    assert_eq!(env["PULUMI_CONFIG_PASSPHRASE"], "acme-passphrase");
    assert_eq!(env["AWS_ACCESS_KEY_ID"], "acme-aws-key");
    let e = run(unshared, "globex").await.unwrap_err();
    assert!(
        e.contains(IDENTITIES_SETTING) && e.contains(SHARED_SETTING),
        "{e}"
    );
    assert!(!fake.dir.path().join("env.globex.dev").exists());

    let host: BTreeMap<&str, &str> = HOST_ENV.iter().copied().collect();
    let shared = RunnerIdentity::shared(&["PULUMI_BACKEND_URL", "AWS_PROFILE"], |name| {
        host.get(name).map(|v| v.to_string())
    })
    .unwrap();
    let declared = RunnerIdentities::new(tenants, Some(shared), &confinement).unwrap();
    run(declared.clone(), "globex").await.unwrap();
    let env = fake.env("env.globex.dev");
    assert_eq!(env["PULUMI_BACKEND_URL"], "s3://host-state");
    assert_eq!(env["AWS_PROFILE"], "host-aws-profile");
    for name in [
        "AWS_SECRET_ACCESS_KEY",
        "VAULT_TOKEN",
        "PULUMI_CONFIG_PASSPHRASE",
    ] {
        assert!(!env.contains_key(name), "{name}");
    }
    // A tenant with its own identity keeps it.
    run(declared, "acme").await.unwrap();
    assert_eq!(
        fake.env("env.acme.dev")["PULUMI_BACKEND_URL"],
        "s3://state-acme"
    );
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

/// A program that prints without end is stopped at the output limit, and the run fails
/// saying so, rather than Ferry's memory growing with it.
#[tokio::test]
async fn endless_output_is_stopped_at_the_limit() {
    for script in ["cat > /dev/null; yes", "cat > /dev/null; yes >&2"] {
        let mut fake = Fake::new(script);
        fake.runner = fake.runner.with_output_limits(64 * 1024, 16 * 1024);
        let started = Instant::now();
        match fake
            .runner
            .preview(&fake.input(Duration::from_secs(20)))
            .await
        {
            Err(RunnerError::BadOutput(r)) => assert!(r.contains("wrote more than"), "{r}"),
            other => panic!("{script}: {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{script}");
    }
}

#[tokio::test]
async fn missing_binary_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-pulumi");
    let runner = PulumiRunner::new(&missing, dir.path().join("homes"));
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
        identity: Some(identity_of("acme")),
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

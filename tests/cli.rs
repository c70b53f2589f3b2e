//! The `ferry` binary: configuration errors, tokens, migrations, projection status and
//! rebuild while a server keeps answering, and the schema check.

mod common;

use common::*;
use ferry_store::database::Backend;
use serde_json::json;
use std::process::Command;

fn ferry(data_dir: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("FERRY_DATA_DIR", data_dir)
        .env("FERRY_LOG", "warn");
    c
}

#[test]
fn a_bad_setting_stops_start_up_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    for (name, value) in [
        ("FERRY_HTTP_ADDR", "not-an-address"),
        ("FERRY_GRPC_ADDR", "port 50051"),
        ("DATABASE_URL", "mysql://nope"),
        ("FERRY_POLL_INTERVAL_MS", "0"),
        ("FERRY_LOG_FORMAT", "xml"),
        ("FERRY_NATS_CREDS_FILE", "/nonexistent/ferry.creds"),
        ("FERRY_NATS_NKEY_SEED_FILE", "/nonexistent/ferry.nk"),
        ("FERRY_NATS_TLS_CA_FILE", "/nonexistent/ca.pem"),
        ("FERRY_NATS_USER", "ferry"),
    ] {
        let out = ferry(dir.path())
            .env(name, value)
            .arg("serve")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{name}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(name), "{name}: {stderr}");
    }
    // A secret setting is named, never shown.
    let out = ferry(dir.path())
        .env("NATS_URL", "nats://127.0.0.1:4222")
        .env("FERRY_NATS_PASSWORD", "pw-never-shown")
        .arg("serve")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("FERRY_NATS_PASSWORD") && !stderr.contains("pw-never-shown"),
        "{stderr}"
    );
    let file = dir.path().join("ferry.toml");
    std::fs::write(&file, "http_addr = 8080\n").unwrap();
    let out = ferry(dir.path())
        .arg("--config")
        .arg(&file)
        .arg("serve")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ferry.toml"));
}

#[test]
fn token_signs_with_the_embedded_key_it_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let out = ferry(dir.path())
        .args([
            "token",
            "--tenant",
            "acme",
            "--sub",
            "alice",
            "--scopes",
            "factory.provisioning.read",
            "--roles",
            "Operator",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).unwrap();
    // Which key signed it is said on stderr, naming the data dir's key file.
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("signed with the embedded key in") && said.contains("jwt-hs256.key"),
        "{said}"
    );
    let key = ferry_api::auth::load_or_create_key(dir.path()).unwrap();
    let verifier = ferry_api::auth::Verifier::hs256(&key, None, None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let caller = rt.block_on(verifier.verify(token.trim())).unwrap();
    // A server with another key refuses it, naming the key it checked against.
    let elsewhere = tempfile::tempdir().unwrap();
    let other_key = ferry_api::auth::load_or_create_key(elsewhere.path()).unwrap();
    let refused = rt
        .block_on(
            ferry_api::auth::Verifier::hs256(&other_key, None, None)
                .described("the embedded key in /srv/other/jwt-hs256.key")
                .verify(token.trim()),
        )
        .unwrap_err();
    assert!(
        refused.to_string().contains("InvalidSignature")
            && refused.to_string().contains("/srv/other/jwt-hs256.key"),
        "{refused}"
    );
    assert_eq!(
        (caller.tenant.as_str(), caller.actor.as_str()),
        ("acme", "alice")
    );
    assert!(caller.require_read().is_ok());
    assert!(caller.require_apply().is_err());

    let bad = ferry(dir.path())
        .args(["token", "--tenant", "a b", "--sub", "x"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let bad = ferry(dir.path())
        .args(["token", "--tenant", "a", "--sub", "x", "--roles", "Boss"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("Boss"));
}

/// A key file the group or others may read or write stops start-up (and `ferry token`)
/// naming the file; made owner-only again, it is used.
#[cfg(unix)]
#[test]
fn a_key_file_others_can_reach_stops_start_up_naming_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join(ferry_api::auth::KEY_FILE);
    ferry_api::auth::load_or_create_key(dir.path()).unwrap();
    let mode = |m: u32| std::fs::set_permissions(&key, std::fs::Permissions::from_mode(m)).unwrap();
    let token = || {
        ferry(dir.path())
            .args(["token", "--tenant", "acme", "--sub", "alice"])
            .output()
            .unwrap()
    };
    mode(0o644);
    let out = token();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&key.display().to_string()), "{stderr}");
    assert!(stderr.contains("mode 644"), "{stderr}");

    let mut serve = ferry(dir.path())
        .env("FERRY_HTTP_ADDR", "127.0.0.1:0")
        .env("FERRY_GRPC_ADDR", "127.0.0.1:0")
        .arg("serve")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            serve.kill().unwrap();
            panic!("ferry serve started with a key others can read");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(!status.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut serve.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains(&key.display().to_string()), "{stderr}");

    mode(0o660);
    assert!(!token().status.success());
    mode(0o600);
    assert!(token().status.success());
}

#[test]
fn token_mints_a_service_identity_for_posting_events() {
    let dir = tempfile::tempdir().unwrap();
    let mint = |args: &[&str]| {
        ferry(dir.path())
            .args(["token", "--tenant", "acme", "--sub", "svc-runcontrol"])
            .args(args)
            .output()
            .unwrap()
    };
    let out = mint(&["--scopes", "factory.events.publish"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = ferry_api::auth::load_or_create_key(dir.path()).unwrap();
    let verifier = ferry_api::auth::Verifier::hs256(&key, None, None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let caller = rt
        .block_on(verifier.verify(String::from_utf8(out.stdout).unwrap().trim()))
        .unwrap();
    assert!(caller.require_event_publisher().is_ok());
    assert!(caller.require_apply().is_err());
    // A person's role with the service scope, or an unknown scope, is refused.
    let bad = mint(&["--scopes", "factory.events.publish", "--roles", "Operator"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("service identities"));
    let bad = mint(&["--scopes", "factory.everything"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("factory.everything"));
}

#[tokio::test]
async fn projections_are_inspected_and_rebuilt_while_the_server_answers() {
    let s = TestServer::start(Backend::Postgres).await;
    let url = s.db.as_ref().unwrap().location.clone();
    let alice = operator("acme", "alice");
    for env in ["dev", "test", "prod"] {
        let (status, spec) = s
            .post(
                &alice,
                "/factory/provisioning/specifications",
                &declaration(env, "3f2a9c1"),
            )
            .await;
        assert_eq!(status, 201);
        let body = json!({"specificationId": spec["specificationId"], "specificationVersion": 1, "environmentId": env, "kind": "Release"});
        assert_eq!(
            s.post(&alice, "/factory/provisioning/runs", &body).await.0,
            201
        );
    }
    // A registered environment: the rebuild must know every context's aggregates.
    let admin = token("acme", "platform", &[READ, APPLY], &["PlatformAdmin"]);
    let r = s
        .client
        .put(s.url("/factory/environments/dev"))
        .bearer_auth(admin)
        .json(&json!({"environmentClass": "development"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response(r).await.0, 201);
    let (_, before) = s.get(&alice, "/factory/provisioning/runs").await;

    let data = s.data_dir.path().to_path_buf();
    let run = |args: &'static [&'static str]| {
        let url = url.clone();
        let data = data.clone();
        tokio::task::spawn_blocking(move || {
            ferry(&data)
                .env("DATABASE_URL", url)
                .args(args)
                .output()
                .unwrap()
        })
    };
    let migrate = run(&["migrate"]).await.unwrap();
    assert!(
        migrate.status.success(),
        "{}",
        String::from_utf8_lossy(&migrate.stderr)
    );

    let rebuild = run(&["projections", "rebuild"]);
    // The API keeps answering while the rebuild runs in another process.
    for _ in 0..20 {
        let (status, page) = s.get(&alice, "/factory/provisioning/runs").await;
        assert_eq!(status, 200);
        assert_eq!(page["items"].as_array().unwrap().len(), 3);
    }
    let rebuild = rebuild.await.unwrap();
    let stdout = String::from_utf8_lossy(&rebuild.stdout);
    assert!(
        rebuild.status.success(),
        "{}",
        String::from_utf8_lossy(&rebuild.stderr)
    );
    for name in ["specifications", "runs", "environments"] {
        assert!(stdout.contains(&format!("rebuilt {name}")), "{stdout}");
    }
    let (_, after) = s.get(&alice, "/factory/provisioning/runs").await;
    assert_eq!(before, after);

    let status = run(&["projections", "status"]).await.unwrap();
    let stdout = String::from_utf8_lossy(&status.stdout);
    assert!(stdout.starts_with("SUBSCRIPTION"), "{stdout}");
    assert!(
        stdout.contains("runs") && stdout.contains("environments"),
        "{stdout}"
    );

    let unknown = run(&["projections", "rebuild", "nonsense"]).await.unwrap();
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("nonsense"));
    s.stop().await;
}

#[test]
fn schemas_check_finds_stale_files() {
    let dir = tempfile::tempdir().unwrap();
    let check = ferry(dir.path())
        .args(["schemas", "--check", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!check.status.success());
    let write = ferry(dir.path())
        .args(["schemas", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(write.status.success());
    let check = ferry(dir.path())
        .args(["schemas", "--check", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(check.status.success());
}

#[test]
fn the_configuration_doc_documents_every_setting() {
    let readme = include_str!("../docs/configuration.md");
    for (key, env, _, _) in ferry_app::config::SETTINGS {
        let name = if env.starts_with("FERRY_BASELINE_PROGRAM_") {
            "FERRY_BASELINE_PROGRAM_"
        } else {
            env
        };
        assert!(
            readme.contains(name),
            "docs/configuration.md does not document {env}"
        );
        let key = if key.starts_with("baseline_program_") {
            "baseline_program_"
        } else {
            key
        };
        assert!(
            readme.contains(&format!("`{key}")),
            "docs/configuration.md does not document the file key {key}"
        );
    }
}

#[test]
fn a_policy_that_does_not_compile_stops_start_up_naming_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies).unwrap();
    std::fs::write(
        policies.join("broken.rego"),
        "package ferry.policy\n\ndeny contains msg if {\n  msg := \n}\n",
    )
    .unwrap();
    let out = ferry(dir.path())
        .env("FERRY_POLICY_DIR", &policies)
        .env("FERRY_HTTP_ADDR", "127.0.0.1:0")
        .arg("serve")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("broken.rego"), "{stderr}");
    assert!(stderr.contains("line"), "{stderr}");
}

#[test]
fn relay_replay_goes_back_only_and_says_how_many_events() {
    let dir = tempfile::tempdir().unwrap();
    let out = ferry(dir.path())
        .args(["relay", "replay", "--after", "yesterday"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a position"));
    // On the embedded store with nothing published yet, replaying from the start is a no-op.
    let out = ferry(dir.path())
        .args(["relay", "replay", "--after", "0"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("will publish 0 events again"));
    let out = ferry(dir.path())
        .args(["relay", "replay", "--after", "5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("would skip events"));
}

/// A free local port (the OS's choice, released for the child to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port")
        .port()
}

#[test]
fn the_demo_shows_a_newcomer_the_path_and_never_mixes_with_other_data() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let port = free_port();
    let mut child = ferry(&data)
        .env("FERRY_HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("FERRY_GRPC_ADDR", format!("127.0.0.1:{}", free_port()))
        .args(["serve", "--demo"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut printed = Vec::new();
    while !printed
        .iter()
        .any(|l: &String| l.contains("sign in as platform"))
    {
        match rx.recv_timeout(std::time::Duration::from_secs(240)) {
            Ok(line) => printed.push(line),
            Err(e) => {
                let _ = child.kill();
                panic!("the demo did not finish ({e}): {printed:?}");
            }
        }
    }
    let link = |who: &str| {
        let line = printed
            .iter()
            .find(|l| l.contains(&format!("as {who} ")))
            .unwrap();
        line.rsplit(' ').next().unwrap().to_string()
    };
    assert!(
        printed
            .iter()
            .any(|l| l.contains(&format!("http://127.0.0.1:{port}/"))),
        "{printed:?}"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    rt.block_on(async {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let bob = link("bob");
        let signed = client.get(&bob).send().await.unwrap();
        assert_eq!(signed.status(), 303);
        let cookie = signed.headers()["set-cookie"].to_str().unwrap();
        let cookie = cookie.split(';').next().unwrap().to_string();
        let page = |path: &'static str| {
            let (client, cookie, base) = (&client, &cookie, &base);
            async move {
                let r = client
                    .get(format!("{base}{path}"))
                    .header("cookie", cookie)
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }
        };
        let (status, board) = page("/").await;
        assert_eq!(status, 200, "{board}");
        for expected in [
            "bob · demo",
            "demo-dev",
            "demo-test",
            "demo-staging",
            "demo-prod",
            "waiting for a Reviewer",
            "quarantined",
            "1.2.0",
            "1.0.0",
        ] {
            assert!(
                board.contains(expected),
                "{expected} missing from the board: {board}"
            );
        }
        let (_, approvals) = page("/approvals").await;
        assert!(
            approvals.contains("/promotions/"),
            "nothing awaits bob: {approvals}"
        );
        // The reconciliation's plan finishes in the background.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let (_, drift) = page("/drift").await;
            if drift.contains("1 to delete") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no drift proposal: {drift}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        // A link works once.
        let again = client.get(&bob).send().await.unwrap();
        assert_eq!(again.status(), 404);

        // The drift proposal, decided on its run's page: not by alice, who asked for the
        // reconciliation, but by the PlatformAdmin.
        let session = |link: String| {
            let client = &client;
            async move {
                let r = client.get(&link).send().await.unwrap();
                let c = r.headers()["set-cookie"].to_str().unwrap();
                c.split(';').next().unwrap().to_string()
            }
        };
        let get = |cookie: &str, path: String| {
            let (client, cookie, base) = (&client, cookie.to_string(), &base);
            async move {
                let r = client
                    .get(format!("{base}{path}"))
                    .header("cookie", cookie)
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }
        };
        let platform = session(link("platform")).await;
        let (_, drift) = get(&platform, "/drift".to_string()).await;
        let run = drift
            .split("href=\"/runs/")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .to_string();
        let alice = session(link("alice")).await;
        let (_, page) = get(&alice, format!("/runs/{run}")).await;
        assert!(
            !page.contains("class=\"decide\""),
            "the requester is offered the decision: {page}"
        );
        // It waits for the PlatformAdmin's decision, not for its requester's.
        let (_, waiting) = get(&platform, "/approvals".to_string()).await;
        assert!(waiting.contains(&format!("/runs/{run}")), "{waiting}");
        let (_, waiting) = get(&alice, "/approvals".to_string()).await;
        assert!(!waiting.contains(&format!("/runs/{run}")), "{waiting}");
        let (status, page) = get(&platform, format!("/runs/{run}")).await;
        assert_eq!(status, 200);
        assert!(page.contains("class=\"decide\""), "{page}");
        let csrf = page
            .split("name=\"csrf\" value=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let decided = client
            .post(format!("{base}/runs/{run}/decide"))
            .header("cookie", &platform)
            .form(&[
                ("csrf", csrf),
                ("decision", "approve"),
                ("reason", "the stray bucket is not ours"),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(decided.status(), 303);
        let (_, page) = get(&platform, format!("/runs/{run}")).await;
        assert!(page.contains("by platform"), "{page}");
    });
    let _ = child.kill();
    let _ = child.wait();
    // The data dir now holds the demo: a second demo there is refused, naming it.
    let out = ferry(&data)
        .env("FERRY_HTTP_ADDR", format!("127.0.0.1:{}", free_port()))
        .args(["serve", "--demo"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("empty data dir") && said.contains(&data.display().to_string()),
        "{said}"
    );
}

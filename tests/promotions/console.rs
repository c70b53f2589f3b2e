//! The console in a real browser: Debian's Chromium, headless, driven through chromedriver
//! (WebDriver). The tests take turns ([`BROWSER`]): one browser at a time, so that the
//! suite still fits two cores.
//!
//! One production promotion is taken to its approval; then, as people would:
//! * the requester (alice, an Operator) signs in, sees the board with the four
//!   environments and the promotion waiting, sees an environment recorded meanwhile appear
//!   on it without a reload, and is offered no Approve button;
//! * a stored `<script>` (a pipeline stage's name) is shown as text, and no dialog opens;
//! * a Reviewer (bob) finds it under `/approvals` and approves it with the keyboard alone;
//! * on `/events`, an event recorded after the page loaded appears without a reload.

use super::*;
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

/// One browser at a time in this test binary.
static BROWSER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A stored name no page may run.
const HOSTILE: &str = "<img src=x onerror=alert(1)><script>alert(2)</script>";

/// chromedriver and a headless Chromium session; both stop when dropped.
struct Browser {
    client: Option<Client>,
    driver: Child,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver and the Chromium it started share a process group of their own:
        // stopping the group leaves no browser behind, even after a failed test.
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "chromedriver (Debian's chromium-driver: the README's test command installs it)",
            );
        let mut browser = Self {
            client: None,
            driver,
        };
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".to_string(),
            json!({"args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                            "--disable-dev-shm-usage", "--window-size=1280,1000"]}),
        );
        let url = format!("http://127.0.0.1:{port}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            match ClientBuilder::new(HttpConnector::new())
                .capabilities(capabilities.clone())
                .connect(&url)
                .await
            {
                Ok(client) => {
                    browser.client = Some(client);
                    return browser;
                }
                Err(error) => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "no browser session: {error}"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
            }
        }
    }

    fn c(&self) -> &Client {
        self.client.as_ref().unwrap()
    }

    async fn sign_in(&self, base: &str, token: &str) {
        let c = self.c();
        c.goto(&format!("{base}/login")).await.unwrap();
        c.find(Locator::Id("token"))
            .await
            .unwrap()
            .send_keys(token)
            .await
            .unwrap();
        c.find(Locator::Css("main form button[type=submit]"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        c.wait()
            .for_element(Locator::Css("header.top"))
            .await
            .unwrap();
    }

    async fn sign_out(&self) {
        let c = self.c();
        c.find(Locator::Css("header.top button.link"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        c.wait().for_element(Locator::Id("token")).await.unwrap();
    }

    /// The page's text (what a person reads).
    async fn text(&self) -> String {
        self.c()
            .find(Locator::Css("body"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Saves the page as `name` in `FERRY_CONSOLE_SCREENSHOTS`, when that folder is set
    /// (how the screenshots in docs/console.md are made).
    async fn screenshot(&self, name: &str) {
        if let Some(dir) = std::env::var_os("FERRY_CONSOLE_SCREENSHOTS") {
            let png = self.c().screenshot().await.unwrap();
            std::fs::write(std::path::Path::new(&dir).join(name), png).unwrap();
        }
    }

    /// No script opened a dialog.
    async fn no_dialog(&self) {
        assert!(
            self.c().get_alert_text().await.is_err(),
            "a dialog is open: a stored script ran"
        );
    }

    /// Waits until the page's text contains `what`.
    async fn wait_for_text(&self, what: &str) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let text = self.text().await;
            if text.contains(what) {
                return text;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{what:?} never appeared in:\n{text}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

/// A production promotion of a release whose pipeline names a stage `HOSTILE`, waiting for
/// its approval with its plan.
async fn awaiting_production_approval(d: &Delivery) -> String {
    let release = uuid::Uuid::new_v4().to_string();
    let pipeline = json!([{"name": HOSTILE, "result": "passed"}]);
    let (status, body) = d.release(&release, "2.0.0", pipeline).await;
    assert_eq!(status, 201, "{body}");
    for env in ["payments-dev", "payments-test", "payments-staging"] {
        let p = d.promote(&release, env, json!({})).await;
        d.wait(&p, "Completed").await;
    }
    let prod = d.promote(&release, "payments-prod", json!({})).await;
    d.wait_until(&prod, "the approval with its plan", |p| {
        p["approvalStatus"] == "Pending" && p["approvalPlan"].is_object()
    })
    .await;
    prod["promotionId"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn people_see_the_path_and_a_reviewer_approves_from_the_promotion_page() {
    let _turn = BROWSER.lock().await;
    let d = with_the_path(Backend::Sqlite, 1).await;
    let promotion = awaiting_production_approval(&d).await;
    let base = d.s.base.clone();
    let mut browser = Browser::start().await;
    let c = browser.c();

    // The requester: the board, and the promotion without a way to approve it.
    browser.sign_in(&base, &promoter("acme", "alice")).await;
    let board = browser
        .wait_for_text("waiting for a Reviewer's approval")
        .await;
    for env in [
        "payments-dev",
        "payments-test",
        "payments-staging",
        "payments-prod",
    ] {
        assert!(
            board.contains(env),
            "{env} missing from the board:\n{board}"
        );
    }
    browser.screenshot("console-board.png").await;
    // Live: an environment recorded now appears on the board without a reload.
    c.wait()
        .for_element(Locator::Css("#board[data-connected=yes]"))
        .await
        .unwrap();
    c.execute("window.stillHere = true;", vec![]).await.unwrap();
    d.environment("payments-extra", "test").await;
    browser.wait_for_text("payments-extra").await;
    let same_page = c
        .execute("return window.stillHere === true;", vec![])
        .await
        .unwrap();
    assert_eq!(same_page, json!(true), "the board was reloaded");
    c.goto(&format!("{base}/promotions/{promotion}"))
        .await
        .unwrap();
    let page = browser.wait_for_text("The plan it covers").await;
    assert!(page.contains("someone else must decide"), "{page}");
    assert!(
        c.find_all(Locator::Css("form.decide"))
            .await
            .unwrap()
            .is_empty(),
        "the requester is offered the decision"
    );
    // The stored markup is text on the page (in the pipeline gate's evidence), and
    // nothing ran.
    c.find(Locator::Css("ol.gates details summary"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let page = browser.text().await;
    assert!(page.contains(HOSTILE), "{page}");
    browser.no_dialog().await;
    assert!(
        c.find_all(Locator::Css("main img, main script"))
            .await
            .unwrap()
            .is_empty(),
        "stored markup became elements"
    );
    browser.sign_out().await;

    // A Reviewer: the approval waits for them; approved with the keyboard alone.
    // The audit trail (below) is read with the provisioning read scope, as over the API.
    let bob = token("acme", "bob", &[READ, D_READ, D_PROMOTE], &["Reviewer"]);
    browser.sign_in(&base, &bob).await;
    c.goto(&format!("{base}/approvals")).await.unwrap();
    c.wait()
        .for_element(Locator::Css(&format!("a[href='/promotions/{promotion}']")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    c.wait()
        .for_element(Locator::Css("form.decide"))
        .await
        .unwrap();
    browser.screenshot("console-promotion.png").await;
    // The plan log is one link away (readable with the delivery read scope alone).
    let back = c.current_url().await.unwrap();
    c.find(Locator::LinkText("the plan log"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    browser.wait_for_text("The plan log").await;
    c.goto(back.as_str()).await.unwrap();
    c.wait()
        .for_element(Locator::Css("form.decide"))
        .await
        .unwrap();
    let reason = c.find(Locator::Id("reason")).await.unwrap();
    reason.click().await.unwrap();
    reason.send_keys("CAB approved").await.unwrap();
    // Tab to the Approve button, Enter to press it.
    c.active_element()
        .await
        .unwrap()
        .send_keys("\u{E004}")
        .await
        .unwrap();
    let focused = c.active_element().await.unwrap();
    assert_eq!(focused.text().await.unwrap(), "Approve");
    focused.send_keys("\u{E007}").await.unwrap();
    browser.wait_for_text("approve by bob").await;
    let (_, api) =
        d.s.get(
            &promoter("acme", "alice"),
            &format!("/factory/delivery/promotions/{promotion}"),
        )
        .await;
    assert_eq!(api["approvalDecision"]["decidedBy"], "bob", "{api}");
    assert_eq!(api["approvalDecision"]["reason"], "CAB approved", "{api}");
    browser.no_dialog().await;

    // The audit trail, live: an environment recorded after the page loaded appears.
    c.goto(&format!("{base}/events")).await.unwrap();
    c.wait()
        .for_element(Locator::Css("tbody#events tr"))
        .await
        .unwrap();
    c.wait()
        .for_element(Locator::Css("tbody#events[data-connected=yes]"))
        .await
        .unwrap();
    c.execute("window.stillHere = true;", vec![]).await.unwrap();
    d.environment("payments-live-check", "test").await;
    browser.wait_for_text("payments-live-check").await;
    let same_page = c
        .execute("return window.stillHere === true;", vec![])
        .await
        .unwrap();
    assert_eq!(same_page, json!(true), "the page was reloaded");
    browser.no_dialog().await;
    // Ends the session, and with it the browser.
    browser.client.take().unwrap().close().await.unwrap();
}

/// A session as a browser would hold it: the sign-in form's cookie and token, then the
/// session cookie (no browser: these checks need none).
struct Session {
    cookie: String,
}

/// The value of `name="<field>" value="…"` in a page.
fn field(html: &str, name: &str) -> String {
    let at = html.find(&format!("name=\"{name}\" value=\"")).unwrap() + name.len() + 15;
    html[at..].split('"').next().unwrap().to_string()
}

impl Session {
    async fn sign_in(d: &Delivery, token: &str) -> Self {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let form = client.get(d.s.url("/login")).send().await.unwrap();
        let login = form.headers()["set-cookie"].to_str().unwrap();
        let login = login.split(';').next().unwrap().to_string();
        let nonce = field(&form.text().await.unwrap(), "csrf");
        let signed = client
            .post(d.s.url("/login"))
            .header("cookie", &login)
            .form(&[("token", token), ("csrf", &nonce), ("next", "/")])
            .send()
            .await
            .unwrap();
        assert_eq!(signed.status(), 303);
        let cookie = signed
            .headers()
            .get_all("set-cookie")
            .iter()
            .map(|v| v.to_str().unwrap())
            .find(|c| c.starts_with("ferry_session="))
            .unwrap();
        for attribute in ["HttpOnly", "SameSite=Strict", "Max-Age="] {
            assert!(cookie.contains(attribute), "{cookie}");
        }
        Self {
            cookie: cookie.split(';').next().unwrap().to_string(),
        }
    }

    async fn get(&self, d: &Delivery, path: &str) -> (u16, String) {
        let r =
            d.s.client
                .get(d.s.url(path))
                .header("cookie", &self.cookie)
                .send()
                .await
                .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    async fn post(&self, d: &Delivery, path: &str, form: &[(&str, &str)]) -> (u16, String) {
        let r = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap()
            .post(d.s.url(path))
            .header("cookie", &self.cookie)
            .form(form)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }
}

#[tokio::test]
async fn the_server_refuses_what_a_page_does_not_offer_and_forms_from_elsewhere() {
    let d = with_the_path(Backend::Sqlite, 1).await;
    let promotion = awaiting_production_approval(&d).await;
    let decide = format!("/promotions/{promotion}/decide");
    // The requester posts the decision the page does not offer them: the use case refuses.
    let alice = Session::sign_in(&d, &promoter("acme", "alice")).await;
    let (_, page) = alice.get(&d, &format!("/promotions/{promotion}")).await;
    let csrf = field(&page, "csrf");
    let (status, page) = alice
        .post(
            &d,
            &decide,
            &[("csrf", &csrf), ("decision", "approve"), ("reason", "me")],
        )
        .await;
    assert!(
        status == 403 || status == 409 || status == 422,
        "{status} {page}"
    );
    assert!(
        page.contains("role="),
        "the refusal is said on the page: {page}"
    );
    // A Reviewer's form without this session's token (another site's form) is refused.
    let bob = Session::sign_in(
        &d,
        &token("acme", "bob", &[D_READ, D_PROMOTE], &["Reviewer"]),
    )
    .await;
    let (status, _) = bob
        .post(
            &d,
            &decide,
            &[("csrf", &csrf), ("decision", "approve"), ("reason", "x")],
        )
        .await;
    assert_eq!(status, 403, "alice's token in bob's session");
    let (_, api) =
        d.s.get(
            &promoter("acme", "alice"),
            &format!("/factory/delivery/promotions/{promotion}"),
        )
        .await;
    assert_eq!(
        api["approvalStatus"], "Pending",
        "nothing was decided: {api}"
    );
    // With the session's own token it is decided.
    let (_, page) = bob.get(&d, &format!("/promotions/{promotion}")).await;
    let (status, _) = bob
        .post(
            &d,
            &decide,
            &[
                ("csrf", &field(&page, "csrf")),
                ("decision", "reject"),
                ("reason", "not now"),
            ],
        )
        .await;
    assert_eq!(status, 303);
    let (_, api) =
        d.s.get(
            &promoter("acme", "alice"),
            &format!("/factory/delivery/promotions/{promotion}"),
        )
        .await;
    assert_eq!(api["approvalDecision"]["decision"], "reject", "{api}");
    // A sign-out posted from elsewhere is refused too.
    let (status, _) = bob.post(&d, "/logout", &[("csrf", "forged")]).await;
    assert_eq!(status, 403);

    // The run behind the approval, the timeline and drift, for a reader of both contexts.
    let olga = Session::sign_in(&d, &token("acme", "olga", &[READ, D_READ], &["Reviewer"])).await;
    let run = api["provisioningRunId"].as_str().unwrap();
    let (status, page) = olga.get(&d, &format!("/runs/{run}")).await;
    assert_eq!(status, 200, "{page}");
    for expected in ["Plan", "Inputs hash", "aws:s3/bucket:Bucket", "Log"] {
        assert!(page.contains(expected), "{expected} missing: {page}");
    }
    let (_, page) = olga.get(&d, &format!("/promotions/{promotion}")).await;
    for expected in ["Timeline", "PromotionRequested", "ApprovalRejected"] {
        assert!(page.contains(expected), "{expected} missing: {page}");
    }
    let (status, page) = olga.get(&d, "/drift").await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("No reconciliation proposes a change"),
        "{page}"
    );
    // Another tenant's run is not found, as over the API.
    let other = Session::sign_in(&d, &token("globex", "gil", &[READ, D_READ], &["Reviewer"])).await;
    let (status, _) = other.get(&d, &format!("/runs/{run}")).await;
    assert_eq!(status, 404);
    let (status, _) = other.get(&d, &format!("/promotions/{promotion}")).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn console_pages_carry_a_policy_and_load_nothing_from_elsewhere() {
    let d = with_the_path(Backend::Sqlite, 1).await;
    let client = &d.s.client;
    // Without a session every page sends the viewer to sign in, and keeps the way back.
    let r = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .get(d.s.url("/approvals"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/login?next=%2Fapprovals");
    let login = client.get(d.s.url("/login")).send().await.unwrap();
    let csp = login.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(directive), "{csp}");
    }
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    let html = login.text().await.unwrap();
    for attribute in ["src=\"", "href=\""] {
        for link in html.split(attribute).skip(1) {
            assert!(link.starts_with('/'), "an asset from elsewhere: {link}");
        }
    }
    assert!(!html.contains("<script>"), "inline script: {html}");
    // A form posted without the session's token is refused.
    let r = client
        .post(d.s.url("/login"))
        .form(&[
            ("token", promoter("acme", "alice")),
            ("csrf", "forged".to_string()),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.headers().get("set-cookie").is_none(), "a session began");
}

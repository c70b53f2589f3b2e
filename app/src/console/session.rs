//! Signing in to the console. The viewer pastes a bearer token; Ferry verifies it as the API
//! would and keeps it in an HttpOnly, SameSite=Strict cookie that ends when the token ends,
//! so a page request is authorised exactly as an API request with that token. Every form
//! carries a CSRF token, an HMAC of the session under the console's key, checked before the
//! action; the sign-in form itself is tied to a random cookie set when it was shown.

use super::layout;
use axum::extract::{FromRequestParts, Query, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Extension, Form};
use axum_extra::extract::cookie::{Cookie, CookieJar, SameSite};
use ferry_api::auth::Caller;
use ferry_api::state::AppState;
use hmac::{Hmac, Mac};
use maud::html;
use serde::Deserialize;
use sha2::Sha256;
use std::sync::Arc;

/// The session cookie: the viewer's bearer token.
pub const SESSION: &str = "ferry_session";
/// The sign-in form's cookie (its CSRF token before there is a session).
const LOGIN: &str = "ferry_login";

/// The key the console's CSRF tokens are signed with (kept in the data dir, so every
/// instance of one deployment accepts the others' forms).
#[derive(Clone)]
pub struct ConsoleKey(Arc<[u8]>);

impl ConsoleKey {
    /// A key of these bytes.
    pub fn new(bytes: Vec<u8>) -> Self {
        Self(bytes.into())
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC accepts any key length")
    }

    /// The CSRF token of a session.
    pub fn csrf(&self, session: &str) -> String {
        let mut mac = self.mac();
        mac.update(b"ferry-console-csrf\0");
        mac.update(session.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `token` is the CSRF token of `session` (compared in constant time).
    pub fn check_csrf(&self, session: &str, token: &str) -> bool {
        let Ok(bytes) = hex::decode(token) else {
            return false;
        };
        let mut mac = self.mac();
        mac.update(b"ferry-console-csrf\0");
        mac.update(session.as_bytes());
        mac.verify_slice(&bytes).is_ok()
    }
}

/// The signed-in viewer of a page: the caller its token makes, and its forms' CSRF token.
pub struct Viewer {
    /// Who, as the API sees them.
    pub caller: Caller,
    /// The token every form of the page carries.
    pub csrf: String,
    session: String,
    key: ConsoleKey,
}

impl Viewer {
    /// Refuses a form whose CSRF token is not this session's.
    pub fn check_csrf(&self, token: &str) -> Result<(), FormRefused> {
        if self.key.check_csrf(&self.session, token) {
            Ok(())
        } else {
            Err(FormRefused)
        }
    }
}

/// A form whose CSRF token is not its session's: refused before anything is done.
#[derive(Debug)]
pub struct FormRefused;

impl IntoResponse for FormRefused {
    fn into_response(self) -> Response {
        (
            StatusCode::FORBIDDEN,
            layout::message_page(
                "Form refused",
                "The form's CSRF token is not this session's: reload the page and try again.",
            ),
        )
            .into_response()
    }
}

/// Where a page that needs a session sends a viewer without one: back to the page after
/// signing in (a form's target only answers its post, so the board instead).
fn to_login(parts: &Parts) -> Response {
    let next = match parts.method {
        axum::http::Method::GET => parts.uri.path_and_query().map_or("/", |p| p.as_str()),
        _ => "/",
    };
    let query = serde_urlencoded::to_string([("next", next)]).unwrap_or_default();
    Redirect::to(&format!("/login?{query}")).into_response()
}

/// A local path to go back to after signing in (never another site: `//host` and
/// `/\host` are refused), of visible ASCII only (it becomes a `Location` header).
fn local(next: Option<&str>) -> String {
    match next {
        Some(n)
            if n.starts_with('/')
                && !n.starts_with("//")
                && !n.starts_with("/\\")
                && n.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            n.to_string()
        }
        _ => "/".to_string(),
    }
}

impl FromRequestParts<AppState> for Viewer {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Response> {
        let Some(key) = parts.extensions.get::<ConsoleKey>().cloned() else {
            tracing::error!("the console's routes were served without their key");
            return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
        };
        let jar = CookieJar::from_headers(&parts.headers);
        let Some(session) = jar.get(SESSION).map(|c| c.value().to_string()) else {
            return Err(to_login(parts));
        };
        match state.verifier().verify(&session).await {
            Ok(caller) => Ok(Self {
                csrf: key.csrf(&session),
                caller,
                session,
                key,
            }),
            // Expired or no longer valid: sign in again.
            Err(_) => Err((
                jar.remove(Cookie::build(SESSION).path("/")),
                to_login(parts),
            )
                .into_response()),
        }
    }
}

/// `GET /login[?next=]`.
#[derive(Debug, Deserialize)]
pub struct LoginQuery {
    next: Option<String>,
}

/// `GET /login`: the sign-in form.
pub async fn login_page(jar: CookieJar, Query(query): Query<LoginQuery>) -> Response {
    let nonce = hex::encode(rand::random::<[u8; 32]>());
    let cookie = Cookie::build((LOGIN, nonce.clone()))
        .http_only(true)
        .same_site(SameSite::Strict)
        .path("/login")
        .build();
    let next = local(query.next.as_deref());
    (jar.add(cookie), login_form(&nonce, &next, None)).into_response()
}

fn login_form(nonce: &str, next: &str, error: Option<&str>) -> layout::Page {
    layout::bare(
        "Sign in",
        html! {
            main class="narrow" {
                h1 { "Sign in to Ferry" }
                @if let Some(error) = error {
                    p class="error" role="alert" { (error) }
                }
                form method="post" action="/login" {
                    input type="hidden" name="csrf" value=(nonce);
                    input type="hidden" name="next" value=(next);
                    label for="token" { "Bearer token" }
                    textarea id="token" name="token" rows="4" required autofocus {}
                    p class="hint" { "A token Ferry accepts on its API (ferry token prints one)." }
                    button type="submit" { "Sign in" }
                }
            }
        },
    )
}

/// Sign-in links that work once (`ferry serve --demo` prints one per demo person): the
/// code names a token Ferry made; following the link starts a session with it.
static LINKS: std::sync::Mutex<Option<std::collections::HashMap<String, String>>> =
    std::sync::Mutex::new(None);

/// A one-time sign-in link's code for `token`.
pub fn one_time_link(token: String) -> String {
    let code = hex::encode(rand::random::<[u8; 24]>());
    LINKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(Default::default)
        .insert(code.clone(), token);
    code
}

/// `GET /login/link/{code}`: signs in with the link's token, once.
pub async fn follow_link(
    State(state): State<AppState>,
    jar: CookieJar,
    axum::extract::Path(code): axum::extract::Path<String>,
) -> Response {
    let token = LINKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_mut()
        .and_then(|links| links.remove(&code));
    let Some(token) = token else {
        return (
            StatusCode::NOT_FOUND,
            layout::message_page(
                "Link used",
                "This sign-in link was used already or never existed: sign in with a token.",
            ),
        )
            .into_response();
    };
    match state.verifier().verify(&token).await {
        Ok(caller) => (jar.add(session_cookie(&caller, token)), Redirect::to("/")).into_response(),
        Err(error) => layout::error_page(error).await,
    }
}

/// The session cookie for `caller`'s `token`: HttpOnly, SameSite=Strict, ending with it.
fn session_cookie(caller: &Caller, token: String) -> Cookie<'static> {
    let now = chrono::Utc::now().timestamp();
    let left = i64::try_from(caller.expires_at()).unwrap_or(i64::MAX) - now;
    Cookie::build((SESSION, token))
        .http_only(true)
        .same_site(SameSite::Strict)
        .path("/")
        .max_age(time::Duration::seconds(left.max(0)))
        .build()
}

/// The sign-in form as posted.
#[derive(Debug, Deserialize)]
pub struct LoginForm {
    token: String,
    csrf: String,
    next: Option<String>,
}

/// `POST /login`: verifies the token and starts the session.
#[tracing::instrument(skip_all)]
pub async fn login(
    State(state): State<AppState>,
    jar: CookieJar,
    Form(form): Form<LoginForm>,
) -> Response {
    let next = local(form.next.as_deref());
    let nonce = jar.get(LOGIN).map(|c| c.value().to_string());
    let same = nonce.as_deref().is_some_and(|n| {
        use subtle::ConstantTimeEq;
        n.as_bytes().ct_eq(form.csrf.as_bytes()).into()
    });
    if !same {
        return (
            StatusCode::FORBIDDEN,
            layout::message_page(
                "Form refused",
                "The sign-in form is stale or came from elsewhere: open /login again.",
            ),
        )
            .into_response();
    }
    let token = form.token.trim().to_string();
    match state.verifier().verify(&token).await {
        Ok(caller) => {
            tracing::info!(tenant = %caller.tenant, actor = %caller.actor, "console sign-in");
            let session = session_cookie(&caller, token);
            let jar = jar.remove(Cookie::build(LOGIN).path("/login")).add(session);
            (jar, Redirect::to(&next)).into_response()
        }
        Err(error) => {
            let nonce = nonce.unwrap_or_default();
            let reason = format!("Ferry did not accept the token: {error}");
            (
                StatusCode::UNAUTHORIZED,
                login_form(&nonce, &next, Some(&reason)),
            )
                .into_response()
        }
    }
}

/// The sign-out form as posted.
#[derive(Debug, Deserialize)]
pub struct LogoutForm {
    csrf: String,
}

/// `POST /logout`: ends the session.
pub async fn logout(
    viewer: Viewer,
    jar: CookieJar,
    Extension(_key): Extension<ConsoleKey>,
    Form(form): Form<LogoutForm>,
) -> Response {
    if let Err(refused) = viewer.check_csrf(&form.csrf) {
        return refused.into_response();
    }
    (
        jar.remove(Cookie::build(SESSION).path("/")),
        Redirect::to("/login"),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_csrf_token_is_the_sessions_and_only_its() {
        let key = ConsoleKey::new(b"k".to_vec());
        let token = key.csrf("session-a");
        assert!(key.check_csrf("session-a", &token));
        assert!(!key.check_csrf("session-b", &token));
        assert!(!ConsoleKey::new(b"other".to_vec()).check_csrf("session-a", &token));
        assert!(!key.check_csrf("session-a", "not hex"));
        assert!(!key.check_csrf("session-a", ""));
    }

    #[test]
    fn after_sign_in_a_viewer_goes_back_only_to_a_local_path() {
        assert_eq!(local(Some("/promotions/x?y=1")), "/promotions/x?y=1");
        for elsewhere in [
            "//evil.example/",
            "/\\evil.example",
            "https://evil.example",
            "javascript:alert(1)",
        ] {
            assert_eq!(local(Some(elsewhere)), "/", "{elsewhere}");
        }
        assert_eq!(local(None), "/");
        // It becomes a header: a line break or a space could never be sent.
        for broken in ["/a\r\nSet-Cookie: x=1", "/a b", "/\u{e9}"] {
            assert_eq!(local(Some(broken)), "/", "{broken:?}");
        }
    }
}

//! The operator console: pages served by `ferry serve` on its HTTP port for the people of a
//! tenant (Operators, Reviewers, PlatformAdmins). Pages are rendered on the server from
//! typed, auto-escaping templates (`maud`): everything a tenant stored is shown as text.
//! Every action goes through the same use case, and so the same authorisation, as the API;
//! a page only leaves out the buttons its viewer may not use.
//!
//! * [`session`]: signing in with a bearer token (an HttpOnly, SameSite=Strict cookie that
//!   ends with the token), signing out, and the CSRF token every form carries;
//! * [`board`]: `/`, environments along the promotion path × projects, live;
//! * [`promotion`]: `/promotions/{id}`, gates, the approval with its plan, verification,
//!   the rollback, and the Approve / Reject form for someone allowed to decide;
//! * [`events`]: `/events`, the tenant's audit trail, live;
//! * [`runs`]: `/runs/{id}`, a provisioning run's receipts, approval and log;
//! * [`drift`]: `/drift`, the reconciler's proposals and the ignore rules in force;
//! * [`approvals`]: `/approvals`, what waits for the viewer's decision.
//!
//! Every page is sent with a Content-Security-Policy that allows no inline script and no
//! asset from elsewhere: the console's one script and one stylesheet are compiled into the
//! binary ([`assets`]), so it works offline.

mod approvals;
mod assets;
mod board;
mod drift;
mod events;
mod layout;
mod promotion;
mod runs;
pub mod session;

use axum::http::{header, HeaderValue};
use axum::routing::{get, post};
use axum::{Extension, Router};
use ferry_api::state::AppState;
use tower_http::set_header::SetResponseHeaderLayer;

/// The policy every console response carries: scripts, styles, images and connections only
/// from Ferry itself, no inline script, no framing, forms only back to Ferry.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; \
    frame-ancestors 'none'; base-uri 'none'";

/// The console's routes; `key` signs its CSRF tokens.
pub fn routes(key: session::ConsoleKey) -> Router<AppState> {
    Router::new()
        .route("/", get(board::page))
        .route("/console/board", get(board::fragment))
        .route("/promotions/{id}", get(promotion::page))
        .route("/promotions/{id}/decide", post(promotion::decide))
        .route("/promotions/{id}/plan-log", get(promotion::plan_log))
        .route("/runs/{id}", get(runs::page))
        .route("/runs/{id}/decide", post(runs::decide))
        .route("/drift", get(drift::page))
        .route("/approvals", get(approvals::page))
        .route("/events", get(events::page))
        .route("/console/stream", get(events::stream))
        .route("/console/changes", get(events::changes))
        .route("/login", get(session::login_page).post(session::login))
        .route("/login/link/{code}", get(session::follow_link))
        .route("/demo/health/{environment}", get(crate::demo::health))
        .route("/logout", post(session::logout))
        .route("/console/assets/console.css", get(assets::css))
        .route("/console/assets/console.js", get(assets::js))
        .layer(Extension(key))
        .layer(SetResponseHeaderLayer::overriding(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ))
        .layer(SetResponseHeaderLayer::overriding(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ))
        .layer(SetResponseHeaderLayer::overriding(
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ))
}

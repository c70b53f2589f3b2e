//! The console's one stylesheet and one script, compiled into the binary: the console loads
//! nothing from elsewhere and works offline.

use axum::http::header;
use axum::response::IntoResponse;

/// `GET /console/assets/console.css`.
pub async fn css() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("assets/console.css"),
    )
}

/// `GET /console/assets/console.js`.
pub async fn js() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("assets/console.js"),
    )
}

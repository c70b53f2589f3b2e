//! Ferry's IaC runner adapters: implementations of the domain's
//! [`Runner`](ferry_domain::ports::runner::Runner) port.
//!
//! * [`preview`]: the `pulumi preview --json` document and [`parse_preview`], the one
//!   parser every runner's plan goes through.
//! * [`simulated`]: [`SimulatedRunner`], a Pulumi YAML evaluator against a local simulated
//!   cloud (`<data_dir>/simulated-cloud/<tenant>/<environmentId>/state.json`), emitting the same
//!   preview JSON the CLI does.
//! * [`pulumi`]: [`PulumiRunner`], the real `pulumi` CLI as a child process.
//! * [`http`]: [`HttpRunner`], a client for a remote runner speaking the protocol in
//!   `schemas/runner-protocol.openapi.json`.
//! * [`checkout`]: reading the program's own files through its checkout folder only.
#![forbid(unsafe_code)]

pub mod checkout;
pub mod http;
pub mod preview;
pub mod pulumi;
pub mod simulated;

pub use http::HttpRunner;
pub use preview::{parse_preview, PreviewDocument};
pub use pulumi::PulumiRunner;
pub use simulated::SimulatedRunner;

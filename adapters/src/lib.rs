//! Adapters of the domain's ports (`ferry_domain::ports::sources`): where a plan's inputs
//! come from and where its artifacts go.
//!
//! * [`git`]: [`GitProgramSource`], the program source (`gix`: local path, `file://`,
//!   remote URLs cloned into a cache).
//! * [`checkout`]: writing a Git tree into a checkout folder it can never leave (`cap-std`).
//! * [`secrets`]: [`SecretResolvers`], `env://`, `file://` and Vault KV v2 references.
//! * [`config`]: [`ConfigSources`], file and HTTP configuration with the *degrade* failure
//!   mode (last known good values).
//! * [`policy`]: [`RegoPolicy`], OPA Rego via `regorus`, a built-in policy set plus a folder.
//! * [`artifacts`]: [`ObjectArtifacts`], logs and state snapshots through `object_store`.
//!
//! Git, secrets and configuration resolve for a tenant: each re-checks the reference with
//! the live rules of `ferry_domain::confinement`, with real paths (links resolved), and
//! fails naming the reference. Every adapter returns the port's typed errors and never logs
//! a secret value.
#![forbid(unsafe_code)]

pub mod artifacts;
pub mod checkout;
pub mod config;
mod confined;
pub mod git;
pub mod policy;
pub mod secrets;

pub use artifacts::{ArtifactConfigError, ObjectArtifacts};
pub use config::ConfigSources;
pub use git::GitProgramSource;
pub use policy::{PolicyLoadError, RegoPolicy};
pub use secrets::{SecretResolvers, VaultConfig};

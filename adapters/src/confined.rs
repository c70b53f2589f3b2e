//! Reading a tenant's files with the real path checked: the lexical rules of
//! [`ferry_domain::confinement`] again (the live configuration), then the path with every
//! symbolic link resolved against the tenant's roots (themselves resolved) and Ferry's own
//! files, so that a link inside a root cannot point outside it.
//!
//! On Linux the file actually opened is checked once more through `/proc/self/fd`, so a
//! link swapped in between the check and the open is caught too.

use ferry_domain::confinement::{Confinement, Refusal, RootKind};
use ferry_domain::TenantId;
use std::path::{Path, PathBuf};

/// Why a confined file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// A rule refused it.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// It could not be read (missing, not a file, no permission).
    #[error("cannot read {path}: {reason}")]
    Io {
        /// The path as named.
        path: String,
        /// Why (never the content).
        reason: String,
    },
}

/// The path with every link resolved, or `None` when it does not exist.
pub(crate) fn canonical(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path).ok()
}

/// Resolves `path` and checks the real path against Ferry's files and, with `kind`, the
/// tenant's roots. Returns the real path.
pub(crate) fn check_real(
    confinement: &Confinement,
    tenant: &TenantId,
    path: &Path,
    kind: Option<RootKind>,
) -> Result<PathBuf, ReadError> {
    let real = std::fs::canonicalize(path).map_err(|e| ReadError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    confinement.check_real_path(tenant, &real, kind, canonical)?;
    Ok(real)
}

/// Reads a tenant's file (a `file://` secret or configuration) under its file roots.
pub(crate) fn read_file(
    confinement: &Confinement,
    tenant: &TenantId,
    path: &str,
) -> Result<String, ReadError> {
    use std::io::Read;
    let io = |e: std::io::Error| ReadError::Io {
        path: path.to_string(),
        reason: e.to_string(),
    };
    let real = check_real(confinement, tenant, Path::new(path), Some(RootKind::Files))?;
    // A FIFO or a device would block or never end; only regular files are read.
    if !std::fs::metadata(&real).map_err(io)?.is_file() {
        return Err(ReadError::Io {
            path: path.to_string(),
            reason: "not a regular file".to_string(),
        });
    }
    let mut file = std::fs::File::open(&real).map_err(io)?;
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()));
        if let Ok(opened) = opened {
            confinement.check_real_path(tenant, &opened, Some(RootKind::Files), canonical)?;
        }
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(io)?;
    Ok(text)
}

#[cfg(test)]
pub(crate) mod testing {
    //! Rules for the adapters' tests: Ferry's data dir at a path no test creates, and the
    //! given roots and prefixes for every tenant (templates may use `{tenant}`).

    use ferry_domain::confinement::{Confinement, ConfinementSettings, FerryFiles};
    use std::sync::Arc;

    /// Where the tests pretend Ferry's data dir is.
    pub(crate) const DATA_DIR: &str = "/nonexistent/ferry-adapter-tests";

    /// Rules with these file roots, program roots and URL prefixes (programs and config).
    pub(crate) fn rules(
        file_roots: &[String],
        program_roots: &[String],
        url_prefixes: &[String],
    ) -> Arc<Confinement> {
        Arc::new(
            Confinement::new(ConfinementSettings {
                ferry: FerryFiles {
                    data_dir: DATA_DIR.into(),
                    ..FerryFiles::default()
                },
                file_roots: file_roots.to_vec(),
                program_roots: program_roots.to_vec(),
                env_prefix: "TENANT_{tenant}".to_string(),
                vault_prefix: "{tenant}/".to_string(),
                program_url_prefixes: url_prefixes.to_vec(),
                config_url_prefixes: url_prefixes.to_vec(),
                probe_url_prefixes: None,
                trusted_programs: vec![],
            })
            .unwrap_or_else(|e| panic!("{e}")),
        )
    }
}

//! What one run may make Ferry hold: the size of its program, the resources of its plan and
//! the size of what is stored from it (receipts in events, logs in artifacts). A tenant's
//! program is hostile input: a 200,000-resource program took the process to gigabytes and
//! stalled every other tenant, so each of these is checked before Ferry holds more of it,
//! and a run over a limit fails with a reason naming the limit and its setting.
//!
//! * the program: the checked-out folder is measured (files are not followed through
//!   links, and the walk stops as soon as the limit is passed) before any runner reads or
//!   parses it;
//! * the plan: its resources are counted, and the receipt's JSON measured, before it is
//!   recorded as an event;
//! * logs: kept up to the receipt limit, the rest cut with a line saying so (an apply that
//!   ran cannot be undone because its log is long).

use std::path::Path;

/// The limits (see the module doc); the settings that set them are named in the reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of the checked-out program folder (`FERRY_MAX_PROGRAM_BYTES`).
    pub program_bytes: u64,
    /// Resources one plan may list (`FERRY_MAX_PLAN_RESOURCES`).
    pub plan_resources: usize,
    /// Bytes of one receipt as stored, and of one stored log (`FERRY_MAX_RECEIPT_BYTES`).
    pub receipt_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            program_bytes: 8 * 1024 * 1024,
            plan_resources: 10_000,
            receipt_bytes: 4 * 1024 * 1024,
        }
    }
}

/// The setting of the program limit, as the reasons name it.
pub const PROGRAM_SETTING: &str = "FERRY_MAX_PROGRAM_BYTES";
/// The setting of the resource limit.
pub const RESOURCES_SETTING: &str = "FERRY_MAX_PLAN_RESOURCES";
/// The setting of the receipt and log limit.
pub const RECEIPT_SETTING: &str = "FERRY_MAX_RECEIPT_BYTES";

/// Why a run cannot go on: a limit passed (the text names its setting), or the program
/// could not be measured. The text is the run's failure reason.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// The measuring task did not finish.
    #[error("cannot measure the program: {0}")]
    Measure(tokio::task::JoinError),
    /// The program folder could not be read.
    #[error("cannot read the program folder: {0}")]
    Read(std::io::Error),
    /// The program is over [`Limits::program_bytes`].
    #[error(
        "the program is more than {max} bytes, more than a program may be ({PROGRAM_SETTING})"
    )]
    Program {
        /// The limit.
        max: u64,
    },
    /// The plan is over [`Limits::plan_resources`].
    #[error(
        "the plan lists {resources} resources, more than the {max} one plan may list ({RESOURCES_SETTING})"
    )]
    Resources {
        /// The plan's resources.
        resources: usize,
        /// The limit.
        max: usize,
    },
    /// A receipt is over [`Limits::receipt_bytes`].
    #[error(
        "the {what} would be {bytes} bytes, more than the {max} bytes one may be ({RECEIPT_SETTING})"
    )]
    Receipt {
        /// Which receipt.
        what: String,
        /// Its size as stored.
        bytes: usize,
        /// The limit.
        max: usize,
    },
}

impl Limits {
    /// Measures the program folder `dir`; `Err` is the reason the run cannot go on.
    pub async fn check_program(&self, dir: &Path) -> Result<(), LimitError> {
        let dir = dir.to_path_buf();
        let max = self.program_bytes;
        tokio::task::spawn_blocking(move || measure(&dir, max))
            .await
            .map_err(LimitError::Measure)?
    }

    /// `Err` when a plan listing `resources` resources is over the limit.
    pub fn check_resources(&self, resources: usize) -> Result<(), LimitError> {
        if resources > self.plan_resources {
            return Err(LimitError::Resources {
                resources,
                max: self.plan_resources,
            });
        }
        Ok(())
    }

    /// `Err` when a receipt (`what`) of `bytes` bytes as stored is over the limit.
    pub fn check_receipt(&self, what: &str, bytes: usize) -> Result<(), LimitError> {
        if bytes > self.receipt_bytes {
            return Err(LimitError::Receipt {
                what: what.to_string(),
                bytes,
                max: self.receipt_bytes,
            });
        }
        Ok(())
    }

    /// The log cut to the limit, at a character boundary, with a last line saying so.
    pub fn cut_log(&self, mut log: String) -> String {
        if log.len() <= self.receipt_bytes {
            return log;
        }
        let total = log.len();
        let mut end = self.receipt_bytes;
        while !log.is_char_boundary(end) {
            end -= 1;
        }
        log.truncate(end);
        log.push_str(&format!(
            "\n[log cut: {total} bytes, the first {end} kept ({RECEIPT_SETTING})]\n"
        ));
        log
    }
}

/// Adds up the sizes of what is under `dir` without following links (a link counts as its
/// own size), stopping as soon as the total passes `max`.
fn measure(dir: &Path, max: u64) -> Result<(), LimitError> {
    let mut total: u64 = 0;
    let mut folders = vec![dir.to_path_buf()];
    while let Some(folder) = folders.pop() {
        let entries = std::fs::read_dir(&folder).map_err(LimitError::Read)?;
        for entry in entries {
            let entry = entry.map_err(LimitError::Read)?;
            let meta = std::fs::symlink_metadata(entry.path()).map_err(LimitError::Read)?;
            // Each entry weighs at least one byte, so a tree of countless empty files is
            // bounded too; a folder weighs only that (its size is the file system's).
            let size = if meta.is_dir() { 1 } else { meta.len().max(1) };
            total = total.saturating_add(size);
            if total > max {
                return Err(LimitError::Program { max });
            }
            if meta.is_dir() {
                folders.push(entry.path());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_program_over_the_limit_is_refused_naming_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/Pulumi.yaml"), vec![b'a'; 100]).unwrap();
        let mut limits = Limits {
            program_bytes: 200,
            ..Limits::default()
        };
        limits.check_program(dir.path()).await.unwrap();
        limits.program_bytes = 99;
        let reason = limits
            .check_program(dir.path())
            .await
            .unwrap_err()
            .to_string();
        assert!(reason.contains(PROGRAM_SETTING), "{reason}");
    }

    #[test]
    fn a_log_is_cut_at_a_character_boundary_and_says_so() {
        let limits = Limits {
            receipt_bytes: 5,
            ..Limits::default()
        };
        assert_eq!(limits.cut_log("abc".into()), "abc");
        let cut = limits.cut_log("abcdéfgh".into());
        assert!(cut.starts_with("abcd\n"), "{cut}");
        assert!(cut.contains(RECEIPT_SETTING), "{cut}");
    }
}

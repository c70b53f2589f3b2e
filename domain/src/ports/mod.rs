//! Ports: what the domain's workflows need from the outside world, as traits. Adapters
//! (in `adapters/`) implement them; the domain stays free of IO.
//!
//! * [`identity`]: the runner identity a tenant's program runs with (never Ferry's).
//! * [`runner`]: the IaC runner (plan and apply) and the plan it reports.
//! * [`sources`]: program source (Git), secrets, configuration, policy, artifacts.

pub mod identity;
pub mod runner;
pub mod sources;

use std::fmt;

/// A secret value. Its `Debug` and `Display` never show it; only [`SecretValue::expose`]
/// does, at the point where it is handed to a runner.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretValue(String);

impl SecretValue {
    /// Wraps a resolved secret.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }
    /// The value itself. Call only to hand it to the runner or to redact it from output.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretValue(***)")
    }
}

impl fmt::Display for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// Replaces every occurrence of each secret in `text` with `***` (runner output is redacted
/// before it is stored).
pub fn redact<'a>(text: &str, secrets: impl IntoIterator<Item = &'a SecretValue>) -> String {
    let mut out = text.to_string();
    for s in secrets {
        if !s.expose().is_empty() {
            out = out.replace(s.expose(), "***");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_do_not_print() {
        let s = SecretValue::new("hunter2");
        assert_eq!(format!("{s} {s:?}"), "*** SecretValue(***)");
        assert_eq!(redact("password=hunter2;", [&s]), "password=***;");
    }
}

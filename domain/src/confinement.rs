//! Confinement of the references a tenant gives (secrets, configuration, programs): each
//! tenant reaches only what the operator configured for it, and nobody reaches Ferry's own
//! files and variables.
//!
//! The operator configures templates in which `{tenant}` stands for the tenant, so that one
//! configuration serves every tenant ([`Setting`] lists them):
//!
//! * file roots for `file://` secrets and configuration, and roots for local program
//!   repositories (folders; `{tenant}` is the tenant's [path component]);
//! * an environment-variable prefix for `env://` (`{tenant}` is [`env_component`], an
//!   encoding that keeps every tenant's prefix apart from every other's);
//! * a Vault path prefix for `vault://mount/path#key`;
//! * URL prefixes for remote programs and for `http(s)://` configuration (none by default).
//!
//! Whatever the configuration, Ferry's own files (the data dir's keys, database and working
//! folders, the configuration file, the policy folder: [`FerryFiles`]) and the variables
//! Ferry and the cloud SDKs read ([`is_reserved_variable`]) are never resolvable; a root
//! that could hold Ferry's files is refused when the rules are built.
//!
//! The checks here are lexical: paths are normalised (`..` is refused, never resolved) and
//! compared at component boundaries (`/srv/a` does not contain `/srv/ab`), URLs are compared
//! by scheme, authority and path segments. The API refuses a declaration with them; the
//! adapters check again when they resolve a reference, with the real paths (symbolic links
//! resolved) through [`Confinement::check_real_path`].
//!
//! Operator-configured baseline programs are trusted as they are: exactly those
//! (`programRef`, `programVersion`) pairs pass the root and URL rules.
//!
//! What verification reaches for a tenant is confined too: probe URLs (health URLs, smoke
//! checks) reach only public addresses unless a probe URL prefix names the address
//! ([`network`]; the HTTP client checks resolved names the same way), and an SLO query
//! reads only the tenant's own series ([`promql`]).
//!
//! [path component]: crate::TenantId::path_component

use crate::environment::BaselineProgram;
use crate::ids::TenantId;
use crate::values::{ConfigRef, ProbeUrl, ProgramRef, ProgramVersion, RefMap, SecretRef};
use std::fmt;
use std::net::IpAddr;
use std::path::{Component, Path, PathBuf};

pub mod network;
pub mod promql;

pub use network::is_public;

/// The label an SLO query's selectors are confined by, unless the operator names another.
pub const DEFAULT_METRIC_TENANT_LABEL: &str = "tenant";

/// The placeholder templates use for the tenant.
pub const TENANT_PLACEHOLDER: &str = "{tenant}";

/// The operator's settings the rules come from, named as in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Setting {
    /// Folders `file://` secrets and configuration may name.
    FileRoots,
    /// Folders local program repositories may be in.
    ProgramRoots,
    /// The prefix `env://` variables must start with.
    EnvPrefix,
    /// The prefix `vault://` paths must start with.
    VaultPrefix,
    /// URL prefixes remote program repositories must start with.
    ProgramUrlPrefixes,
    /// URL prefixes `http(s)://` configuration must start with.
    ConfigUrlPrefixes,
    /// URL prefixes the URLs verification probes (health URLs, smoke checks) must start
    /// with; not confined when unset.
    ProbeUrlPrefixes,
}

impl Setting {
    /// Every setting.
    pub const ALL: [Self; 7] = [
        Self::FileRoots,
        Self::ProgramRoots,
        Self::EnvPrefix,
        Self::VaultPrefix,
        Self::ProgramUrlPrefixes,
        Self::ConfigUrlPrefixes,
        Self::ProbeUrlPrefixes,
    ];

    /// The environment variable that sets it.
    pub fn env_name(self) -> &'static str {
        match self {
            Self::FileRoots => "FERRY_TENANT_FILE_ROOTS",
            Self::ProgramRoots => "FERRY_TENANT_PROGRAM_ROOTS",
            Self::EnvPrefix => "FERRY_TENANT_ENV_PREFIX",
            Self::VaultPrefix => "FERRY_TENANT_VAULT_PREFIX",
            Self::ProgramUrlPrefixes => "FERRY_TENANT_PROGRAM_URL_PREFIXES",
            Self::ConfigUrlPrefixes => "FERRY_TENANT_CONFIG_URL_PREFIXES",
            Self::ProbeUrlPrefixes => "FERRY_TENANT_PROBE_URL_PREFIXES",
        }
    }

    /// Its key in the configuration file.
    pub fn file_key(self) -> &'static str {
        match self {
            Self::FileRoots => "tenant_file_roots",
            Self::ProgramRoots => "tenant_program_roots",
            Self::EnvPrefix => "tenant_env_prefix",
            Self::VaultPrefix => "tenant_vault_prefix",
            Self::ProgramUrlPrefixes => "tenant_program_url_prefixes",
            Self::ConfigUrlPrefixes => "tenant_config_url_prefixes",
            Self::ProbeUrlPrefixes => "tenant_probe_url_prefixes",
        }
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.env_name())
    }
}

/// Which roots a real path is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootKind {
    /// `file://` secrets and configuration ([`Setting::FileRoots`]).
    Files,
    /// Local program repositories ([`Setting::ProgramRoots`]).
    Programs,
}

impl RootKind {
    fn setting(self) -> Setting {
        match self {
            Self::Files => Setting::FileRoots,
            Self::Programs => Setting::ProgramRoots,
        }
    }
}

/// Why a reference was refused. The message names the rule and, where one applies, the
/// setting that would allow it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// One of Ferry's own files or folders.
    #[error("{path} is Ferry's {what}, which is never resolvable")]
    FerryFile {
        /// The path, as named or as resolved.
        path: String,
        /// What it is (e.g. "token signing key").
        what: &'static str,
    },
    /// A variable Ferry or the cloud SDKs read.
    #[error("{name} is a variable Ferry or its cloud SDKs read, which is never resolvable")]
    ReservedVariable {
        /// The variable.
        name: String,
    },
    /// A variable outside the tenant's prefix.
    #[error(
        "variable {name} does not start with this tenant's prefix {prefix} (set by {setting})"
    )]
    OutsideEnvPrefix {
        /// The variable.
        name: String,
        /// The tenant's prefix.
        prefix: String,
        /// The setting.
        setting: Setting,
    },
    /// A path outside the tenant's roots.
    #[error("{path} is outside this tenant's roots ({setting}: {})", listing(.roots))]
    OutsideRoots {
        /// The path, as named or as resolved.
        path: String,
        /// The setting.
        setting: Setting,
        /// The tenant's roots.
        roots: Vec<String>,
    },
    /// A Vault path outside the tenant's prefix.
    #[error(
        "Vault path {path} does not start with this tenant's prefix {prefix:?} (set by {setting})"
    )]
    OutsideVaultPrefix {
        /// The path (mount and path).
        path: String,
        /// The tenant's prefix.
        prefix: String,
        /// The setting.
        setting: Setting,
    },
    /// A URL under no allowed prefix.
    #[error("{url} is not under a URL prefix allowed for this tenant ({setting}: {}){}",
        listing(.prefixes),
        if .prefixes.is_empty() { "; set it to allow remote sources" } else { "" })]
    UrlNotAllowed {
        /// The URL.
        url: String,
        /// The setting.
        setting: Setting,
        /// The tenant's prefixes.
        prefixes: Vec<String>,
    },
    /// A probe URL whose host is a non-public address no probe URL prefix names.
    #[error(
        "{url} names {address}, a loopback, private, link-local or other non-public \
        address; probes reach such an address only when a probe URL prefix ({setting}) names it"
    )]
    NonPublicAddress {
        /// The URL.
        url: String,
        /// The address (or name) it reaches.
        address: String,
        /// The setting that could allow it.
        setting: Setting,
    },
    /// An SLO query that cannot be confined to the tenant's series.
    #[error(transparent)]
    Query(#[from] promql::Unconfinable),
    /// A reference that cannot be checked as written (relative path, `..`, …).
    #[error("{0}")]
    Malformed(String),
}

fn listing(items: &[String]) -> String {
    if items.is_empty() {
        "none configured".to_string()
    } else {
        items.join(", ")
    }
}

/// A refused reference of a declaration, with the field it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {refusal}")]
pub struct FieldRefusal {
    /// JSON path of the field: `programRef`, `configRefs.<key>`, `secretRefs.<key>`.
    pub field: String,
    /// Why.
    #[source]
    pub refusal: Refusal,
}

/// Why the rules could not be built from the settings (the process must not start).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfinementError {
    /// A setting that cannot be used.
    #[error("{setting}: {reason}")]
    Setting {
        /// The setting.
        setting: Setting,
        /// Why.
        reason: String,
    },
    /// One of Ferry's own paths is not absolute.
    #[error("Ferry's own path {path} must be absolute")]
    RelativeFerryPath {
        /// The path.
        path: PathBuf,
    },
}

/// Ferry's own paths, never resolvable whatever the roots (absolute paths).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FerryFiles {
    /// The data dir: keys, embedded database, Git cache, work folders, simulated cloud,
    /// last known good configuration, artifacts.
    pub data_dir: PathBuf,
    /// The configuration file, if one was read.
    pub config_file: Option<PathBuf>,
    /// The policy folder, if one is configured.
    pub policy_dir: Option<PathBuf>,
    /// A local artifact folder outside the data dir, if one is configured.
    pub artifacts_dir: Option<PathBuf>,
    /// Ferry's other secret files and what each is (e.g. its NATS credentials: a tenant
    /// that read them could publish as Ferry).
    pub secret_files: Vec<(PathBuf, &'static str)>,
}

/// What the rules are built from: templates as the operator wrote them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfinementSettings {
    /// Ferry's own paths.
    pub ferry: FerryFiles,
    /// [`Setting::FileRoots`]: absolute folder templates.
    pub file_roots: Vec<String>,
    /// [`Setting::ProgramRoots`]: absolute folder templates.
    pub program_roots: Vec<String>,
    /// [`Setting::EnvPrefix`]: letters, digits, `_` and `{tenant}`.
    pub env_prefix: String,
    /// [`Setting::VaultPrefix`]: `mount/path/` segments and `{tenant}`; empty = any path.
    pub vault_prefix: String,
    /// [`Setting::ProgramUrlPrefixes`]: `https://`, `http://`, `ssh://` or `git://` templates.
    pub program_url_prefixes: Vec<String>,
    /// [`Setting::ConfigUrlPrefixes`]: `https://` or `http://` templates.
    pub config_url_prefixes: Vec<String>,
    /// [`Setting::ProbeUrlPrefixes`]: `https://` or `http://` templates; `None` = probe URLs
    /// are not confined.
    pub probe_url_prefixes: Option<Vec<String>>,
    /// Operator-configured baseline programs, trusted as they are.
    pub trusted_programs: Vec<(ProgramRef, ProgramVersion)>,
}

/// Why a template does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// A brace that is not part of `{tenant}`.
    #[error("{template:?}: the only placeholder is {{tenant}}")]
    Placeholder {
        /// The template.
        template: String,
    },
    /// A control character.
    #[error("{template:?} must not contain control characters")]
    Control {
        /// The template.
        template: String,
    },
}

/// A validated template: text in which `{tenant}` stands for the tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template(String);

impl Template {
    /// Checks that braces only appear as `{tenant}`.
    pub fn parse(raw: &str) -> Result<Self, TemplateError> {
        let template = raw.to_string();
        if raw.replace(TENANT_PLACEHOLDER, "").contains(['{', '}']) {
            return Err(TemplateError::Placeholder { template });
        }
        if raw.chars().any(char::is_control) {
            return Err(TemplateError::Control { template });
        }
        Ok(Self(template))
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether it names the tenant (a template without is shared by every tenant).
    pub fn has_tenant(&self) -> bool {
        self.0.contains(TENANT_PLACEHOLDER)
    }

    fn render(&self, value: &str) -> String {
        self.0.replace(TENANT_PLACEHOLDER, value)
    }
}

/// What a protected path protects.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Protected {
    /// This file or folder and everything in it.
    Path { path: PathBuf, what: &'static str },
    /// Every entry of `dir` whose name starts with `prefix` (the database and its journals).
    Named {
        dir: PathBuf,
        prefix: &'static str,
        what: &'static str,
    },
}

impl Protected {
    fn what(&self) -> &'static str {
        match self {
            Self::Path { what, .. } | Self::Named { what, .. } => what,
        }
    }

    /// Whether `path` (normalised) is this or inside it.
    fn covers(&self, path: &Path) -> bool {
        match self {
            Self::Path { path: p, .. } => path.starts_with(p),
            Self::Named { dir, prefix, .. } => path
                .strip_prefix(dir)
                .ok()
                .and_then(|rest| rest.components().next())
                .is_some_and(|c| c.as_os_str().to_string_lossy().starts_with(prefix)),
        }
    }

    /// The path a root must neither contain nor lie in.
    fn anchor(&self) -> PathBuf {
        match self {
            Self::Path { path, .. } => path.clone(),
            Self::Named { dir, prefix, .. } => dir.join(prefix),
        }
    }

    /// The same with its paths mapped (to their canonical form).
    fn mapped(&self, map: &impl Fn(&Path) -> Option<PathBuf>) -> Option<Self> {
        match self {
            Self::Path { path, what } => map(path).map(|path| Self::Path { path, what }),
            Self::Named { dir, prefix, what } => {
                map(dir).map(|dir| Self::Named { dir, prefix, what })
            }
        }
    }
}

/// Variables never resolvable: Ferry's own settings and those of the SDKs and tools whose
/// credentials the process may hold. Compared case-insensitively.
const RESERVED_PREFIXES: &[&str] = &[
    "FERRY_",
    "DATABASE_",
    "NATS_",
    "PULUMI_",
    "AWS_",
    "AZURE_",
    "ARM_",
    "GOOGLE_",
    "GCP_",
    "GCLOUD_",
    "CLOUDSDK_",
    "VAULT_",
    "PG",
    "GIT_",
    "SSH_",
    "KUBE",
    "DOCKER_",
];

/// Whether `name` is a variable Ferry or the SDKs it embeds read (`FERRY_*`,
/// `DATABASE_URL`, `NATS_*`, `PULUMI_*`, `AWS_*`, `AZURE_*`, `GOOGLE_*`, `VAULT_*`, `PG*`,
/// …): never resolvable, whatever the configuration.
pub fn is_reserved_variable(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    RESERVED_PREFIXES.iter().any(|p| upper.starts_with(p))
}

/// Whether `name` is one of Ferry's own settings (`FERRY_*`, `DATABASE_URL`, `NATS_*`):
/// kept out of the environment of the processes that run a tenant's program.
pub fn is_ferry_variable(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    upper.starts_with("FERRY_") || upper.starts_with("NATS_") || upper == "DATABASE_URL"
}

/// The tenant as it appears in environment-variable names: letters and digits as they are
/// (case-sensitive), `_` `.` `-` `:` as `_5F` `_2E` `_2D` `_3A`, then `__`.
///
/// Injective and prefix-free: `_` inside is always followed by two hex digits, so the first
/// `__` ends the tenant; one tenant's prefix is never the start of another's (tenant `acme`
/// gets `acme__`, `acme_x` gets `acme_5Fx__`, `acme-x` gets `acme_2Dx__`), whatever name
/// follows it.
pub fn env_component(tenant: &TenantId) -> String {
    let mut out = String::with_capacity(tenant.as_str().len() + 2);
    for c in tenant.as_str().chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else {
            out.push_str(&format!("_{:02X}", u32::from(c)));
        }
    }
    out.push_str("__");
    out
}

/// Why a path cannot be normalised ([`normalise`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum NotNormal {
    /// Relative paths depend on the working folder.
    #[error("{} must be an absolute path", .0.display())]
    Relative(PathBuf),
    /// `..` is refused, never resolved.
    #[error("{}: '..' segments are refused", .0.display())]
    Climbs(PathBuf),
}

/// Normalises an absolute path lexically: `.` and repeated separators go, `..` is refused
/// (never resolved: a link may lie under it).
fn normalise(raw: &Path) -> Result<PathBuf, NotNormal> {
    if !raw.is_absolute() {
        return Err(NotNormal::Relative(raw.to_path_buf()));
    }
    let mut out = PathBuf::new();
    for component in raw.components() {
        match component {
            Component::ParentDir => return Err(NotNormal::Climbs(raw.to_path_buf())),
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    Ok(out)
}

/// `scheme://authority/path?query#fragment` → (scheme, authority, path), the first two
/// lower-cased (they are case-insensitive).
fn split_url(url: &str) -> Option<(String, String, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, rest) = rest.split_at(end);
    let path_end = rest.find(['?', '#']).unwrap_or(rest.len());
    Some((
        scheme.to_ascii_lowercase(),
        authority.to_ascii_lowercase(),
        &rest[..path_end],
    ))
}

/// The host of an `http(s)` URL, parsed as the HTTP client parses it.
fn probe_host(raw: &str) -> Result<url::Host<String>, Refusal> {
    let parsed =
        url::Url::parse(raw).map_err(|e| Refusal::Malformed(format!("{raw} is not a URL: {e}")))?;
    parsed
        .host()
        .map(|h| h.to_owned())
        .ok_or_else(|| Refusal::Malformed(format!("{raw} names no host")))
}

/// Path segments that would let a client climb (`.`, `..`, their percent-encodings,
/// backslashes).
fn climbs(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    lower.contains("%2e")
        || lower.contains("%2f")
        || lower.contains("%5c")
        || path.contains('\\')
        || path.split('/').any(|s| s == "." || s == "..")
}

/// Whether `path` is `prefix` or below it, at a segment boundary.
fn url_path_under(path: &str, prefix: &str) -> bool {
    if prefix.is_empty() || prefix == "/" {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => prefix.ends_with('/') || rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// Whether a template's path component (possibly with `{tenant}`) can be `value`.
fn component_matches(template: &str, value: &str) -> bool {
    let pieces: Vec<&str> = template.split(TENANT_PLACEHOLDER).collect();
    if pieces.len() == 1 {
        return template == value;
    }
    let (first, last) = (pieces[0], pieces[pieces.len() - 1]);
    let Some(mut rest) = value.strip_prefix(first) else {
        return false;
    };
    for piece in &pieces[1..pieces.len() - 1] {
        // Each placeholder stands for at least one character.
        match rest.get(1..).and_then(|r| r.find(piece)) {
            Some(i) => rest = &rest[1 + i + piece.len()..],
            None => return false,
        }
    }
    rest.len() > last.len() && rest.ends_with(last)
}

/// Whether the folder template `root` could, for some tenant, contain `path` or lie in it.
fn could_overlap(root: &Path, path: &Path) -> bool {
    let t: Vec<String> = root
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let p: Vec<String> = path
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    t.iter().zip(&p).all(|(t, p)| component_matches(t, p))
}

/// The rules for every tenant. Built once from the configuration; cheap to share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    file_roots: Vec<Template>,
    program_roots: Vec<Template>,
    env_prefix: Template,
    vault_prefix: Template,
    program_url_prefixes: Vec<Template>,
    config_url_prefixes: Vec<Template>,
    probe_url_prefixes: Option<Vec<Template>>,
    trusted_programs: Vec<(ProgramRef, ProgramVersion)>,
    protected: Vec<Protected>,
    metric_tenant_label: String,
}

impl Confinement {
    /// Validates the settings: templates that parse, absolute roots without `..` that can
    /// neither hold nor lie in Ferry's own files, an environment prefix of variable
    /// characters that does not start like a reserved variable, URL prefixes of the
    /// accepted schemes.
    pub fn new(settings: ConfinementSettings) -> Result<Self, ConfinementError> {
        let protected = protected_paths(&settings.ferry)?;
        let file_roots = roots(Setting::FileRoots, &settings.file_roots, &protected)?;
        let program_roots = roots(Setting::ProgramRoots, &settings.program_roots, &protected)?;
        let env_prefix = env_prefix(&settings.env_prefix)?;
        let vault_prefix = vault_prefix(&settings.vault_prefix)?;
        let program_url_prefixes = url_prefixes(
            Setting::ProgramUrlPrefixes,
            &settings.program_url_prefixes,
            &["https", "http", "ssh", "git"],
        )?;
        let config_url_prefixes = url_prefixes(
            Setting::ConfigUrlPrefixes,
            &settings.config_url_prefixes,
            &["https", "http"],
        )?;
        let probe_url_prefixes = settings
            .probe_url_prefixes
            .as_deref()
            .map(|raw| url_prefixes(Setting::ProbeUrlPrefixes, raw, &["https", "http"]))
            .transpose()?;
        Ok(Self {
            file_roots,
            program_roots,
            env_prefix,
            vault_prefix,
            program_url_prefixes,
            config_url_prefixes,
            probe_url_prefixes,
            trusted_programs: settings.trusted_programs,
            protected,
            metric_tenant_label: DEFAULT_METRIC_TENANT_LABEL.to_string(),
        })
    }

    /// The same rules, with SLO queries confined by `label` (a Prometheus label name, not
    /// reserved: `None` when it is not one).
    pub fn with_metric_tenant_label(mut self, label: &str) -> Option<Self> {
        if !promql::is_label_name(label) {
            return None;
        }
        self.metric_tenant_label = label.to_string();
        Some(self)
    }

    /// The label an SLO query's selectors are confined by.
    pub fn metric_tenant_label(&self) -> &str {
        &self.metric_tenant_label
    }

    /// An SLO query of the tenant as it may be sent: every selector confined to the
    /// tenant's series (`<label>="<tenant>"` added), or why it cannot be.
    pub fn confine_query(&self, tenant: &TenantId, query: &str) -> Result<String, Refusal> {
        Ok(promql::confine(
            query,
            &self.metric_tenant_label,
            tenant.as_str(),
        )?)
    }

    /// The tenant's folders of a kind (normalised, as configured: not canonicalised).
    pub fn roots(&self, tenant: &TenantId, kind: RootKind) -> Vec<PathBuf> {
        let templates = match kind {
            RootKind::Files => &self.file_roots,
            RootKind::Programs => &self.program_roots,
        };
        templates
            .iter()
            .filter_map(|t| normalise(Path::new(&t.render(&tenant.path_component()))).ok())
            .collect()
    }

    /// The tenant's `env://` prefix.
    pub fn env_prefix(&self, tenant: &TenantId) -> String {
        self.env_prefix.render(&env_component(tenant))
    }

    /// The tenant's Vault path prefix (`mount/path/`, empty = any).
    pub fn vault_prefix(&self, tenant: &TenantId) -> String {
        self.vault_prefix.render(&tenant.path_component())
    }

    fn url_prefixes(&self, tenant: &TenantId, setting: Setting) -> Vec<String> {
        let templates: &[Template] = match setting {
            Setting::ConfigUrlPrefixes => &self.config_url_prefixes,
            Setting::ProbeUrlPrefixes => self.probe_url_prefixes.as_deref().unwrap_or_default(),
            _ => &self.program_url_prefixes,
        };
        templates
            .iter()
            .map(|t| t.render(&tenant.path_component()))
            .collect()
    }

    /// Whether this exact program and commit is an operator-configured baseline.
    pub fn is_trusted_program(&self, program: &ProgramRef, version: &ProgramVersion) -> bool {
        self.trusted_programs
            .iter()
            .any(|(p, v)| p == program && v == version)
    }

    fn ferry_file(&self, path: &Path) -> Result<(), Refusal> {
        match self.protected.iter().find(|p| p.covers(path)) {
            Some(p) => Err(Refusal::FerryFile {
                path: path.display().to_string(),
                what: p.what(),
            }),
            None => Ok(()),
        }
    }

    /// Checks a path as written: absolute, no `..`, not Ferry's, under one of the roots.
    fn check_path(&self, tenant: &TenantId, raw: &str, kind: RootKind) -> Result<(), Refusal> {
        let path = normalise(Path::new(raw)).map_err(|e| Refusal::Malformed(e.to_string()))?;
        self.ferry_file(&path)?;
        let roots = self.roots(tenant, kind);
        if roots.iter().any(|r| path.starts_with(r)) {
            return Ok(());
        }
        Err(Refusal::OutsideRoots {
            path: path.display().to_string(),
            setting: kind.setting(),
            roots: roots.iter().map(|r| r.display().to_string()).collect(),
        })
    }

    /// Checks a real path (symbolic links resolved by the caller) against Ferry's own paths
    /// and, when `kind` is given, the tenant's roots. `canonical` resolves a configured path
    /// the same way (`None` when it does not exist); both the configured and the resolved
    /// forms of Ferry's paths are refused.
    pub fn check_real_path(
        &self,
        tenant: &TenantId,
        real: &Path,
        kind: Option<RootKind>,
        canonical: impl Fn(&Path) -> Option<PathBuf>,
    ) -> Result<(), Refusal> {
        let real = normalise(real).map_err(|e| Refusal::Malformed(e.to_string()))?;
        self.ferry_file(&real)?;
        if let Some(p) = self
            .protected
            .iter()
            .filter_map(|p| p.mapped(&canonical))
            .find(|p| p.covers(&real))
        {
            return Err(Refusal::FerryFile {
                path: real.display().to_string(),
                what: p.what(),
            });
        }
        let Some(kind) = kind else {
            return Ok(());
        };
        let roots = self.roots(tenant, kind);
        if roots
            .iter()
            .filter_map(|r| canonical(r))
            .any(|r| real.starts_with(r))
        {
            return Ok(());
        }
        Err(Refusal::OutsideRoots {
            path: real.display().to_string(),
            setting: kind.setting(),
            roots: roots.iter().map(|r| r.display().to_string()).collect(),
        })
    }

    fn check_url(&self, tenant: &TenantId, url: &str, setting: Setting) -> Result<(), Refusal> {
        let Some((scheme, authority, path)) = split_url(url) else {
            return Err(Refusal::Malformed(format!("{url} is not a URL")));
        };
        if authority.is_empty() {
            return Err(Refusal::Malformed(format!("{url} names no host")));
        }
        if climbs(path) {
            return Err(Refusal::Malformed(format!(
                "{url}: '.' and '..' segments, encoded or not, and backslashes are refused"
            )));
        }
        let prefixes = self.url_prefixes(tenant, setting);
        let allowed = prefixes.iter().any(|prefix| {
            split_url(prefix)
                .is_some_and(|(s, a, p)| s == scheme && a == authority && url_path_under(path, p))
        });
        if allowed {
            Ok(())
        } else {
            Err(Refusal::UrlNotAllowed {
                url: url.to_string(),
                setting,
                prefixes,
            })
        }
    }

    /// Checks a URL verification would probe for a tenant (a health URL, a smoke check):
    /// under the tenant's probe URL prefixes when the operator set them, and naming no
    /// non-public address unless one of those prefixes names it. The host is read as the
    /// HTTP client reads it, so `http://2130706433/`, `http://0x7f.1/` and
    /// `http://[::ffff:127.0.0.1]/` are all loopback; `localhost` is refused here too. Other
    /// names are checked when they are resolved, on the addresses connected to.
    pub fn check_probe(&self, tenant: &TenantId, url: &ProbeUrl) -> Result<(), Refusal> {
        if self.probe_url_prefixes.is_some() {
            self.check_url(tenant, url.as_str(), Setting::ProbeUrlPrefixes)?;
        }
        let refused = |address: String| Refusal::NonPublicAddress {
            url: url.to_string(),
            address,
            setting: Setting::ProbeUrlPrefixes,
        };
        let ip = match probe_host(url.as_str())? {
            url::Host::Ipv4(v4) => IpAddr::V4(v4),
            url::Host::Ipv6(v6) => IpAddr::V6(v6),
            url::Host::Domain(name) => {
                // Names that always mean this machine (RFC 6761): no need to resolve them.
                let name = name.trim_end_matches('.');
                if name == "localhost" || name.ends_with(".localhost") {
                    return Err(refused(name.to_string()));
                }
                return Ok(());
            }
        };
        if network::is_public(ip) || self.probe_addresses(tenant).contains(&ip) {
            Ok(())
        } else {
            Err(refused(ip.to_string()))
        }
    }

    /// The literal addresses the tenant's probe URL prefixes name: the operator allowed
    /// probes to reach them even when they are not public.
    fn probe_addresses(&self, tenant: &TenantId) -> Vec<IpAddr> {
        if self.probe_url_prefixes.is_none() {
            return Vec::new();
        }
        self.url_prefixes(tenant, Setting::ProbeUrlPrefixes)
            .iter()
            .filter_map(|prefix| match probe_host(prefix).ok()? {
                url::Host::Ipv4(v4) => Some(IpAddr::V4(v4)),
                url::Host::Ipv6(v6) => Some(IpAddr::V6(v6)),
                url::Host::Domain(_) => None,
            })
            .collect()
    }

    /// Checks a secret reference for a tenant.
    pub fn check_secret(&self, tenant: &TenantId, reference: &SecretRef) -> Result<(), Refusal> {
        let reference = reference.as_str();
        if let Some(name) = reference.strip_prefix("env://") {
            if is_reserved_variable(name) {
                return Err(Refusal::ReservedVariable {
                    name: name.to_string(),
                });
            }
            let prefix = self.env_prefix(tenant);
            if name.len() > prefix.len() && name.starts_with(&prefix) {
                return Ok(());
            }
            return Err(Refusal::OutsideEnvPrefix {
                name: name.to_string(),
                prefix,
                setting: Setting::EnvPrefix,
            });
        }
        if let Some(path) = reference.strip_prefix("file://") {
            return self.check_path(tenant, path, RootKind::Files);
        }
        if let Some(rest) = reference.strip_prefix("vault://") {
            let location = rest.split_once('#').map_or(rest, |(l, _)| l);
            let segments: Vec<&str> = location.split('/').collect();
            if segments
                .iter()
                .any(|s| s.is_empty() || *s == "." || *s == "..")
                || location.contains(['%', '\\', '?'])
            {
                return Err(Refusal::Malformed(format!(
                    "{reference}: Vault paths may not hold empty, '.' or '..' segments, '%', '?' or '\\'"
                )));
            }
            let prefix = self.vault_prefix(tenant);
            let wanted: Vec<&str> = prefix.split('/').filter(|s| !s.is_empty()).collect();
            if segments.len() > wanted.len() && segments.starts_with(&wanted) {
                return Ok(());
            }
            return Err(Refusal::OutsideVaultPrefix {
                path: location.to_string(),
                prefix,
                setting: Setting::VaultPrefix,
            });
        }
        Err(Refusal::Malformed(format!(
            "{reference}: unsupported scheme (env://, file://, vault://)"
        )))
    }

    /// Checks a configuration reference for a tenant.
    pub fn check_config(&self, tenant: &TenantId, reference: &ConfigRef) -> Result<(), Refusal> {
        let reference = reference.as_str();
        if let Some(path) = reference.strip_prefix("file://") {
            return self.check_path(tenant, path, RootKind::Files);
        }
        if reference.starts_with("http://") || reference.starts_with("https://") {
            return self.check_url(tenant, reference, Setting::ConfigUrlPrefixes);
        }
        Err(Refusal::Malformed(format!(
            "{reference}: unsupported scheme (file://, http://, https://)"
        )))
    }

    /// Checks a program reference at a commit for a tenant: an operator-configured baseline
    /// passes as it is (Ferry's own files excepted); otherwise a local repository must be
    /// in the tenant's program roots and a remote one under its URL prefixes.
    pub fn check_program(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
    ) -> Result<(), Refusal> {
        let (repository, folder) = program
            .as_str()
            .split_once('#')
            .unwrap_or((program.as_str(), ""));
        if folder.split('/').any(|s| s == "..") || folder.contains('\\') {
            return Err(Refusal::Malformed(format!(
                "folder {folder:?} must stay inside the repository ('..' is refused)"
            )));
        }
        let local = match repository.strip_prefix("file://") {
            Some(rest) => Some(rest.strip_prefix("localhost").unwrap_or(rest)),
            None if repository.contains("://") => None,
            None => Some(repository),
        };
        let trusted = self.is_trusted_program(program, version);
        match local {
            Some(path) if trusted => match normalise(Path::new(path)) {
                Ok(path) => self.ferry_file(&path),
                Err(_) => Ok(()),
            },
            Some(path) => self.check_path(tenant, path, RootKind::Programs),
            None if trusted => Ok(()),
            None => self.check_url(tenant, repository, Setting::ProgramUrlPrefixes),
        }
    }

    /// Checks a baseline program (of `PUT /factory/environments/{id}` or an inbound
    /// `EnvironmentCreated`) for a tenant; the field is `programRef`.
    pub fn check_baseline_program(
        &self,
        tenant: &TenantId,
        program: &BaselineProgram,
    ) -> Result<(), Refusal> {
        self.check_program(tenant, &program.program_ref, &program.program_version)
    }

    /// Checks every reference of a declaration; each refusal names its field
    /// (`programRef`, `configRefs.<key>`, `secretRefs.<key>`).
    pub fn check_specification(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
        config_refs: &RefMap<ConfigRef>,
        secret_refs: &RefMap<SecretRef>,
    ) -> Result<(), Vec<FieldRefusal>> {
        let mut refused = Vec::new();
        if let Err(refusal) = self.check_program(tenant, program, version) {
            refused.push(FieldRefusal {
                field: "programRef".to_string(),
                refusal,
            });
        }
        for (key, reference) in config_refs {
            if let Err(refusal) = self.check_config(tenant, reference) {
                refused.push(FieldRefusal {
                    field: format!("configRefs.{key}"),
                    refusal,
                });
            }
        }
        for (key, reference) in secret_refs {
            if let Err(refusal) = self.check_secret(tenant, reference) {
                refused.push(FieldRefusal {
                    field: format!("secretRefs.{key}"),
                    refusal,
                });
            }
        }
        if refused.is_empty() {
            Ok(())
        } else {
            Err(refused)
        }
    }
}

fn protected_paths(ferry: &FerryFiles) -> Result<Vec<Protected>, ConfinementError> {
    let absolute = |p: &Path| {
        normalise(p).map_err(|_| ConfinementError::RelativeFerryPath {
            path: p.to_path_buf(),
        })
    };
    let data = absolute(&ferry.data_dir)?;
    let mut protected = vec![
        Protected::Path {
            path: data.join("jwt-hs256.key"),
            what: "token signing key",
        },
        Protected::Path {
            path: data.join("secret-fingerprint.key"),
            what: "secret fingerprint key",
        },
        Protected::Named {
            dir: data.clone(),
            prefix: "ferry.db",
            what: "embedded database",
        },
    ];
    for (folder, what) in [
        ("artifacts", "artifact store"),
        ("git-cache", "Git cache"),
        ("work", "work folder"),
        ("simulated-cloud", "simulated cloud"),
        ("config-last-known-good", "last known good configuration"),
    ] {
        protected.push(Protected::Path {
            path: data.join(folder),
            what,
        });
    }
    for (path, what) in [
        (&ferry.config_file, "configuration file"),
        (&ferry.policy_dir, "policy folder"),
        (&ferry.artifacts_dir, "artifact store"),
    ] {
        if let Some(path) = path {
            protected.push(Protected::Path {
                path: absolute(path)?,
                what,
            });
        }
    }
    for (path, what) in &ferry.secret_files {
        protected.push(Protected::Path {
            path: absolute(path)?,
            what,
        });
    }
    Ok(protected)
}

fn roots(
    setting: Setting,
    raw: &[String],
    protected: &[Protected],
) -> Result<Vec<Template>, ConfinementError> {
    let fail = |reason: String| ConfinementError::Setting { setting, reason };
    raw.iter()
        .map(|raw| {
            let template = Template::parse(raw).map_err(|e| fail(e.to_string()))?;
            let path = normalise(Path::new(raw)).map_err(|e| fail(e.to_string()))?;
            if path.parent().is_none() {
                return Err(fail(format!("{raw}: the file system root is not a root")));
            }
            if let Some(p) = protected.iter().find(|p| could_overlap(&path, &p.anchor())) {
                return Err(fail(format!(
                    "{raw} would hold or lie in Ferry's {} ({}); choose a folder apart from them",
                    p.what(),
                    p.anchor().display()
                )));
            }
            Ok(template)
        })
        .collect()
}

fn env_prefix(raw: &str) -> Result<Template, ConfinementError> {
    let fail = |reason: String| ConfinementError::Setting {
        setting: Setting::EnvPrefix,
        reason,
    };
    let template = Template::parse(raw).map_err(|e| fail(e.to_string()))?;
    let literal = raw.replace(TENANT_PLACEHOLDER, "");
    if raw.is_empty() {
        return Err(fail("must not be empty".to_string()));
    }
    if !literal
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(fail(format!(
            "{raw:?} may only hold letters, digits, '_' and {TENANT_PLACEHOLDER}"
        )));
    }
    let before = raw.split(TENANT_PLACEHOLDER).next().unwrap_or_default();
    if !before.is_empty() && is_reserved_variable(before) {
        return Err(fail(format!(
            "{raw:?} starts like variables Ferry reserves (FERRY_*, AWS_*, …)"
        )));
    }
    Ok(template)
}

fn vault_prefix(raw: &str) -> Result<Template, ConfinementError> {
    let fail = |reason: String| ConfinementError::Setting {
        setting: Setting::VaultPrefix,
        reason,
    };
    let template = Template::parse(raw).map_err(|e| fail(e.to_string()))?;
    let trimmed = raw.strip_suffix('/').unwrap_or(raw);
    if !trimmed.is_empty()
        && (trimmed
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
            || raw.contains(['%', '\\', '?', '#']))
    {
        return Err(fail(format!(
            "{raw:?} must be mount/path/ segments (no empty, '.' or '..' segments, no '%', '?', '#')"
        )));
    }
    Ok(template)
}

fn url_prefixes(
    setting: Setting,
    raw: &[String],
    schemes: &[&str],
) -> Result<Vec<Template>, ConfinementError> {
    let fail = |reason: String| ConfinementError::Setting { setting, reason };
    raw.iter()
        .map(|raw| {
            let template = Template::parse(raw).map_err(|e| fail(e.to_string()))?;
            let sample = template.render("t");
            let Some((scheme, authority, path)) = split_url(&sample) else {
                return Err(fail(format!("{raw} is not a URL")));
            };
            if !schemes.contains(&scheme.as_str()) {
                return Err(fail(format!(
                    "{raw}: the scheme must be {}",
                    schemes.join(", ")
                )));
            }
            if authority.is_empty() || sample.contains(['?', '#']) || climbs(path) {
                return Err(fail(format!(
                    "{raw} must name a host and a path without '.', '..', '?' or '#'"
                )));
            }
            Ok(template)
        })
        .collect()
}

#[cfg(test)]
mod tests;

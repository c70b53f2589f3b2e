//! The program source: reads an IaC program out of Git with `gix`.
//!
//! A `programRef` is `<repository>#<folder>`:
//!
//! * a local path or a `file://` URL is opened in place (nothing is copied but the tree);
//! * any other URL (`https://`, `ssh://`, `git://`) is cloned once into
//!   `cache_dir/<tenant>/<sha256 of the URL>` and fetched again whenever the requested commit
//!   is not there yet, so a commit pushed after the first clone is still found. The cache is
//!   per tenant: naming another tenant's remote never serves that tenant's clone.
//!
//! Every checkout is for a tenant, checked with the live rules
//! ([`ferry_domain::confinement`]) before anything is read: a remote URL must be under the
//! tenant's allowed prefixes; a local repository must really (links resolved) be in the
//! tenant's program roots, and so must its Git folders, and it may not borrow objects from
//! elsewhere (`objects/info/alternates`). An operator-configured baseline program at its
//! commit is trusted as it is.
//!
//! The folder (optional; the repository root when absent) is read at the requested commit
//! (`programVersion`, a full or abbreviated id) and written into the caller's folder by
//! [`crate::checkout`], which can never leave it: files keep their executable bit, relative
//! symbolic links that stay inside the program are kept, submodules are skipped with a
//! warning (their content is not in this repository), and a tree holding anything that
//! would need to leave the folder (a link that leads out, alone or through other links, a
//! name twice, `..` or `.git` entries, odd modes, too many entries or bytes) is refused
//! whole, naming the entry ([`SourceError::Entry`]).
//!
//! Remotes go through gix's blocking network client with its pure-Rust HTTP transport
//! (reqwest with rustls: no system library needed), so
//! `https://` and `http://` (smart HTTP), `ssh://`, `git://` and `file://` remotes clone and
//! fetch. A remote that cannot be reached fails with a `Repository` error naming the URL.
//!
//! gix is blocking, so every checkout runs in `tokio::task::spawn_blocking`.

use crate::checkout;
use crate::confined::{self, ReadError};
use ferry_domain::confinement::{Confinement, Refusal, RootKind};
use ferry_domain::ports::sources::{Checkout, ProgramSource, SourceError};
use ferry_domain::values::{ProgramRef, ProgramVersion};
use ferry_domain::TenantId;
use sha2::{Digest, Sha256};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// Reads programs from Git repositories; remote ones are cached under `cache_dir`.
#[derive(Debug, Clone)]
pub struct GitProgramSource {
    cache_dir: PathBuf,
    /// Serialises clones and fetches into the cache: two runs of the same repository must
    /// not clone into the same folder at once.
    remote_lock: Arc<Mutex<()>>,
    confinement: Arc<Confinement>,
}

/// Where a repository lives, as parsed from the reference.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Location {
    /// Opened in place.
    Local(PathBuf),
    /// Cloned into the cache.
    Remote(String),
}

/// A program's tree, found.
struct Found<'r, 'a> {
    repo: &'r gix::Repository,
    tree: &'r gix::Tree<'r>,
    folder: &'a str,
    commit_hex: &'a str,
    repository: &'a str,
}

impl GitProgramSource {
    /// A source that clones remote repositories into `cache_dir` (created when needed);
    /// `confinement` says what each tenant may reach.
    pub fn new(cache_dir: impl Into<PathBuf>, confinement: Arc<Confinement>) -> Self {
        Self {
            cache_dir: cache_dir.into(),
            remote_lock: Arc::new(Mutex::new(())),
            confinement,
        }
    }

    /// The folder a remote repository of a tenant is cached in.
    pub fn cache_path(&self, tenant: &TenantId, url: &str) -> PathBuf {
        self.cache_dir
            .join(tenant.path_component())
            .join(hex::encode(Sha256::digest(url.as_bytes())))
    }

    fn checkout_blocking(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
        into: &Path,
    ) -> Result<Checkout, SourceError> {
        self.with_tree(tenant, program, version, true, |found| {
            let Found {
                repo,
                tree,
                folder,
                commit_hex,
                repository,
            } = found;
            let repo_err = |reason: String| SourceError::Repository {
                repository: repository.to_string(),
                reason,
            };
            prepare_target(into).map_err(|e| repo_err(e.to_string()))?;
            checkout::materialise(repo, tree, folder, into).map_err(|e| {
                tracing::warn!(repository, commit = %commit_hex, entry = %e.entry, reason = %e.reason, "checkout refused");
                SourceError::Entry {
                    repository: repository.to_string(),
                    commit: commit_hex.to_string(),
                    entry: e.entry,
                    reason: e.reason,
                }
            })?;
            tracing::info!(
                repository,
                folder = %folder,
                commit = %commit_hex,
                into = %into.display(),
                "program checked out"
            );
            Ok(Checkout {
                program_dir: into.to_path_buf(),
                commit: commit_hex.to_string(),
            })
        })
    }

    /// Finds the tree of `version` (the folder of `program`) as a checkout would, and hands
    /// it to `then`. Without `fetch`, a remote repository is read only from the cache, and a
    /// commit not there yet is not known to be missing (a `Repository` error).
    fn with_tree<T>(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
        fetch: bool,
        then: impl FnOnce(Found<'_, '_>) -> Result<T, SourceError>,
    ) -> Result<T, SourceError> {
        let refused = |refusal: Refusal| {
            tracing::warn!(%tenant, program = program.as_str(), %refusal, "program refused");
            SourceError::Refused {
                reference: program.to_string(),
                refusal,
            }
        };
        self.confinement
            .check_program(tenant, program, version)
            .map_err(refused)?;
        let trusted = self.confinement.is_trusted_program(program, version);
        let (program, version) = (program.as_str(), version.as_str());
        let (repository, folder) = split_program_ref(program);
        let repo_err = |reason: String| SourceError::Repository {
            repository: repository.to_string(),
            reason,
        };
        let folder = normalise_folder(folder).map_err(|e| repo_err(e.to_string()))?;
        let repo = match parse_location(repository) {
            Location::Local(path) => {
                // The operator's baselines may be anywhere but in Ferry's own files.
                let kind = (!trusted).then_some(RootKind::Programs);
                let check = |path: &Path| {
                    confined::check_real(&self.confinement, tenant, path, kind).map_err(|e| match e
                    {
                        ReadError::Refused(r) => refused(r),
                        ReadError::Io { reason, .. } => repo_err(format!(
                            "cannot open {} as a Git repository: {reason}",
                            path.display()
                        )),
                    })
                };
                let real = check(&path)?;
                let repo = open_local(&real).map_err(|e| repo_err(e.to_string()))?;
                // A `.git` file or linked folders may lead elsewhere: every folder Git
                // reads must be inside the roots too, and no alternates may add objects.
                for dir in [
                    repo.git_dir().to_path_buf(),
                    repo.common_dir().to_path_buf(),
                    repo.common_dir().join("objects"),
                ] {
                    check(&dir)?;
                }
                let info = repo.common_dir().join("objects/info");
                if !trusted
                    && ["alternates", "http-alternates"]
                        .iter()
                        .any(|f| std::fs::symlink_metadata(info.join(f)).is_ok())
                {
                    return Err(refused(Refusal::Malformed(format!(
                        "{repository} borrows objects from other repositories (objects/info/alternates), which is refused"
                    ))));
                }
                repo
            }
            Location::Remote(url) if fetch => self.remote_with_commit(tenant, &url, version)?,
            Location::Remote(url) => {
                let cached = open_local(&self.cache_path(tenant, &url)).map_err(|_| {
                    repo_err("not in the cache, and not fetched to look it up".to_string())
                })?;
                if resolve_commit(&cached, version).is_none() {
                    return Err(repo_err(format!(
                        "commit {version} is not in the cache, and it was not fetched to look it up"
                    )));
                }
                cached
            }
        };

        let commit = resolve_commit(&repo, version).ok_or_else(|| SourceError::CommitNotFound {
            repository: repository.to_string(),
            commit: version.to_string(),
        })?;
        let commit_hex = commit.to_string();
        let tree = repo
            .find_commit(commit)
            .and_then(|c| c.tree())
            .map_err(|e| repo_err(format!("cannot read the tree of commit {commit_hex}: {e}")))?;

        let tree = if folder.is_empty() {
            tree
        } else {
            let not_found = || SourceError::FolderNotFound {
                repository: repository.to_string(),
                commit: commit_hex.clone(),
                folder: folder.clone(),
            };
            let entry = tree
                .lookup_entry_by_path(&folder)
                .map_err(|e| repo_err(format!("cannot look up {folder}: {e}")))?
                .ok_or_else(not_found)?;
            if !entry.mode().is_tree() {
                return Err(not_found());
            }
            repo.find_tree(entry.object_id())
                .map_err(|e| repo_err(format!("cannot read folder {folder}: {e}")))?
        };

        then(Found {
            repo: &repo,
            tree: &tree,
            folder: &folder,
            commit_hex: &commit_hex,
            repository,
        })
    }

    /// Opens (cloning when needed) the cached copy of `url` and fetches when `version` is not
    /// in it yet.
    fn remote_with_commit(
        &self,
        tenant: &TenantId,
        url: &str,
        version: &str,
    ) -> Result<gix::Repository, SourceError> {
        let repo_err = |reason: String| SourceError::Repository {
            repository: url.to_string(),
            reason,
        };
        // A poisoned lock only means another checkout panicked; the cache is still usable
        // because clones are atomic (gix removes a failed clone).
        let _guard = self
            .remote_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let path = self.cache_path(tenant, url);
        let repo = match open_local(&path) {
            Ok(repo) => repo,
            Err(_) => {
                if path.exists() {
                    // A half-written cache from a crash: start again.
                    std::fs::remove_dir_all(&path).map_err(|e| {
                        repo_err(format!("cannot clear the cache {}: {e}", path.display()))
                    })?;
                }
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)
                        .map_err(|e| repo_err(format!("cannot create the cache folder: {e}")))?;
                }
                tracing::info!(repository = url, cache = %path.display(), "cloning program repository");
                return clone(url, &path).map_err(|e| repo_err(e.to_string()));
            }
        };
        if resolve_commit(&repo, version).is_some() {
            return Ok(repo);
        }
        tracing::info!(
            repository = url,
            commit = version,
            "commit not cached; fetching"
        );
        fetch(&repo).map_err(|e| repo_err(e.to_string()))?;
        // Re-open so that the newly written pack is seen.
        open_local(&path).map_err(|e| repo_err(e.to_string()))
    }
}

#[async_trait::async_trait]
impl ProgramSource for GitProgramSource {
    async fn checkout(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
        into: &Path,
    ) -> Result<Checkout, SourceError> {
        let this = self.clone();
        let tenant = tenant.clone();
        let program = program.clone();
        let version = version.clone();
        let into = into.to_path_buf();
        let repository = split_program_ref(program.as_str()).0.to_string();
        tokio::task::spawn_blocking(move || {
            this.checkout_blocking(&tenant, &program, &version, &into)
        })
        .await
        .map_err(|e| SourceError::Repository {
            repository,
            reason: format!("the checkout task failed: {e}"),
        })?
    }

    async fn locate(
        &self,
        tenant: &TenantId,
        program: &ProgramRef,
        version: &ProgramVersion,
    ) -> Result<(), SourceError> {
        let this = self.clone();
        let tenant = tenant.clone();
        let program = program.clone();
        let version = version.clone();
        let repository = split_program_ref(program.as_str()).0.to_string();
        tokio::task::spawn_blocking(move || {
            this.with_tree(&tenant, &program, &version, false, |_| Ok(()))
        })
        .await
        .map_err(|e| SourceError::Repository {
            repository,
            reason: format!("the lookup task failed: {e}"),
        })?
    }
}

/// `<repository>#<folder>` → (repository, folder).
fn split_program_ref(program: &str) -> (&str, &str) {
    program.split_once('#').unwrap_or((program, ""))
}

fn parse_location(repository: &str) -> Location {
    if let Some(rest) = repository.strip_prefix("file://") {
        // file:///abs/path and file://localhost/abs/path name a path on this machine.
        let path = rest.strip_prefix("localhost").unwrap_or(rest);
        return Location::Local(PathBuf::from(path));
    }
    if repository.contains("://") {
        return Location::Remote(repository.to_string());
    }
    Location::Local(PathBuf::from(repository))
}

/// Why a repository could not be read or written as a checkout needs; its text is the
/// `reason` of [`SourceError::Repository`].
#[derive(Debug, thiserror::Error)]
enum GitError {
    /// The folder of the reference leaves the repository.
    #[error("folder {0:?} must be a relative path inside the repository")]
    Folder(String),
    /// Not a repository (or not readable).
    #[error("cannot open {} as a Git repository: {reason}", path.display())]
    Open {
        /// The folder.
        path: PathBuf,
        /// gix's reason.
        reason: String,
    },
    /// The clone failed (with its causes).
    #[error("cannot clone: {0}")]
    Clone(String),
    /// The cached clone cannot be given a reflog identity.
    #[error("cannot set the reflog identity: {0}")]
    ReflogIdentity(String),
    /// The cached clone has no remote to fetch from.
    #[error("the cached clone has no remote")]
    NoRemote,
    /// The cached clone's remote cannot be read.
    #[error("cannot read the remote: {0}")]
    Remote(String),
    /// The remote cannot be reached (with its causes).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The fetch failed (with its causes).
    #[error("cannot fetch: {0}")]
    Fetch(String),
    /// The checkout folder cannot be created.
    #[error("cannot create the checkout folder {}: {source}", path.display())]
    CreateTarget {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The checkout folder cannot be listed.
    #[error("cannot read the checkout folder {}: {source}", path.display())]
    ReadTarget {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The checkout folder holds something already.
    #[error("the checkout folder {} is not empty", .0.display())]
    TargetNotEmpty(PathBuf),
}

/// Trims slashes and refuses folders that climb out of the repository.
fn normalise_folder(folder: &str) -> Result<String, GitError> {
    let trimmed = folder.trim_matches('/');
    let mut parts = Vec::new();
    for component in Path::new(trimmed).components() {
        match component {
            Component::Normal(part) => parts.push(part.to_string_lossy().into_owned()),
            Component::CurDir => {}
            _ => return Err(GitError::Folder(folder.to_string())),
        }
    }
    Ok(parts.join("/"))
}

fn open_local(path: &Path) -> Result<gix::Repository, GitError> {
    // Isolated: the user's and system's git configuration must not change what is read.
    gix::open_opts(path, gix::open::Options::isolated()).map_err(|e| GitError::Open {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// The commit `version` names (full or abbreviated), or `None` when there is none.
fn resolve_commit(repo: &gix::Repository, version: &str) -> Option<gix::ObjectId> {
    let version = version.to_ascii_lowercase();
    let version = version.as_str();
    let id = if version.len() == repo.object_hash().len_in_hex() {
        gix::ObjectId::from_hex(version.as_bytes()).ok()?
    } else {
        let prefix = gix::hash::Prefix::from_hex(version).ok()?;
        // `Err(())` is an ambiguous prefix: that names no single commit either.
        repo.objects.lookup_prefix(prefix, None).ok()??.ok()?
    };
    repo.find_commit(id).ok().map(|c| c.id)
}

/// An error with its causes, so "handshake failed" says why.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn clone(url: &str, path: &Path) -> Result<gix::Repository, GitError> {
    let interrupt = AtomicBool::new(false);
    // A clone without checkout: only the object database is needed.
    let mut prepare = gix::prepare_clone(url, path).map_err(|e| GitError::Clone(chain(&e)))?;
    let (repo, _outcome) = prepare
        .fetch_only(gix::progress::Discard, &interrupt)
        .map_err(|e| GitError::Clone(chain(&e)))?;
    Ok(repo)
}

fn fetch(repo: &gix::Repository) -> Result<(), GitError> {
    let interrupt = AtomicBool::new(false);
    // Ref updates write reflog entries, which need a committer; the cache is opened
    // isolated from the user's configuration, so give it a neutral one.
    let mut repo = repo.clone();
    repo.committer_or_set_fallback("ferry", "ferry@localhost")
        .map_err(|e| GitError::ReflogIdentity(e.to_string()))?;
    let remote = repo
        .find_default_remote(gix::remote::Direction::Fetch)
        .ok_or(GitError::NoRemote)?
        .map_err(|e| GitError::Remote(e.to_string()))?;
    remote
        .connect(gix::remote::Direction::Fetch)
        .map_err(|e| GitError::Connect(chain(&e)))?
        .prepare_fetch(gix::progress::Discard, Default::default())
        .map_err(|e| GitError::Fetch(chain(&e)))?
        .receive(gix::progress::Discard, &interrupt)
        .map_err(|e| GitError::Fetch(chain(&e)))?;
    Ok(())
}

/// Creates `into`; it must be empty so that no stale file mixes into the program.
fn prepare_target(into: &Path) -> Result<(), GitError> {
    std::fs::create_dir_all(into).map_err(|source| GitError::CreateTarget {
        path: into.to_path_buf(),
        source,
    })?;
    let mut entries = std::fs::read_dir(into).map_err(|source| GitError::ReadTarget {
        path: into.to_path_buf(),
        source,
    })?;
    if entries.next().is_some() {
        return Err(GitError::TargetNotEmpty(into.to_path_buf()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confined::testing::rules;
    use std::process::Command;

    fn acme() -> TenantId {
        TenantId::parse("acme").unwrap()
    }

    fn globex() -> TenantId {
        TenantId::parse("globex").unwrap()
    }

    /// Rules whose program root is the temporary folder (where every test repository is),
    /// with these remote URL prefixes.
    fn in_temp(url_prefixes: &[&str]) -> Arc<Confinement> {
        let temp = std::env::temp_dir().display().to_string();
        let urls: Vec<String> = url_prefixes.iter().map(|u| u.to_string()).collect();
        rules(&[], &[temp], &urls)
    }

    fn git(dir: &Path, args: &[&str]) -> String {
        let out = Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@example.com")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@example.com")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", dir)
            .output()
            .expect("git runs");
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// A repository with two commits: the first has `stacks/web/Pulumi.yaml`, the second
    /// changes it and adds an executable script and `other.txt` at the root.
    fn repo() -> (tempfile::TempDir, String, String) {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        git(d, &["init", "-q", "-b", "main"]);
        std::fs::create_dir_all(d.join("stacks/web")).unwrap();
        std::fs::write(d.join("stacks/web/Pulumi.yaml"), "name: web-v1\n").unwrap();
        git(d, &["add", "."]);
        git(d, &["commit", "-q", "-m", "first"]);
        let first = git(d, &["rev-parse", "HEAD"]);
        std::fs::write(d.join("stacks/web/Pulumi.yaml"), "name: web-v2\n").unwrap();
        std::fs::write(d.join("stacks/web/run.sh"), "#!/bin/sh\necho hi\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(
                d.join("stacks/web/run.sh"),
                std::fs::Permissions::from_mode(0o755),
            )
            .unwrap();
        }
        std::fs::write(d.join("other.txt"), "root file").unwrap();
        git(d, &["add", "."]);
        git(d, &["commit", "-q", "-m", "second"]);
        let second = git(d, &["rev-parse", "HEAD"]);
        (dir, first, second)
    }

    fn pr(s: &str) -> ProgramRef {
        ProgramRef::parse(s).unwrap()
    }
    fn pv(s: &str) -> ProgramVersion {
        ProgramVersion::parse(s).unwrap()
    }

    #[tokio::test]
    async fn checks_out_a_folder_by_full_and_short_commit() {
        let (repo, first, second) = repo();
        let cache = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let source = GitProgramSource::new(cache.path(), in_temp(&[]));
        let program = pr(&format!("{}#stacks/web", repo.path().display()));

        let into = out.path().join("a");
        let c = source
            .checkout(&acme(), &program, &pv(&first), &into)
            .await
            .unwrap();
        assert_eq!(c.commit, first);
        assert_eq!(c.program_dir, into);
        assert_eq!(
            std::fs::read_to_string(into.join("Pulumi.yaml")).unwrap(),
            "name: web-v1\n"
        );
        assert!(!into.join("run.sh").exists());

        let into = out.path().join("b");
        let c = source
            .checkout(&acme(), &program, &pv(&second[..8]), &into)
            .await
            .unwrap();
        assert_eq!(c.commit, second, "the full id is returned for a short one");
        assert_eq!(
            std::fs::read_to_string(into.join("Pulumi.yaml")).unwrap(),
            "name: web-v2\n"
        );
        assert!(
            !into.join("other.txt").exists(),
            "only the folder is written"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &str| {
                std::fs::metadata(into.join(p))
                    .unwrap()
                    .permissions()
                    .mode()
            };
            assert_eq!(mode("run.sh") & 0o111, 0o111, "executable bit kept");
            assert_eq!(mode("Pulumi.yaml") & 0o111, 0, "plain file not executable");
        }
    }

    #[tokio::test]
    async fn checks_out_the_root_via_file_url() {
        let (repo, _first, second) = repo();
        let cache = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let source = GitProgramSource::new(cache.path(), in_temp(&[]));
        let program = pr(&format!("file://{}", repo.path().display()));
        let c = source
            .checkout(&acme(), &program, &pv(&second), out.path())
            .await
            .unwrap();
        assert_eq!(c.commit, second);
        assert_eq!(
            std::fs::read_to_string(out.path().join("other.txt")).unwrap(),
            "root file"
        );
        assert_eq!(
            std::fs::read_to_string(out.path().join("stacks/web/Pulumi.yaml")).unwrap(),
            "name: web-v2\n"
        );
        assert!(!out.path().join(".git").exists());
        assert!(
            std::fs::read_dir(cache.path()).unwrap().next().is_none(),
            "local repos are not cached"
        );
    }

    #[tokio::test]
    async fn unknown_commit_names_the_reference() {
        let (repo, _, _) = repo();
        let out = tempfile::tempdir().unwrap();
        let source = GitProgramSource::new(out.path().join("cache"), in_temp(&[]));
        let repository = repo.path().display().to_string();
        let err = source
            .checkout(
                &acme(),
                &pr(&format!("{repository}#stacks/web")),
                &pv("deadbeefdeadbeef"),
                &out.path().join("x"),
            )
            .await
            .unwrap_err();
        assert_eq!(
            err,
            SourceError::CommitNotFound {
                repository: repository.clone(),
                commit: "deadbeefdeadbeef".into()
            }
        );
        assert!(err.to_string().contains("deadbeefdeadbeef"));
    }

    #[tokio::test]
    async fn folder_missing_at_that_commit_names_the_reference() {
        let (repo, first, _) = repo();
        let out = tempfile::tempdir().unwrap();
        let source = GitProgramSource::new(out.path().join("cache"), in_temp(&[]));
        let repository = repo.path().display().to_string();
        let err = source
            .checkout(
                &acme(),
                &pr(&format!("{repository}#stacks/api")),
                &pv(&first),
                &out.path().join("x"),
            )
            .await
            .unwrap_err();
        assert_eq!(
            err,
            SourceError::FolderNotFound {
                repository: repository.clone(),
                commit: first.clone(),
                folder: "stacks/api".into()
            }
        );
        // A file is not a folder either.
        let err = source
            .checkout(
                &acme(),
                &pr(&format!("{repository}#stacks/web/Pulumi.yaml")),
                &pv(&first),
                &out.path().join("y"),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, SourceError::FolderNotFound { .. }), "{err:?}");
        // Climbing out of the repository is refused before anything is read.
        let err = source
            .checkout(
                &acme(),
                &pr(&format!("{repository}#../etc")),
                &pv(&first),
                &out.path().join("z"),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, SourceError::Refused { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn not_a_repository_is_a_repository_error() {
        let dir = tempfile::tempdir().unwrap();
        let source = GitProgramSource::new(dir.path().join("cache"), in_temp(&[]));
        let missing = dir.path().join("nothing-here").display().to_string();
        let err = source
            .checkout(
                &acme(),
                &pr(&missing),
                &pv("abcdef1"),
                &dir.path().join("x"),
            )
            .await
            .unwrap_err();
        match err {
            SourceError::Repository { repository, .. } => assert_eq!(repository, missing),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn refuses_a_non_empty_target() {
        let (repo, first, _) = repo();
        let out = tempfile::tempdir().unwrap();
        std::fs::write(out.path().join("stale"), "x").unwrap();
        let source = GitProgramSource::new(out.path().join("cache"), in_temp(&[]));
        let err = source
            .checkout(
                &acme(),
                &pr(&repo.path().display().to_string()),
                &pv(&first),
                out.path(),
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains("not empty"), "{err}");
    }

    /// The remote path (clone into the cache, fetch when the commit is new) exercised over
    /// the `file://` transport, since no network is reachable here.
    #[test]
    fn remote_clone_then_fetch_for_a_new_commit() {
        let (repo, first, _second) = repo();
        let cache = tempfile::tempdir().unwrap();
        let source = GitProgramSource::new(cache.path().join("cache"), in_temp(&[]));
        let url = format!("file://{}", repo.path().display());

        let cached = source.remote_with_commit(&acme(), &url, &first).unwrap();
        assert!(resolve_commit(&cached, &first).is_some());
        assert!(source
            .cache_path(&acme(), &url)
            .starts_with(cache.path().join("cache")));

        std::fs::write(repo.path().join("third.txt"), "3").unwrap();
        git(repo.path(), &["add", "."]);
        git(repo.path(), &["commit", "-q", "-m", "third"]);
        let third = git(repo.path(), &["rev-parse", "HEAD"]);
        assert!(resolve_commit(
            &open_local(&source.cache_path(&acme(), &url)).unwrap(),
            &third
        )
        .is_none());
        let fetched = source.remote_with_commit(&acme(), &url, &third).unwrap();
        assert_eq!(
            resolve_commit(&fetched, &third).map(|id| id.to_string()),
            Some(third)
        );

        // The cache is acme's own: with the remote gone, acme still reads its clone, and
        // globex, naming the same remote, gets no copy of it.
        assert_eq!(
            source.cache_path(&acme(), &url),
            cache
                .path()
                .join("cache/acme")
                .join(hex::encode(Sha256::digest(url.as_bytes())))
        );
        drop(repo);
        assert!(source.remote_with_commit(&acme(), &url, &first).is_ok());
        let err = source
            .remote_with_commit(&globex(), &url, &first)
            .unwrap_err();
        assert!(
            matches!(&err, SourceError::Repository { reason, .. } if reason.contains("cannot clone")),
            "{err:?}"
        );
        assert!(!source.cache_path(&globex(), &url).exists());
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn links_inside_are_kept_and_submodules_skipped() {
        let (repo, _, _) = repo();
        let d = repo.path();
        std::os::unix::fs::symlink("Pulumi.yaml", d.join("stacks/web/link.yaml")).unwrap();
        // A link through a link that stays inside: `a/b/l` leads to the program folder.
        std::fs::create_dir_all(d.join("stacks/web/a/b")).unwrap();
        std::os::unix::fs::symlink("../..", d.join("stacks/web/a/b/l")).unwrap();
        std::os::unix::fs::symlink("a/b/l/Pulumi.yaml", d.join("stacks/web/through.yaml")).unwrap();
        git(d, &["add", "."]);
        let some_commit = git(d, &["rev-parse", "HEAD"]);
        git(
            d,
            &[
                "update-index",
                "--add",
                "--cacheinfo",
                &format!("160000,{some_commit},stacks/web/vendored"),
            ],
        );
        git(d, &["commit", "-q", "-m", "links and a submodule"]);
        let head = git(d, &["rev-parse", "HEAD"]);

        let out = tempfile::tempdir().unwrap();
        let source = GitProgramSource::new(out.path().join("cache"), in_temp(&[]));
        let into = out.path().join("p");
        source
            .checkout(
                &acme(),
                &pr(&format!("{}#stacks/web", d.display())),
                &pv(&head.to_uppercase()),
                &into,
            )
            .await
            .unwrap();
        assert_eq!(
            std::fs::read_link(into.join("link.yaml")).unwrap(),
            Path::new("Pulumi.yaml")
        );
        for link in ["link.yaml", "through.yaml"] {
            assert_eq!(
                std::fs::read_to_string(into.join(link)).unwrap(),
                "name: web-v2\n"
            );
        }
        assert!(!into.join("vendored").exists(), "submodule skipped");
        assert!(into.join("run.sh").is_file());
    }

    /// Runs git with `input` on its standard input.
    fn git_stdin(dir: &Path, args: &[&str], input: &[u8]) -> String {
        use std::io::Write;
        let mut child = Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@example.com")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@example.com")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", dir)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("git runs");
        child.stdin.take().unwrap().write_all(input).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// A hostile repository, written object by object: trees hold exactly the entries given,
    /// in that order (duplicates, `..`, odd modes included, which `git mktree` refuses).
    struct Crafted {
        dir: tempfile::TempDir,
    }

    impl Crafted {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            git(dir.path(), &["init", "-q", "-b", "main"]);
            Self { dir }
        }
        fn blob(&self, data: &str) -> String {
            git_stdin(
                self.dir.path(),
                &["hash-object", "-w", "--stdin"],
                data.as_bytes(),
            )
        }
        /// A link entry's blob holds its target.
        fn link(&self, name: &str, target: &str) -> (String, String, String) {
            ("120000".into(), name.into(), self.blob(target))
        }
        fn file(&self, name: &str, data: &str) -> (String, String, String) {
            ("100644".into(), name.into(), self.blob(data))
        }
        fn folder(
            &self,
            name: &str,
            entries: &[(String, String, String)],
        ) -> (String, String, String) {
            ("40000".into(), name.into(), self.tree(entries))
        }
        fn tree(&self, entries: &[(String, String, String)]) -> String {
            let mut bytes = Vec::new();
            for (mode, name, id) in entries {
                bytes.extend_from_slice(format!("{mode} {name}\0").as_bytes());
                bytes.extend_from_slice(&hex::decode(id).unwrap());
            }
            git_stdin(
                self.dir.path(),
                &["hash-object", "-t", "tree", "-w", "--literally", "--stdin"],
                &bytes,
            )
        }
        /// A commit whose root holds `infra` with these entries.
        fn commit(&self, infra: &[(String, String, String)]) -> String {
            let root = self.tree(&[self.folder("infra", infra)]);
            git(self.dir.path(), &["commit-tree", &root, "-m", "crafted"])
        }
        /// `a/b/c/d/l -> ../../../..`: inside alone, it leads to the program folder.
        fn ladder(&self) -> (String, String, String) {
            let d = self.folder("d", &[self.link("l", "../../../..")]);
            let c = self.folder("c", &[d]);
            let b = self.folder("b", &[c]);
            self.folder("a", &[b])
        }
        async fn checkout(&self, commit: &str, into: &Path) -> Result<Checkout, SourceError> {
            let source = GitProgramSource::new(self.dir.path().join("cache"), in_temp(&[]));
            let program = pr(&format!("{}#infra", self.dir.path().display()));
            source.checkout(&acme(), &program, &pv(commit), into).await
        }
    }

    /// What a refused checkout must say: the entry, and why.
    fn refused(result: Result<Checkout, SourceError>, entry: &str, why: &str) {
        match result {
            Err(SourceError::Entry {
                entry: named,
                reason,
                ..
            }) => {
                assert_eq!(named, entry, "{reason}");
                assert!(reason.contains(why), "{entry}: {reason}");
            }
            other => panic!("{entry}: expected a refusal, got {other:?}"),
        }
    }

    fn is_empty(dir: &Path) -> bool {
        std::fs::read_dir(dir).unwrap().next().is_none()
    }

    /// The issue's reproduction: `infra/a/b/c/d/l -> ../../../..` leads to the checkout
    /// folder and `infra/Pulumi.yaml -> a/b/c/d/l/../../../../tenants/acme/infra/web/Pulumi.yaml`
    /// climbs four levels above it (the data dir) into another tenant's program. Each link
    /// is inside lexically; together they leave, so the checkout is refused naming the
    /// entry, and nothing is written.
    #[tokio::test]
    async fn a_chain_of_links_that_leaves_the_checkout_is_refused() {
        let crafted = Crafted::new();
        let commit = crafted.commit(&[
            crafted.ladder(),
            crafted.link(
                "Pulumi.yaml",
                "a/b/c/d/l/../../../../tenants/acme/infra/web/Pulumi.yaml",
            ),
        ]);
        let data = tempfile::tempdir().unwrap();
        let acme_program = data.path().join("tenants/acme/infra/web/Pulumi.yaml");
        std::fs::create_dir_all(acme_program.parent().unwrap()).unwrap();
        std::fs::write(&acme_program, "name: acme-web\n").unwrap();
        let into = data.path().join("work/runs/acm/checkout");
        std::fs::create_dir_all(&into).unwrap();

        refused(
            crafted.checkout(&commit, &into).await,
            "infra/Pulumi.yaml",
            "leads outside the checkout",
        );
        assert!(is_empty(&into), "nothing is written of a refused tree");
        assert_eq!(
            std::fs::read_to_string(&acme_program).unwrap(),
            "name: acme-web\n"
        );
    }

    /// The same name twice in one tree: first `x` as a link through the chain to a file
    /// outside (the data dir's key), then `x` as a blob. The blob must never be written
    /// through the link: the tree is refused naming `x`, and the file outside keeps its
    /// bytes and its mode.
    #[cfg(unix)]
    #[tokio::test]
    async fn a_name_twice_never_writes_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let crafted = Crafted::new();
        let data = tempfile::tempdir().unwrap();
        let key = data.path().join("jwt-hs256.key");
        std::fs::write(&key, "the real key\n").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let into = data.path().join("work/runs/acm/checkout");
        std::fs::create_dir_all(&into).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;

        let through = "a/b/c/d/l/../../../../jwt-hs256.key";
        for (entries, entry, why) in [
            (
                vec![
                    crafted.ladder(),
                    crafted.link("x", through),
                    crafted.file("x", "PWNED-BY-ACM"),
                ],
                "infra/x",
                "twice",
            ),
            // The file first, the link second: refused alike.
            (
                vec![
                    crafted.ladder(),
                    crafted.file("x", "PWNED-BY-ACM"),
                    crafted.link("x", through),
                ],
                "infra/x",
                "twice",
            ),
            // A folder written through a link of the same name.
            (
                vec![
                    crafted.ladder(),
                    crafted.link("y", "a/b/c/d/l/../../../.."),
                    crafted.folder("y", &[crafted.file("jwt-hs256.key", "PWNED-BY-ACM")]),
                ],
                "infra/y",
                "twice",
            ),
            // Names that differ only in case are one file on a case-insensitive disk.
            (
                vec![
                    crafted.ladder(),
                    crafted.link("X", through),
                    crafted.file("x", "PWNED-BY-ACM"),
                ],
                "infra/x",
                "infra/X, which differs only in case",
            ),
        ] {
            let commit = crafted.commit(&entries);
            refused(crafted.checkout(&commit, &into).await, entry, why);
            assert!(is_empty(&into), "{entry}: nothing is written");
            assert_eq!(std::fs::read_to_string(&key).unwrap(), "the real key\n");
            assert_eq!(mode(&key), 0o600, "{entry}: the key keeps its mode");
        }
    }

    /// Every other way out, and entries that are not part of a program: refused naming the
    /// entry, with nothing written.
    #[tokio::test]
    async fn entries_that_would_leave_or_are_unsafe_are_refused() {
        let crafted = Crafted::new();
        let out = tempfile::tempdir().unwrap();
        let sub = || crafted.folder("sub", &[crafted.link("l", "..")]);
        let mut deep = crafted.file("Pulumi.yaml", "name: deep\n");
        for level in 0..140 {
            deep = crafted.folder(&format!("n{level}"), &[deep]);
        }
        let too_deep = (11..140)
            .rev()
            .map(|level| format!("n{level}"))
            .collect::<Vec<_>>()
            .join("/");
        let too_deep = format!("infra/{too_deep}");
        let cases = vec![
            (
                vec![crafted.link("passwd", "/etc/passwd")],
                "infra/passwd",
                "absolute",
            ),
            (
                vec![crafted.link("up", "../outside")],
                "infra/up",
                "leads outside",
            ),
            (
                vec![crafted.link("here", ".."), crafted.link("x", "here/x")],
                "infra/here",
                "leads outside",
            ),
            // Each harmless alone: `sub/l` is the program folder, one more `..` leaves it.
            (
                vec![sub(), crafted.link("y", "sub/l/..")],
                "infra/y",
                "leads outside",
            ),
            (
                vec![sub(), crafted.link("y", "sub/l/../infra")],
                "infra/y",
                "leads outside",
            ),
            // Through a link found in another case.
            (
                vec![sub(), crafted.link("y", "SUB/L/..")],
                "infra/y",
                "leads outside",
            ),
            // Past a name that is not there yet, the path must still stay inside.
            (
                vec![crafted.link("z", "missing/../..")],
                "infra/z",
                "leads outside",
            ),
            (
                vec![crafted.file("f", "x"), crafted.link("z", "f/../../etc")],
                "infra/z",
                "leads outside",
            ),
            (
                vec![crafted.link("p", "q"), crafted.link("q", "p")],
                "infra/p",
                "more than 40 links",
            ),
            (vec![crafted.link("e", "")], "infra/e", "empty"),
            (vec![crafted.file("..", "x")], "infra/..", "not a name"),
            (vec![crafted.file(".", "x")], "infra/.", "not a name"),
            (
                vec![crafted.folder(".git", &[crafted.file("config", "x")])],
                "infra/.git",
                ".git",
            ),
            (vec![crafted.file(".GIT", "x")], "infra/.GIT", ".git"),
            (vec![crafted.file("a\\b", "x")], "infra/a\\b", "separator"),
            (
                vec![("20000".into(), "dev".into(), crafted.blob("x"))],
                "infra/dev",
                "mode 20000",
            ),
            (
                vec![("40000".into(), "t".into(), crafted.blob("x"))],
                "infra/t",
                "cannot read the folder",
            ),
            (vec![deep], too_deep.as_str(), "deeper than"),
        ];
        for (index, (entries, entry, why)) in cases.into_iter().enumerate() {
            let into = out.path().join(index.to_string());
            std::fs::create_dir_all(&into).unwrap();
            let commit = crafted.commit(&entries);
            refused(crafted.checkout(&commit, &into).await, entry, why);
            assert!(is_empty(&into), "{entry}: nothing is written");
        }
    }

    /// Runs `git http-backend` (smart HTTP) as a CGI program for one request.
    async fn http_backend(
        root: PathBuf,
        request: axum::extract::Request,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        let (parts, body) = request.into_parts();
        let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let mut command = tokio::process::Command::new("git");
        command
            .arg("http-backend")
            .env("GIT_PROJECT_ROOT", &root)
            .env("GIT_HTTP_EXPORT_ALL", "1")
            .env("PATH_INFO", parts.uri.path())
            .env("REQUEST_METHOD", parts.method.as_str())
            .env("QUERY_STRING", parts.uri.query().unwrap_or(""))
            .env("CONTENT_LENGTH", body.len().to_string())
            .env("REMOTE_ADDR", "127.0.0.1")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        for (name, value) in &parts.headers {
            let value = value.to_str().unwrap_or_default();
            if name == axum::http::header::CONTENT_TYPE {
                command.env("CONTENT_TYPE", value);
            }
            // What a web server does for git: pass the protocol version through.
            if name.as_str().eq_ignore_ascii_case("git-protocol") {
                command.env("GIT_PROTOCOL", value);
            }
            command.env(
                format!("HTTP_{}", name.as_str().to_uppercase().replace('-', "_")),
                value,
            );
        }
        let mut child = command.spawn().unwrap();
        {
            use tokio::io::AsyncWriteExt;
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(&body).await.unwrap();
        }
        let out = child.wait_with_output().await.unwrap();
        let split = out
            .stdout
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map(|i| (i, 4))
            .or_else(|| {
                out.stdout
                    .windows(2)
                    .position(|w| w == b"\n\n")
                    .map(|i| (i, 2))
            });
        let (end, sep) = split.unwrap();
        let head = String::from_utf8_lossy(&out.stdout[..end]).to_string();
        let mut response = axum::response::Response::builder();
        for line in head.lines() {
            let (name, value) = line.split_once(':').unwrap();
            if name.eq_ignore_ascii_case("status") {
                let code: u16 = value.trim()[..3].parse().unwrap();
                response = response.status(code);
            } else {
                response = response.header(name.trim(), value.trim());
            }
        }
        response
            .body(axum::body::Body::from(out.stdout[end + sep..].to_vec()))
            .unwrap()
            .into_response()
    }

    /// A remote over smart HTTP (the transport https uses, without TLS): cloned into the
    /// cache, then fetched again for a commit pushed after the clone.
    #[tokio::test]
    async fn an_http_remote_is_cloned_then_fetched() {
        let (work, first, _second) = repo();
        let served = tempfile::tempdir().unwrap();
        let bare = served.path().join("infra.git");
        git(
            served.path(),
            &[
                "clone",
                "-q",
                "--bare",
                work.path().to_str().unwrap(),
                bare.to_str().unwrap(),
            ],
        );
        let root = served.path().to_path_buf();
        let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
            let root = root.clone();
            async move { http_backend(root, request).await }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = format!("http://{}", listener.local_addr().unwrap());
        let url = format!("{host}/infra.git");
        let server = tokio::spawn(async move { axum::serve(listener, app).await });

        let out = tempfile::tempdir().unwrap();
        let allowed = format!("{host}/");
        let source = GitProgramSource::new(out.path().join("cache"), in_temp(&[&allowed]));
        let checkout = source
            .checkout(
                &acme(),
                &pr(&format!("{url}#stacks/web")),
                &pv(&first),
                &out.path().join("a"),
            )
            .await
            .unwrap();
        assert_eq!(checkout.commit, first);
        assert_eq!(
            std::fs::read_to_string(checkout.program_dir.join("Pulumi.yaml")).unwrap(),
            "name: web-v1\n"
        );
        assert!(
            source.cache_path(&acme(), &url).exists(),
            "cloned into the cache"
        );

        // A commit pushed after the clone is fetched on demand.
        std::fs::write(work.path().join("stacks/web/Pulumi.yaml"), "name: web-v3\n").unwrap();
        git(work.path(), &["commit", "-q", "-am", "third"]);
        let third = git(work.path(), &["rev-parse", "HEAD"]);
        git(
            work.path(),
            &["push", "-q", bare.to_str().unwrap(), "HEAD:main"],
        );
        let checkout = source
            .checkout(
                &acme(),
                &pr(&format!("{url}#stacks/web")),
                &pv(&third),
                &out.path().join("b"),
            )
            .await
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(checkout.program_dir.join("Pulumi.yaml")).unwrap(),
            "name: web-v3\n"
        );

        // The cache is acme's: with the server gone, acme still reads its cached clone, and
        // globex, naming the same remote, gets no copy of it.
        server.abort();
        let _ = server.await;
        let cached = source
            .checkout(
                &acme(),
                &pr(&format!("{url}#stacks/web")),
                &pv(&first),
                &out.path().join("c"),
            )
            .await
            .unwrap();
        assert_eq!(cached.commit, first);
        let err = source
            .checkout(
                &globex(),
                &pr(&format!("{url}#stacks/web")),
                &pv(&first),
                &out.path().join("d"),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, SourceError::Repository { reason, .. } if reason.contains("cannot clone")),
            "{err:?}"
        );
        assert_ne!(
            source.cache_path(&acme(), &url),
            source.cache_path(&globex(), &url)
        );
        assert!(!source.cache_path(&globex(), &url).exists());
    }

    /// Remote URLs outside the tenant's allowed prefixes are refused before any connection.
    #[tokio::test]
    async fn remote_urls_outside_the_allowed_prefixes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let source = GitProgramSource::new(
            dir.path().join("cache"),
            in_temp(&["https://git.example.com/{tenant}/"]),
        );
        for url in [
            "https://git.example.com/globex/infra.git",
            "http://169.254.169.254/latest/meta-data",
            "ssh://git.example.com/acme/infra.git",
            "https://git.example.com/acme/../globex/infra.git",
        ] {
            let err = source
                .checkout(&acme(), &pr(url), &pv("abcdef1"), &dir.path().join("x"))
                .await
                .unwrap_err();
            match &err {
                SourceError::Refused { reference, .. } => assert_eq!(reference, url),
                other => panic!("{url}: unexpected {other:?}"),
            }
            assert!(!source.cache_path(&acme(), url).exists());
        }
        let none = GitProgramSource::new(dir.path().join("cache"), in_temp(&[]));
        let err = none
            .checkout(
                &acme(),
                &pr("https://git.example.com/acme/infra.git"),
                &pv("abcdef1"),
                &dir.path().join("x"),
            )
            .await
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("FERRY_TENANT_PROGRAM_URL_PREFIXES: none configured"),
            "{err}"
        );
    }

    /// Local repositories must really be in the tenant's roots: not elsewhere, not through
    /// a link, not borrowing another repository's objects.
    #[tokio::test]
    async fn local_repositories_are_confined_to_the_program_roots() {
        let (repo, first, _) = repo();
        let roots = tempfile::tempdir().unwrap();
        std::fs::create_dir(roots.path().join("acme")).unwrap();
        std::fs::create_dir(roots.path().join("globex")).unwrap();
        let template = format!("{}/{{tenant}}", roots.path().display());
        let source =
            GitProgramSource::new(roots.path().join("cache"), rules(&[], &[template], &[]));
        let out = tempfile::tempdir().unwrap();
        let checkout = |tenant: TenantId, program: String, into: &'static str| {
            let source = source.clone();
            let (first, into) = (first.clone(), out.path().join(into));
            async move {
                source
                    .checkout(&tenant, &pr(&program), &pv(&first), &into)
                    .await
            }
        };
        // Outside every root.
        let outside = format!("{}#stacks/web", repo.path().display());
        let err = checkout(acme(), outside, "a").await.unwrap_err();
        assert!(
            err.to_string()
                .contains("outside this tenant's roots (FERRY_TENANT_PROGRAM_ROOTS"),
            "{err}"
        );
        let err = checkout(acme(), "/etc#".to_string(), "a")
            .await
            .unwrap_err();
        assert!(matches!(err, SourceError::Refused { .. }), "{err:?}");

        // In acme's root: acme reads it, globex does not.
        let acme_repo = roots.path().join("acme/infra");
        git(
            roots.path(),
            &[
                "clone",
                "-q",
                repo.path().to_str().unwrap(),
                acme_repo.to_str().unwrap(),
            ],
        );
        let ours = format!("{}#stacks/web", acme_repo.display());
        assert!(checkout(acme(), ours.clone(), "b").await.is_ok());
        let err = checkout(globex(), ours, "c").await.unwrap_err();
        assert!(matches!(err, SourceError::Refused { .. }), "{err:?}");

        #[cfg(unix)]
        {
            // A link in globex's root to acme's repository.
            let link = roots.path().join("globex/infra");
            std::os::unix::fs::symlink(&acme_repo, &link).unwrap();
            let err = checkout(globex(), format!("{}#stacks/web", link.display()), "d")
                .await
                .unwrap_err();
            assert!(
                err.to_string().contains("outside this tenant's roots"),
                "{err}"
            );
            // A repository in globex's root whose Git folder is a link into acme's.
            let sneaky = roots.path().join("globex/sneaky");
            std::fs::create_dir(&sneaky).unwrap();
            std::os::unix::fs::symlink(acme_repo.join(".git"), sneaky.join(".git")).unwrap();
            let err = checkout(globex(), format!("{}#stacks/web", sneaky.display()), "e")
                .await
                .unwrap_err();
            assert!(
                err.to_string().contains("outside this tenant's roots"),
                "{err}"
            );
        }

        // A repository in globex's root that borrows acme's objects.
        let borrower = roots.path().join("globex/borrower");
        git(roots.path(), &["init", "-q", borrower.to_str().unwrap()]);
        std::fs::write(
            borrower.join(".git/objects/info/alternates"),
            format!("{}\n", acme_repo.join(".git/objects").display()),
        )
        .unwrap();
        let err = checkout(globex(), format!("{}#stacks/web", borrower.display()), "f")
            .await
            .unwrap_err();
        assert!(err.to_string().contains("alternates"), "{err}");
    }

    /// No network here: an https remote must fail as a `Repository` error naming the URL
    /// (this build has no https transport; with one, the connection fails instead).
    #[tokio::test]
    async fn https_remote_failure_is_a_repository_error() {
        let dir = tempfile::tempdir().unwrap();
        let source =
            GitProgramSource::new(dir.path().join("cache"), in_temp(&["https://git.invalid/"]));
        let url = "https://git.invalid/infra.git";
        let err = source
            .checkout(
                &acme(),
                &pr(&format!("{url}#stacks/web")),
                &pv("abcdef1"),
                &dir.path().join("x"),
            )
            .await
            .unwrap_err();
        match err {
            SourceError::Repository { repository, reason } => {
                assert_eq!(repository, url);
                assert!(reason.contains("cannot clone"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            !source.cache_path(&acme(), url).exists(),
            "a failed clone leaves no cache"
        );
    }

    #[test]
    fn parses_references() {
        assert_eq!(split_program_ref("/r#a/b"), ("/r", "a/b"));
        assert_eq!(split_program_ref("/r"), ("/r", ""));
        assert_eq!(
            parse_location("file:///srv/r"),
            Location::Local("/srv/r".into())
        );
        assert_eq!(parse_location("./r"), Location::Local("./r".into()));
        assert_eq!(
            parse_location("https://git.example/infra.git"),
            Location::Remote("https://git.example/infra.git".into())
        );
        assert_eq!(normalise_folder("/stacks/web/").unwrap(), "stacks/web");
        assert_eq!(normalise_folder("").unwrap(), "");
        assert!(normalise_folder("a/../../b").is_err());
    }
}

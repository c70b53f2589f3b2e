//! Writing a Git tree into a checkout folder that it can never leave.
//!
//! A tenant's tree is hostile: it may hold the same name twice (a link, then a blob to be
//! written through it), names that differ only in case, `..` or `.git` entries, links that
//! are each harmless alone but climb out together (`a/l -> ..` then `x -> a/l/../..`),
//! absolute link targets, odd modes, and far more entries or bytes than a program needs.
//! Checking each link by itself, lexically, misses the combinations, so the checkout is
//! made in three steps:
//!
//! 1. The whole tree is read into a model first: names that are unsafe anywhere (`..`,
//!    `.git` in any case, separators), duplicates (exactly or after case folding), modes Git
//!    does not write, and trees that are too deep or too big are refused.
//! 2. Every link is resolved in the model as the kernel would resolve it (links through
//!    links, `..` after a link leaving from where the link led, case folded so that a
//!    case-insensitive disk cannot lead elsewhere); a link that leads, or passes, outside the
//!    checkout refuses the tree. Nothing has been written yet.
//! 3. Everything is written through a [`cap_std::fs::Dir`] opened on the checkout folder:
//!    every create, write and link is relative to that handle, which cannot name anything
//!    outside it (the kernel's `RESOLVE_BENEATH` on Linux), folders and files first, links
//!    last, so no write ever passes through a link. Files are created new (never opened
//!    through an existing name). Each link is then followed once more through the handle:
//!    one that cannot be followed inside refuses the checkout.
//!
//! A refusal names the entry (its path in the repository) and why; the plan fails with it.

use cap_std::fs::Dir;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The most entries (files, folders, links) one checkout may hold.
pub const MAX_ENTRIES: usize = 200_000;
/// The deepest folder nesting a checkout may hold.
pub const MAX_DEPTH: usize = 128;
/// The most bytes the files (and link targets) of one checkout may hold together.
pub const MAX_BYTES: u64 = 1024 * 1024 * 1024;
/// The longest link target (the kernel's own limit for a path).
const MAX_LINK_TARGET: usize = 4096;
/// How many links one resolution may pass through (Linux's own limit).
const MAX_HOPS: u32 = 40;
/// How many path components resolving every link of a tree may take together.
const MAX_STEPS: u64 = 10_000_000;

/// Why a tree cannot be checked out: the entry (its path in the repository) and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("entry {entry}: {reason}")]
pub struct EntryError {
    /// The entry's path in the repository (`.` for the tree as a whole).
    pub entry: String,
    /// Why.
    pub reason: String,
}

/// An entry of the model.
enum Node {
    Folder(Folder),
    File {
        id: gix::ObjectId,
        executable: bool,
    },
    Link(String),
    /// A submodule: its content is not in this repository, so nothing is written.
    Submodule,
}

/// A folder of the model: entries in tree order, found by their case-folded name.
#[derive(Default)]
struct Folder {
    entries: Vec<(String, Node)>,
    by_folded: HashMap<String, usize>,
}

impl Folder {
    /// The entry a (case-insensitive) lookup of `name` finds.
    fn get(&self, name: &str) -> Option<&(String, Node)> {
        self.by_folded
            .get(&fold(name))
            .map(|&index| &self.entries[index])
    }
}

/// The name as a case-insensitive file system compares it.
fn fold(name: &str) -> String {
    name.to_lowercase()
}

/// Reads `tree` and writes it into `into` (an existing, empty folder). `prefix` is the
/// tree's folder in the repository, for naming entries.
pub(crate) fn materialise(
    repo: &gix::Repository,
    tree: &gix::Tree<'_>,
    prefix: &str,
    into: &Path,
) -> Result<(), EntryError> {
    let name_of = |rel: &Path| entry_name(prefix, rel);
    let mut totals = Totals::default();
    let root = read_folder(repo, tree, Path::new(""), 0, &mut totals, &name_of)?;
    let mut budget = MAX_STEPS;
    check_links(&root, &root, &mut Vec::new(), &mut budget, &name_of)?;

    let dir =
        Dir::open_ambient_dir(into, cap_std::ambient_authority()).map_err(|e| EntryError {
            entry: name_of(Path::new("")),
            reason: format!("cannot open the checkout folder: {e}"),
        })?;
    let mut links = Vec::new();
    write_folder(repo, &dir, &root, Path::new(""), &mut links, &name_of)?;
    for (rel, target) in &links {
        let failed = |e: std::io::Error| EntryError {
            entry: name_of(rel),
            reason: format!("cannot write the link: {e}"),
        };
        write_link(&dir, rel, target).map_err(failed)?;
    }
    // The model said every link stays inside; the handle, following each link as the
    // kernel does, must agree. A link that leads nowhere (a missing or non-folder target)
    // is kept: following it fails inside the checkout, as Git would leave it.
    for (rel, _) in &links {
        if let Err(e) = dir.metadata(rel) {
            use std::io::ErrorKind::{NotADirectory, NotFound};
            if !matches!(e.kind(), NotFound | NotADirectory) {
                return Err(EntryError {
                    entry: name_of(rel),
                    reason: format!("the link cannot be followed inside the checkout: {e}"),
                });
            }
        }
    }
    Ok(())
}

/// The entry's path in the repository.
fn entry_name(prefix: &str, rel: &Path) -> String {
    let rel = rel.to_string_lossy();
    match (prefix.is_empty(), rel.is_empty()) {
        (true, true) => ".".to_string(),
        (true, false) => rel.into_owned(),
        (false, true) => prefix.to_string(),
        (false, false) => format!("{prefix}/{rel}"),
    }
}

#[derive(Default)]
struct Totals {
    entries: usize,
    bytes: u64,
}

/// Reads one tree of the repository into the model, refusing what cannot be written safely.
fn read_folder(
    repo: &gix::Repository,
    tree: &gix::Tree<'_>,
    rel: &Path,
    depth: usize,
    totals: &mut Totals,
    name_of: &dyn Fn(&Path) -> String,
) -> Result<Folder, EntryError> {
    use gix::object::tree::EntryKind;
    let refuse = |rel: &Path, reason: String| EntryError {
        entry: name_of(rel),
        reason,
    };
    if depth > MAX_DEPTH {
        return Err(refuse(
            rel,
            format!("folders are nested deeper than {MAX_DEPTH} levels"),
        ));
    }
    let mut folder = Folder::default();
    for entry in tree.iter() {
        let entry = entry.map_err(|e| refuse(rel, format!("cannot decode the tree: {e}")))?;
        let name = entry.filename().to_string();
        let path = rel.join(&name);
        check_name(&name).map_err(|reason| refuse(&path, reason.to_string()))?;
        totals.entries += 1;
        if totals.entries > MAX_ENTRIES {
            return Err(refuse(
                &path,
                format!("the program has more than {MAX_ENTRIES} entries"),
            ));
        }
        let folded = fold(&name);
        if let Some(&other) = folder.by_folded.get(&folded) {
            let other = &folder.entries[other].0;
            let reason = if *other == name {
                "the tree holds this name twice".to_string()
            } else {
                format!(
                    "the tree also holds {}, which differs only in case",
                    name_of(&rel.join(other))
                )
            };
            return Err(refuse(&path, reason));
        }
        let id = entry.object_id();
        let mode = entry.mode();
        let node = match mode.kind() {
            EntryKind::Tree => {
                let sub = repo
                    .find_tree(id)
                    .map_err(|e| refuse(&path, format!("cannot read the folder: {e}")))?;
                Node::Folder(read_folder(repo, &sub, &path, depth + 1, totals, name_of)?)
            }
            kind @ (EntryKind::Blob | EntryKind::BlobExecutable) => {
                let header = repo
                    .find_header(id)
                    .map_err(|e| refuse(&path, format!("cannot read the file: {e}")))?;
                if header.kind() != gix::object::Kind::Blob {
                    return Err(refuse(
                        &path,
                        format!("a file entry names a {}", header.kind()),
                    ));
                }
                add_bytes(totals, header.size())
                    .map_err(|reason| refuse(&path, reason.to_string()))?;
                Node::File {
                    id,
                    executable: kind == EntryKind::BlobExecutable,
                }
            }
            EntryKind::Link => {
                let blob = repo
                    .find_blob(id)
                    .map_err(|e| refuse(&path, format!("cannot read the link: {e}")))?;
                if blob.data.len() > MAX_LINK_TARGET {
                    return Err(refuse(
                        &path,
                        format!("the link's target is longer than {MAX_LINK_TARGET} bytes"),
                    ));
                }
                add_bytes(totals, blob.data.len() as u64)
                    .map_err(|reason| refuse(&path, reason.to_string()))?;
                let target = std::str::from_utf8(&blob.data)
                    .map_err(|_| refuse(&path, "the link's target is not UTF-8".to_string()))?;
                Node::Link(target.to_string())
            }
            // Git writes 160000 for a submodule; gix reads every other odd mode as one too,
            // and those are refused rather than silently left out.
            EntryKind::Commit if mode.value() == 0o160000 => {
                tracing::warn!(
                    submodule = %name_of(&path),
                    commit = %id,
                    "skipping a submodule: its content is not in this repository"
                );
                Node::Submodule
            }
            EntryKind::Commit => {
                return Err(refuse(
                    &path,
                    format!(
                        "mode {:o} is not a file, folder, link or submodule",
                        mode.value()
                    ),
                ))
            }
        };
        folder.by_folded.insert(folded, folder.entries.len());
        folder.entries.push((name, node));
    }
    Ok(folder)
}

/// The program's files and link targets passed [`MAX_BYTES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the program is larger than {MAX_BYTES} bytes")]
struct TooLarge;

fn add_bytes(totals: &mut Totals, bytes: u64) -> Result<(), TooLarge> {
    totals.bytes = totals.bytes.saturating_add(bytes);
    if totals.bytes > MAX_BYTES {
        return Err(TooLarge);
    }
    Ok(())
}

/// Why an entry's name is refused ([`check_name`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum BadName {
    /// Empty, `.` or `..`.
    #[error("{0:?} is not a name an entry may have")]
    NotAName(String),
    /// It would name something in another folder.
    #[error("the name holds a path separator or NUL")]
    Separator,
    /// `.git` (in any case).
    #[error("a .git entry is not part of a program")]
    GitFolder,
}

/// Refuses a name that could name something other than a new entry of its folder.
fn check_name(name: &str) -> Result<(), BadName> {
    if name.is_empty() || name == "." || name == ".." {
        return Err(BadName::NotAName(name.to_string()));
    }
    if name.contains(['/', '\\', '\0']) {
        return Err(BadName::Separator);
    }
    // `.git` in any case would be read as a repository on a case-insensitive disk.
    if name.eq_ignore_ascii_case(".git") {
        return Err(BadName::GitFolder);
    }
    Ok(())
}

/// Where a path led in the model: the deepest folder of the model it reached (real names
/// from the root), and how many names below it the model holds no folder for (a file, a
/// submodule, or nothing yet).
struct Led {
    folder: Vec<String>,
    beyond: usize,
}

/// Resolves every link of `folder` (at `at`) and below; refuses one that leads outside.
fn check_links(
    root: &Folder,
    folder: &Folder,
    at: &mut Vec<String>,
    budget: &mut u64,
    name_of: &dyn Fn(&Path) -> String,
) -> Result<(), EntryError> {
    for (name, node) in &folder.entries {
        match node {
            Node::Folder(sub) => {
                at.push(name.clone());
                check_links(root, sub, at, budget, name_of)?;
                at.pop();
            }
            Node::Link(target) => {
                let mut hops = 0;
                resolve(root, at.clone(), target, &mut hops, budget).map_err(|reason| {
                    let rel: PathBuf = at.iter().chain(std::iter::once(name)).collect();
                    EntryError {
                        entry: name_of(&rel),
                        reason: format!("the link to {target:?} {reason}"),
                    }
                })?;
            }
            Node::File { .. } | Node::Submodule => {}
        }
    }
    Ok(())
}

/// Why a link is refused; the text follows "the link to <target>".
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum BadLink {
    /// An empty target.
    #[error("is empty")]
    Empty,
    /// An absolute target.
    #[error("is absolute: it leads outside the checkout")]
    Absolute,
    /// The tree's links together take more than [`MAX_STEPS`] to follow.
    #[error("makes the tree's links too intricate to follow")]
    TooIntricate,
    /// `..` past the checkout's root.
    #[error("leads outside the checkout")]
    LeadsOutside,
    /// More than [`MAX_HOPS`] links in one resolution.
    #[error("passes through more than {MAX_HOPS} links")]
    TooManyHops,
}

/// Follows `target` from the folder `from` as the kernel would, through links of the
/// model; `Err` when it leads (or passes) outside the checkout.
fn resolve(
    root: &Folder,
    from: Vec<String>,
    target: &str,
    hops: &mut u32,
    budget: &mut u64,
) -> Result<Led, BadLink> {
    if target.is_empty() {
        return Err(BadLink::Empty);
    }
    if target.starts_with('/') {
        return Err(BadLink::Absolute);
    }
    let mut led = Led {
        folder: from,
        beyond: 0,
    };
    for part in target.split('/') {
        *budget = budget.checked_sub(1).ok_or(BadLink::TooIntricate)?;
        match part {
            "" | "." => {}
            // Past a name the model holds no folder for, the kernel would stop; the rest
            // is still followed as if an empty folder were there, so that the path stays
            // inside even if one appeared later.
            ".." if led.beyond > 0 => led.beyond -= 1,
            ".." => {
                if led.folder.pop().is_none() {
                    return Err(BadLink::LeadsOutside);
                }
            }
            _ if led.beyond > 0 => led.beyond += 1,
            name => match folder_at(root, &led.folder).and_then(|f| f.get(name)) {
                Some((real, Node::Folder(_))) => led.folder.push(real.clone()),
                Some((_, Node::Link(next))) => {
                    *hops += 1;
                    if *hops > MAX_HOPS {
                        return Err(BadLink::TooManyHops);
                    }
                    led = resolve(root, led.folder, next, hops, budget)?;
                }
                Some(_) | None => led.beyond = 1,
            },
        }
    }
    Ok(led)
}

/// The model's folder at `path` (real names), if it is one.
fn folder_at<'a>(root: &'a Folder, path: &[String]) -> Option<&'a Folder> {
    let mut folder = root;
    for name in path {
        match folder.get(name) {
            Some((_, Node::Folder(sub))) => folder = sub,
            _ => return None,
        }
    }
    Some(folder)
}

/// Writes the folders and files of the model through `dir`; collects the links for last.
fn write_folder(
    repo: &gix::Repository,
    dir: &Dir,
    folder: &Folder,
    rel: &Path,
    links: &mut Vec<(PathBuf, String)>,
    name_of: &dyn Fn(&Path) -> String,
) -> Result<(), EntryError> {
    for (name, node) in &folder.entries {
        let path = rel.join(name);
        let failed = |e: String| EntryError {
            entry: name_of(&path),
            reason: e,
        };
        match node {
            Node::Folder(sub) => {
                dir.create_dir(&path)
                    .map_err(|e| failed(format!("cannot create the folder: {e}")))?;
                write_folder(repo, dir, sub, &path, links, name_of)?;
            }
            Node::File { id, executable } => {
                let blob = repo
                    .find_blob(*id)
                    .map_err(|e| failed(format!("cannot read the file: {e}")))?;
                write_file(dir, &path, &blob.data, *executable)
                    .map_err(|e| failed(format!("cannot write the file: {e}")))?;
            }
            Node::Link(target) => links.push((path, target.clone())),
            Node::Submodule => {}
        }
    }
    Ok(())
}

/// Creates a new file (never an existing name, never through a link) and writes it.
fn write_file(dir: &Dir, path: &Path, data: &[u8], executable: bool) -> std::io::Result<()> {
    let mut options = cap_std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    let mut file = dir.open_with(path, &options)?.into_std();
    file.write_all(data)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // On the open file: the umask must not take the executable bit away, and no name
        // is looked up again.
        let mode = if executable { 0o755 } else { 0o644 };
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    }
    #[cfg(not(unix))]
    let _ = executable;
    Ok(())
}

#[cfg(unix)]
fn write_link(dir: &Dir, path: &Path, target: &str) -> std::io::Result<()> {
    dir.symlink(target, path)
}

#[cfg(not(unix))]
fn write_link(_dir: &Dir, path: &Path, _target: &str) -> std::io::Result<()> {
    tracing::warn!(link = %path.display(), "skipping a symbolic link: not supported here");
    Ok(())
}

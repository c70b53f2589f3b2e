//! Reading the program's files only through its checkout folder.
//!
//! A file of the program is opened through a [`cap_std::fs::Dir`] on the checkout folder,
//! which cannot name anything outside it: a `Pulumi.yaml` that is a link leading out of the
//! folder (alone or through other links) is refused before anything outside is looked up,
//! so what the runner answers ("no Pulumi.yaml", "does not parse", "not a mapping") never
//! depends on a path outside the program.

use cap_std::fs::Dir;
use ferry_domain::ports::runner::RunnerError;
use std::io::ErrorKind;
use std::path::Path;

/// The names Pulumi reads its project file from, in its order.
const PROJECT_FILES: [&str; 2] = ["Pulumi.yaml", "Pulumi.yml"];

fn invalid(reason: String) -> RunnerError {
    RunnerError::InvalidProgram(reason)
}

/// The text of the program's `Pulumi.yaml` (or `Pulumi.yml`), read inside `dir` only.
pub fn read_project_file(dir: &Path) -> Result<String, RunnerError> {
    let root = Dir::open_ambient_dir(dir, cap_std::ambient_authority()).map_err(|e| {
        invalid(format!(
            "cannot open the program folder {}: {e}",
            dir.display()
        ))
    })?;
    for name in PROJECT_FILES {
        // Followed inside the folder only; a link that leads out fails here whatever is
        // (or is not) at the place it names.
        let metadata = match root.metadata(name) {
            Ok(metadata) => metadata,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(invalid(format!(
                    "cannot read {name} inside the program folder: {e}"
                )))
            }
        };
        // A FIFO or a device would block or never end.
        if !metadata.is_file() {
            return Err(invalid(format!("{name} is not a regular file")));
        }
        return root
            .read_to_string(name)
            .map_err(|e| invalid(format!("cannot read {name} inside the program folder: {e}")));
    }
    Err(invalid(format!("no Pulumi.yaml in {}", dir.display())))
}

#[cfg(test)]
#[cfg(unix)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn reason(dir: &Path) -> String {
        match read_project_file(dir) {
            Err(RunnerError::InvalidProgram(reason)) => reason,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn reads_the_project_file_and_links_inside() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("real")).unwrap();
        std::fs::write(dir.path().join("real/project.yaml"), "name: p\n").unwrap();
        symlink("real/project.yaml", dir.path().join("Pulumi.yaml")).unwrap();
        assert_eq!(read_project_file(dir.path()).unwrap(), "name: p\n");

        let yml = tempfile::tempdir().unwrap();
        std::fs::write(yml.path().join("Pulumi.yml"), "name: q\n").unwrap();
        assert_eq!(read_project_file(yml.path()).unwrap(), "name: q\n");
        let none = tempfile::tempdir().unwrap();
        assert!(reason(none.path()).contains("no Pulumi.yaml"));
    }

    /// The chain: `a/b/c/d/l -> ../../../..` leads to the program folder, and
    /// `Pulumi.yaml -> a/b/c/d/l/../x` one above it, where another tenant's program is. The
    /// simulated runner must not load it, and whether `x` exists outside or not, and
    /// whatever it holds, the answer is the same refusal: no existence oracle.
    #[test]
    fn a_link_chain_out_of_the_folder_is_refused_the_same_whatever_is_outside() {
        use crate::simulated::program::Program;
        let load = |dir: &Path| match Program::load(dir) {
            Err(RunnerError::InvalidProgram(reason)) => reason,
            other => panic!("unexpected {other:?}"),
        };
        let base = tempfile::tempdir().unwrap();
        let program = base.path().join("program");
        std::fs::create_dir_all(program.join("a/b/c/d")).unwrap();
        symlink("../../../..", program.join("a/b/c/d/l")).unwrap();
        symlink("a/b/c/d/l/../outside.yaml", program.join("Pulumi.yaml")).unwrap();
        let outside = base.path().join("outside.yaml");
        std::fs::write(&outside, "name: acme-web\nruntime: yaml\n").unwrap();

        let present = load(&program);
        assert!(
            present.contains("cannot read Pulumi.yaml inside the program folder"),
            "{present}"
        );
        assert!(!present.contains("acme-web"), "{present}");
        // Not YAML, not a mapping, or missing: the same answer.
        for text in ["[1, 2]\n", "{{{"] {
            std::fs::write(&outside, text).unwrap();
            assert_eq!(load(&program), present);
        }
        std::fs::remove_file(&outside).unwrap();
        assert_eq!(load(&program), present);
        // An absolute link to a file that is there is refused too.
        std::fs::write(&outside, "name: acme-web\nruntime: yaml\n").unwrap();
        std::fs::remove_file(program.join("Pulumi.yaml")).unwrap();
        symlink(&outside, program.join("Pulumi.yaml")).unwrap();
        let absolute = load(&program);
        assert!(
            absolute.contains("cannot read Pulumi.yaml inside the program folder"),
            "{absolute}"
        );
    }
}

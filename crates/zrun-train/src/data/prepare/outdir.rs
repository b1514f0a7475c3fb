//! The output directory: what may be in it, and the one step that replaces a previous
//! prepare's output with this one's.
//!
//! The directory may be new, empty, or hold only what `zrun prepare` writes: `index.json`,
//! `train-NNNNN.bin`, `val-NNNNN.bin`, the older layout's `train.bin` and `val.bin`, and any of
//! those with `.tmp` (a killed run's). Anything else is refused before any work, so no user
//! file is ever deleted. At the end of a successful run, [`OutDir::commit`] puts the new
//! output in place in an order where a process killed at any point leaves a directory that
//! training either reads whole (the previous output, until the new index is renamed into
//! place; this run's from then on) or refuses, naming a shard and saying to prepare again
//! (training checks every shard's size and hash against the index, and refuses shard files
//! the index does not list): see [`OutDir::steps`].

use std::path::{Path, PathBuf};

use super::super::index::{is_shard_file, ShardIndex, INDEX_FILE};
use super::super::token_file::write_error;
use super::error::PrepareError;
use super::writer::tmp_name;

/// The output directory, checked.
#[derive(Debug)]
pub(super) struct OutDir {
    dir: PathBuf,
    /// A previous prepare's files (not `.tmp`), removed at commit.
    old: Vec<PathBuf>,
    /// This run created the directory: a run that fails removes it again (when empty).
    created: bool,
    /// The output is in place.
    committed: bool,
}

impl Drop for OutDir {
    fn drop(&mut self) {
        if self.created && !self.committed {
            // Only an empty directory goes: the temporary files were removed before.
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// Whether `name` is a file `zrun prepare` writes (module docs).
fn ours(name: &str) -> bool {
    let base = name.strip_suffix(".tmp").unwrap_or(name);
    [INDEX_FILE, "train.bin", "val.bin"].contains(&base) || is_shard_file(base)
}

impl OutDir {
    /// Creates `dir` if missing, refuses it when it holds anything `zrun prepare` does not
    /// write, and removes a killed run's `.tmp` files.
    pub(super) fn open(dir: &Path) -> Result<OutDir, PrepareError> {
        if dir.exists() && !dir.is_dir() {
            return Err(PrepareError::Flag {
                flag: "-o",
                value: dir.display().to_string(),
                requirement: "it is a file; give a directory: a new one, or one zrun prepare \
                              wrote",
            });
        }
        let created = !dir.exists();
        std::fs::create_dir_all(dir).map_err(write_error(dir, "create directory"))?;
        let mut old = Vec::new();
        let mut names: Vec<(String, PathBuf, bool)> = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(write_error(dir, "list directory"))? {
            let entry = entry.map_err(write_error(dir, "list directory"))?;
            let file = entry.file_type().is_ok_and(|t| t.is_file());
            names.push((
                entry.file_name().to_string_lossy().into_owned(),
                entry.path(),
                file,
            ));
        }
        names.sort();
        if let Some((name, _, _)) = names.iter().find(|(n, _, file)| !(*file && ours(n))) {
            return Err(PrepareError::Foreign {
                dir: dir.to_path_buf(),
                name: name.clone(),
            });
        }
        for (name, path, _) in names {
            if name.ends_with(".tmp") {
                std::fs::remove_file(&path).map_err(write_error(&path, "remove the old"))?;
            } else {
                old.push(path);
            }
        }
        Ok(OutDir {
            dir: dir.to_path_buf(),
            old,
            created,
            committed: false,
        })
    }

    /// The directory.
    pub(super) fn path(&self) -> &Path {
        &self.dir
    }

    /// Replaces the previous output with the shards of `index` (written as `NAME.tmp`) and
    /// writes the index; returns its path. The new index is written (synced, as
    /// `index.json.tmp`) before anything of the previous output goes: a disk that runs out of
    /// room fails there, with the previous output whole and this run's files removed.
    pub(super) fn commit(&mut self, index: &ShardIndex) -> Result<PathBuf, PrepareError> {
        let staged = index.write_staged(&self.dir)?;
        // Whatever happens now, the directory holds this run's or a previous run's files:
        // removes and renames need no room.
        self.committed = true;
        for step in self.steps(index, &staged) {
            step.run()?;
        }
        Ok(self.dir.join(INDEX_FILE))
    }

    /// The steps that put the shards of `index` (written as `NAME.tmp`) and the staged index
    /// in place of the previous output, in this order:
    ///
    /// 1. the previous shards that `index` does not list are removed, then this run's shards
    ///    are renamed into place (over the previous ones of the same name); meanwhile the
    ///    previous index, still in place, names a shard that is missing or whose size or
    ///    hash differs, and training refuses the directory naming it;
    /// 2. the directory is synced and the staged index renamed to `index.json`: the one step
    ///    at which this run's output appears, whole (no unlisted shard is left);
    /// 3. the older layout's `train.bin` and `val.bin` are removed (a directory with an
    ///    `index.json` is read by it, so until then they were the previous output, usable).
    ///
    /// The previous `index.json` is never removed, only replaced by the rename, so the
    /// directory is never without one while a shard directory is being replaced.
    pub(super) fn steps(&mut self, index: &ShardIndex, staged: &Path) -> Vec<Step> {
        let index_path = self.dir.join(INDEX_FILE);
        let new: Vec<PathBuf> = index
            .train
            .iter()
            .chain(&index.val)
            .map(|s| self.dir.join(&s.file))
            .collect();
        let replaced: std::collections::HashSet<&PathBuf> = new.iter().collect();
        let old = std::mem::take(&mut self.old);
        let is_shard = |p: &PathBuf| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(is_shard_file)
        };
        let mut steps: Vec<Step> = old
            .iter()
            .filter(|p| is_shard(p) && !replaced.contains(p))
            .map(|p| Step::Remove(p.clone()))
            .collect();
        for to in &new {
            let name = to.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            steps.push(Step::Rename(self.dir.join(tmp_name(name)), to.clone()));
        }
        steps.push(Step::Sync(self.dir.clone()));
        steps.push(Step::Rename(staged.to_path_buf(), index_path.clone()));
        steps.extend(
            old.into_iter()
                .filter(|p| !is_shard(p) && p != &index_path)
                .map(Step::Remove),
        );
        // The renames and the index reach the disk together with the directory's entries.
        steps.push(Step::Sync(self.dir.clone()));
        steps
    }
}

/// One file-system step of [`OutDir::commit`].
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Step {
    /// Remove a file of the previous output.
    Remove(PathBuf),
    /// Rename a finished file (`from`) into place (`to`).
    Rename(PathBuf, PathBuf),
    /// fsync the directory, so the steps before it reach the disk before those after it (a
    /// failure only costs that ordering, and is not reported).
    Sync(PathBuf),
}

impl Step {
    /// Takes the step.
    pub(super) fn run(&self) -> Result<(), PrepareError> {
        match self {
            Step::Remove(p) => std::fs::remove_file(p).map_err(write_error(p, "remove the old"))?,
            Step::Rename(from, to) => {
                std::fs::rename(from, to).map_err(write_error(to, "rename into place"))?
            }
            Step::Sync(dir) => {
                if let Ok(d) = std::fs::File::open(dir) {
                    let _ = d.sync_all();
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_prepares_own_files_may_be_replaced() {
        for name in [
            "index.json",
            "index.json.tmp",
            "train-00000.bin",
            "val-123456.bin.tmp",
            "train.bin",
            "val.bin.tmp",
        ] {
            assert!(ours(name), "{name}");
        }
        for name in [
            "train-0.bin",
            "notes.txt",
            "train-00000.bin.bak",
            "tokenizer.json",
        ] {
            assert!(!ours(name), "{name}");
        }
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("train.bin"), b"old").unwrap();
        std::fs::write(d.path().join("train-00003.bin.tmp"), b"killed").unwrap();
        let out = OutDir::open(d.path()).unwrap();
        assert_eq!(out.old, [d.path().join("train.bin")]);
        assert!(!d.path().join("train-00003.bin.tmp").exists());
        let file = d.path().join("notes.txt");
        std::fs::write(&file, b"mine").unwrap();
        let e = OutDir::open(&file).unwrap_err().to_string();
        assert!(e.contains("-o ") && e.contains("it is a file"), "{e}");
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        let e = OutDir::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("\"sub\"") && e.contains("-o "), "{e}");
        assert!(d.path().join("train.bin").exists(), "nothing is removed");
    }
}

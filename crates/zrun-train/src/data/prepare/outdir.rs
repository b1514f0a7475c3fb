//! The output directory: what may be in it, and the one step that replaces a previous
//! prepare's output with this one's.
//!
//! The directory may be new, empty, or hold only what `zrun prepare` writes: `index.json`,
//! `train-NNNNN.bin`, `val-NNNNN.bin`, the older layout's `train.bin` and `val.bin`, and any of
//! those with `.tmp` (a killed run's). Anything else is refused before any work, so no user
//! file is ever deleted. At the end of a successful run, [`OutDir::commit`] removes the old
//! index first (so no index ever names a mix of old and new shards), then the old shards,
//! renames the new ones from `NAME.tmp` into place and writes the new index last.

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
        let index_path = self.dir.join(INDEX_FILE);
        let staged = index.write_staged(&self.dir)?;
        // Whatever happens now, the directory holds this run's or a previous run's files:
        // removes and renames need no room.
        self.committed = true;
        let mut old = std::mem::take(&mut self.old);
        old.sort_by_key(|p| p != &index_path);
        for p in &old {
            std::fs::remove_file(p).map_err(write_error(p, "remove the old"))?;
        }
        for s in index.train.iter().chain(&index.val) {
            let to = self.dir.join(&s.file);
            std::fs::rename(self.dir.join(tmp_name(&s.file)), &to)
                .map_err(write_error(&to, "rename into place"))?;
        }
        std::fs::rename(&staged, &index_path)
            .map_err(write_error(&index_path, "rename into place"))?;
        // The renames and the index reach the disk together with the directory's entries.
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(index_path)
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

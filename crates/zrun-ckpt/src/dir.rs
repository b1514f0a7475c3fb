//! The checkpoint directory: `step-00000500/` per complete checkpoint, `step-00000500.tmp/`
//! while one is being written.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The manifest's file name; its presence makes a checkpoint complete.
pub const MANIFEST: &str = "manifest.json";
const PREFIX: &str = "step-";
const TMP: &str = ".tmp";

/// `dir/step-00000500`: where the checkpoint of `step` lives once complete.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{step:08}"))
}

/// `dir/step-00000500.tmp`: where it is written.
pub fn tmp_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{step:08}{TMP}"))
}

/// The step of a `step-NNNNNNNN` name (without `.tmp`).
fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(PREFIX)?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The entries of `dir` (name, path); none when `dir` does not exist.
fn entries(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let listed = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            return Err(Error::Format {
                dir: dir.to_path_buf(),
                detail: "a file, not a directory; give a checkpoint directory such as runs/x/ckpt/step-00000500, or a checkpoint.dir for its newest checkpoint".into(),
            })
        }
        Err(e) => return Err(Error::io("list", dir, e)),
    };
    listed
        .map(|e| {
            let e = e.map_err(|err| Error::io("list", dir, err))?;
            Ok((e.file_name().to_string_lossy().into_owned(), e.path()))
        })
        .collect()
}

/// The complete checkpoints in `dir` (those with a manifest), oldest first; none when `dir`
/// does not exist.
pub fn complete(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out: Vec<(u64, PathBuf)> = entries(dir)?
        .into_iter()
        .filter_map(|(name, path)| step_of(&name).map(|step| (step, path)))
        .filter(|(_, path)| path.join(MANIFEST).is_file())
        .collect();
    out.sort();
    Ok(out)
}

/// Removes what interrupted saves left in `dir`: `step-*.tmp` directories, and step
/// directories without a manifest (an interrupted deletion). Returns what it removed.
pub fn remove_leftovers(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for (name, path) in entries(dir)? {
        let leftover = match name.strip_suffix(TMP) {
            Some(base) => step_of(base).is_some(),
            None => step_of(&name).is_some() && !path.join(MANIFEST).exists(),
        };
        if leftover && path.is_dir() {
            std::fs::remove_dir_all(&path).map_err(|e| Error::io("remove", &path, e))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// Refuses an output path `out` that lies inside the checkpoint directory `dir`, or is `dir`
/// itself: a file written there would replace the checkpoint's own files (its manifest, a
/// rank file) or add a foreign one. Both paths are compared with links resolved; `out` need
/// not exist yet (nor its parents: the part that does not exist is taken as written). A `dir`
/// that does not resolve holds nothing to protect: opening it reports why.
pub fn refuse_inside(dir: &Path, out: &Path) -> Result<()> {
    let Ok(dir_real) = dir.canonicalize() else {
        return Ok(());
    };
    if resolved(out).starts_with(&dir_real) {
        return Err(Error::Output {
            path: out.to_path_buf(),
            detail: format!(
                "inside the checkpoint directory {}, whose files it would replace or add to; write it outside the checkpoint",
                dir.display()
            ),
        });
    }
    Ok(())
}

/// `path` made absolute with links resolved, one component at a time as far as it exists; a
/// part that does not exist is taken as written (`..` then steps back over it).
fn resolved(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = if path.is_absolute() {
        PathBuf::from("/")
    } else {
        Path::new(".").canonicalize().unwrap_or_default()
    };
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(name) => {
                let next = out.join(name);
                // Links are followed: through a directory link the write lands at its target
                // (a link as the last name, which a rename would replace, is judged by its
                // target too: refused rather than guessed).
                out = next.canonicalize().unwrap_or(next);
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// A file opened for reading by [`open_regular`], or why there is none to read.
pub enum Opened {
    /// A regular file, and its length in bytes.
    File(std::fs::File, u64),
    /// Nothing at the path.
    Missing,
    /// Something else: "a directory", "a FIFO", "a socket" or "a device".
    NotRegular(&'static str),
}

/// Opens `path` for reading without blocking, then looks at what was opened: a FIFO in place
/// of a checkpoint's file would otherwise block its reader forever (a FIFO's open waits for a
/// writer), and a directory or a device has no bytes of a checkpoint. `O_NONBLOCK` changes
/// nothing for a regular file's reads. Other errors of the open or the stat are returned.
pub fn open_regular(path: &Path) -> std::io::Result<Opened> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Opened::Missing),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    let kind = meta.file_type();
    Ok(if kind.is_file() {
        Opened::File(file, meta.len())
    } else if kind.is_dir() {
        Opened::NotRegular("a directory")
    } else if kind.is_fifo() {
        Opened::NotRegular("a FIFO")
    } else if kind.is_socket() {
        Opened::NotRegular("a socket")
    } else {
        Opened::NotRegular("a device")
    })
}

/// fsyncs a directory, so a rename or removal inside it is durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io("sync", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_complete_checkpoints_and_removes_leftovers() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path();
        assert!(complete(&d.join("absent")).unwrap().is_empty());
        for (step, manifest) in [(20u64, true), (5, true), (100, false)] {
            let s = step_dir(d, step);
            std::fs::create_dir_all(&s).unwrap();
            if manifest {
                std::fs::write(s.join(MANIFEST), b"{}").unwrap();
            }
        }
        std::fs::create_dir_all(tmp_dir(d, 30)).unwrap();
        std::fs::create_dir_all(d.join("notes")).unwrap();
        std::fs::create_dir_all(d.join("step-12x")).unwrap();
        let found = complete(d).unwrap();
        assert_eq!(
            found.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![5, 20]
        );
        assert_eq!(found[1].1, d.join("step-00000020"));
        let removed = remove_leftovers(d).unwrap();
        assert_eq!(removed.len(), 2, "{removed:?}");
        assert!(!tmp_dir(d, 30).exists() && !step_dir(d, 100).exists());
        assert!(d.join("notes").exists() && d.join("step-12x").exists());
        assert!(step_dir(d, 5).exists());
    }

    #[test]
    fn an_output_inside_the_checkpoint_is_refused_however_it_is_spelled() {
        let root = tempfile::tempdir().unwrap();
        let ckpt = root.path().join("step-00000006");
        std::fs::create_dir_all(&ckpt).unwrap();
        std::fs::write(ckpt.join(MANIFEST), b"{}").unwrap();
        std::os::unix::fs::symlink(&ckpt, root.path().join("link")).unwrap();
        let r = root.path();
        for out in [
            ckpt.join(MANIFEST),
            ckpt.join("rank-00000.safetensors"),
            ckpt.clone(),
            ckpt.join("new/deeper/model.safetensors"),
            r.join("elsewhere/../step-00000006/model.safetensors"),
            r.join("link/model.safetensors"),
            r.join("./link/./x"),
        ] {
            let e = refuse_inside(&ckpt, &out).unwrap_err();
            assert!(
                matches!(e, Error::Output { .. }),
                "{}: {e:?}",
                out.display()
            );
            assert!(
                e.to_string().contains("inside the checkpoint directory"),
                "{e}"
            );
            assert!(e.is_bad_input());
        }
        for out in [
            r.join("model.safetensors"),
            r.join("step-00000006.safetensors"),
            r.join("step-00000006x/model.safetensors"),
            r.join("step-00000006/../model.safetensors"),
            r.join("absent/dir/model.safetensors"),
        ] {
            refuse_inside(&ckpt, &out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
        }
    }

    #[test]
    fn open_regular_refuses_a_fifo_and_a_directory_without_blocking() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path();
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path for the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(matches!(
            open_regular(&fifo).unwrap(),
            Opened::NotRegular("a FIFO")
        ));
        assert!(matches!(
            open_regular(d).unwrap(),
            Opened::NotRegular("a directory")
        ));
        assert!(matches!(
            open_regular(&d.join("absent")).unwrap(),
            Opened::Missing
        ));
        std::fs::write(d.join("f"), b"abc").unwrap();
        assert!(matches!(
            open_regular(&d.join("f")).unwrap(),
            Opened::File(_, 3)
        ));
    }

    #[test]
    fn a_file_given_as_a_directory_is_not_a_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("train.toml");
        std::fs::write(&file, b"[model]").unwrap();
        let e = complete(&file).unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{e:?}");
        assert!(e.to_string().contains("a file, not a directory"), "{e}");
    }
}

//! Writing the charts: all or none. Every chart, drawn in memory, goes to a temporary file
//! beside its final name (`.loss.png.PID.tmp`), synced; only when every one is complete are
//! they renamed into place. A full disk, a read-only directory or a file-size limit leaves
//! each chart name holding the previous run's complete chart, and no temporary behind.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::launch::BadInput;

/// Creates the output directory `dir` (and its parents); an error says what to do, -o
/// included (the default, RUN_DIR/plots, may be on a disk the runs were copied to read-only).
pub fn create_dir(dir: &Path) -> Result<(), BadInput> {
    std::fs::create_dir_all(dir).map_err(|e| {
        BadInput(format!(
            "cannot create the output directory {}: {e}: {}",
            dir.display(),
            hint(&e)
        ))
    })
}

/// Writes each `(path, bytes)` to a temporary file in its directory, then renames them all
/// into place. On a failure, the temporaries written so far are removed and no chart is
/// replaced (unless a rename itself fails, which leaves the earlier ones renamed).
pub fn all(files: &[(PathBuf, Vec<u8>)]) -> Result<(), BadInput> {
    // A directory where a chart goes would fail its rename after others had been replaced.
    for (path, _) in files {
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
            return Err(BadInput(format!(
                "cannot write {}: it is a directory; move it away or give -o DIR to write the \
                 charts elsewhere",
                path.display()
            )));
        }
    }
    let mut temps: Vec<PathBuf> = Vec::with_capacity(files.len());
    for (path, bytes) in files {
        let tmp = temp(path);
        if let Err(e) = write_synced(&tmp, bytes) {
            temps.push(tmp);
            remove(&temps);
            return Err(unwritable(path, &e));
        }
        temps.push(tmp);
    }
    for (i, ((path, _), tmp)) in files.iter().zip(&temps).enumerate() {
        if let Err(e) = std::fs::rename(tmp, path) {
            remove(&temps[i..]);
            return Err(unwritable(path, &e));
        }
    }
    Ok(())
}

/// The temporary file `path` is written to first: hidden, beside it, this process's own.
fn temp(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Creates (or truncates) `path`, writes `bytes` and syncs them to the disk, so that a disk
/// that fills up on the flush fails here rather than after the rename.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Removes the temporaries `paths` (those never created are no error).
fn remove(paths: &[PathBuf]) {
    for p in paths {
        let _ = std::fs::remove_file(p);
    }
}

/// One line: which chart, the OS's error, what to do.
fn unwritable(path: &Path, e: &std::io::Error) -> BadInput {
    BadInput(format!("cannot write {}: {e}: {}", path.display(), hint(e)))
}

/// The cause of `e` in words and what to do, -o included where another directory helps.
fn hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
            "the disk is full; free space or give -o a directory on another disk"
        }
        Some(libc::EFBIG) => "a file-size limit was hit; raise it (ulimit -f)",
        Some(libc::EROFS) => {
            "the file system is read-only; give -o DIR to write the charts elsewhere"
        }
        Some(libc::EACCES) | Some(libc::EPERM) => {
            "permission denied; make it writable or give -o DIR to write the charts elsewhere"
        }
        Some(libc::EEXIST) | Some(libc::ENOTDIR) => {
            "a file is in the way; move it away or give -o DIR to write the charts elsewhere"
        }
        _ => "check the path and the disk, or give -o DIR to write the charts elsewhere",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plot_errors_say_what_to_do() {
        let e = |n| std::io::Error::from_raw_os_error(n);
        let full = unwritable(Path::new("o/loss.png"), &e(libc::ENOSPC)).0;
        assert!(full.starts_with("cannot write o/loss.png: No space left on device (os error 28)"));
        assert!(
            full.ends_with("the disk is full; free space or give -o a directory on another disk")
        );
        let file = tempfile::NamedTempFile::new().unwrap();
        let under = file.path().join("plots");
        let msg = create_dir(&under).unwrap_err().0;
        let want = format!("cannot create the output directory {}: ", under.display());
        assert!(msg.starts_with(&want), "{msg}");
        assert!(
            msg.ends_with("move it away or give -o DIR to write the charts elsewhere"),
            "{msg}"
        );
        assert!(hint(&e(libc::EFBIG)).contains("ulimit -f"));
        assert_eq!(
            temp(Path::new("o/loss.png")),
            PathBuf::from(format!("o/.loss.png.{}.tmp", std::process::id()))
        );
    }
}

//! A test's scratch directory, shared by the workspace's test harnesses (`#[path]`-included):
//! removed when the test passes, kept (and named on stderr) when it fails, so a run leaves
//! nothing behind but what a failure needs.

use std::path::{Path, PathBuf};

/// Dereferences to the directory's path.
pub struct Scratch(PathBuf);

impl Scratch {
    /// `dir`, emptied or created.
    pub fn fresh(dir: PathBuf) -> Scratch {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("scratch directory kept: {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

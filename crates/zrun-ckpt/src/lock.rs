//! Who owns a checkpoint directory: the run writing into it holds `.zrun-lock` there while it
//! runs, so that a second job on the same `checkpoint.dir` cannot delete the first's save in
//! flight, prune its checkpoints or collide with its step directories.
//!
//! Two mechanisms, because shared file systems honour them unevenly:
//! - an exclusive `flock` on the file, held while the run lives and released by the kernel
//!   when its process dies (however it dies); it is exact on one host and on file systems
//!   that carry locks between hosts (NFSv4, Lustre with `flock`);
//! - a lease in the file's contents (run id, host, pid, when it was last refreshed), renewed
//!   by a thread every [`REFRESH`]: where locks do not cross hosts, a live run on another
//!   host still shows as a fresh lease, and a lease not renewed for [`LEASE`] is taken over.
//!
//! The same run (a restart, with the same run id) may take over its own lease at once.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The lock file's name inside the checkpoint directory.
pub const LOCK_FILE: &str = ".zrun-lock";
/// A lease not renewed for this long is taken to belong to a dead run.
pub const LEASE: Duration = Duration::from_secs(60);
/// How often the holder renews its lease.
pub const REFRESH: Duration = Duration::from_secs(10);

/// What the lock file says of its holder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockOwner {
    /// The run id.
    pub run_id: String,
    /// The host of the holding process.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// When the lease was last renewed, in seconds since the Unix epoch.
    #[serde(default)]
    pub refreshed: u64,
}

impl LockOwner {
    /// This process, holding for run `run_id`.
    pub fn this_process(run_id: &str) -> LockOwner {
        LockOwner {
            run_id: run_id.to_string(),
            host: hostname(),
            pid: std::process::id(),
            refreshed: now(),
        }
    }

    fn describe(&self) -> String {
        format!(
            "run {} (pid {} on {}, lease renewed {} s ago)",
            self.run_id,
            self.pid,
            self.host,
            now().saturating_sub(self.refreshed)
        )
    }
}

/// How an acquired lock came to be ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acquired {
    /// Nobody held it (or its holder had released it cleanly).
    Free,
    /// The previous holder's process is gone (its flock was released): its lease is void.
    FromDead(LockOwner),
    /// The previous holder, on another host, stopped renewing its lease long ago.
    FromExpired(LockOwner),
    /// An earlier attempt of this same run held it.
    FromSameRun(LockOwner),
}

/// A held checkpoint directory; released (file removed, flock dropped) on drop.
pub struct DirLock {
    path: PathBuf,
    /// Keeps the flock (it lives as long as the open file).
    file: Arc<Mutex<File>>,
    owner: LockOwner,
    stop: Arc<(Mutex<bool>, Condvar)>,
    renewer: Option<JoinHandle<()>>,
    /// Whether the flock could be taken at all (false: the file system refuses locks).
    pub flocked: bool,
    /// How the lock was obtained.
    pub acquired: Acquired,
}

impl std::fmt::Debug for DirLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirLock")
            .field("path", &self.path)
            .field("owner", &self.owner)
            .field("acquired", &self.acquired)
            .finish()
    }
}

/// The host name of this machine.
pub fn hostname() -> String {
    let mut name = [0u8; 256];
    // SAFETY: the buffer is writable for its full length; gethostname NUL-terminates within it
    // (or truncates, which the search for NUL below handles).
    let rc = unsafe { libc::gethostname(name.as_mut_ptr() as *mut libc::c_char, name.len()) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    String::from_utf8_lossy(&name[..end]).into_owned()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Tries the exclusive flock; `Ok(false)` when another open file holds it, `Err` when the
/// file system does not do locks.
fn try_flock(f: &File) -> std::io::Result<bool> {
    // SAFETY: the fd is open for the call; flock has no memory-safety preconditions.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        _ => Err(e),
    }
}

fn read_owner(f: &mut File) -> Option<LockOwner> {
    let mut text = String::new();
    f.seek(SeekFrom::Start(0)).ok()?;
    // A lock file is a few hundred bytes; more is not ours to parse.
    f.take(64 << 10).read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

fn write_owner(f: &mut File, owner: &LockOwner) -> std::io::Result<()> {
    let json = serde_json::to_vec(owner).map_err(std::io::Error::other)?;
    f.set_len(0)?;
    f.seek(SeekFrom::Start(0))?;
    f.write_all(&json)?;
    f.sync_data()
}

impl DirLock {
    /// Takes `dir` (created if needed) for `owner`'s run, or fails with
    /// [`Error::Held`] naming the live run that holds it.
    pub fn acquire(dir: &Path, owner: LockOwner) -> Result<DirLock> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io("open", &path, e))?;
        let held = |holder: LockOwner| Error::Held {
            dir: dir.to_path_buf(),
            holder: holder.describe(),
        };
        let flocked = match try_flock(&file) {
            Ok(true) => true,
            Ok(false) => {
                // A live process holds it: unless it is an earlier attempt of this run (which
                // a restart has just replaced), it is another job.
                let holder = read_owner(&mut file).unwrap_or(LockOwner {
                    run_id: "(unknown)".into(),
                    host: "(unknown)".into(),
                    pid: 0,
                    refreshed: 0,
                });
                return Err(held(holder));
            }
            Err(e) => {
                tracing::warn!(
                    "{}: the file system refuses locks ({e}); relying on the lease alone",
                    path.display()
                );
                false
            }
        };
        let previous = read_owner(&mut file);
        let acquired = match previous {
            None => Acquired::Free,
            Some(p) if p.run_id == owner.run_id => Acquired::FromSameRun(p),
            // On this host a released flock means the holder is gone, whatever its lease says.
            Some(p) if p.host == owner.host && flocked => Acquired::FromDead(p),
            Some(p) if now().saturating_sub(p.refreshed) >= LEASE.as_secs() => {
                Acquired::FromExpired(p)
            }
            Some(p) => return Err(held(p)),
        };
        let mut owner = owner;
        owner.refreshed = now();
        write_owner(&mut file, &owner).map_err(|e| Error::io("write", &path, e))?;
        let file = Arc::new(Mutex::new(file));
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let renewer = {
            let (file, stop, owner, path) =
                (file.clone(), stop.clone(), owner.clone(), path.clone());
            std::thread::Builder::new()
                .name("zrun-ckpt-lease".into())
                .spawn(move || renew(&file, &stop, owner, &path))
                .map_err(|e| Error::io("start the lease renewer for", dir, e))?
        };
        Ok(DirLock {
            path,
            file,
            owner,
            stop,
            renewer: Some(renewer),
            flocked,
            acquired,
        })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Renews the lease every [`REFRESH`] until told to stop.
fn renew(file: &Mutex<File>, stop: &(Mutex<bool>, Condvar), mut owner: LockOwner, path: &Path) {
    let (lock, cv) = stop;
    let mut stopped = lock.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        // Checked before every wait: a stop may come before this thread first waits.
        if *stopped {
            return;
        }
        stopped = cv
            .wait_timeout(stopped, REFRESH)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        if *stopped {
            return;
        }
        owner.refreshed = now();
        let mut f = file.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = write_owner(&mut f, &owner) {
            tracing::warn!("cannot renew the lease in {}: {e}", path.display());
        }
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        {
            let (lock, cv) = &*self.stop;
            *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
            cv.notify_all();
        }
        if let Some(h) = self.renewer.take() {
            let _ = h.join();
        }
        // Remove the file only while it still names this process (another run may have
        // taken an expired lease over).
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if read_owner(&mut f)
            .is_some_and(|o| o.run_id == self.owner.run_id && o.pid == self.owner.pid)
        {
            let _ = std::fs::remove_file(&self.path);
        }
        // The flock goes with the file descriptor.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(run: &str, host: &str, refreshed: u64) -> LockOwner {
        LockOwner {
            run_id: run.into(),
            host: host.into(),
            pid: 4242,
            refreshed,
        }
    }

    #[test]
    fn a_held_directory_is_refused_and_free_again_after_release() {
        let d = tempfile::tempdir().unwrap();
        let a = DirLock::acquire(d.path(), LockOwner::this_process("run-a")).unwrap();
        assert_eq!(a.acquired, Acquired::Free);
        assert!(a.flocked);
        let e = DirLock::acquire(d.path(), LockOwner::this_process("run-b")).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("run run-a") && msg.contains("is in use"),
            "{msg}"
        );
        drop(a);
        assert!(!d.path().join(LOCK_FILE).exists());
        let b = DirLock::acquire(d.path(), LockOwner::this_process("run-b")).unwrap();
        assert_eq!(b.acquired, Acquired::Free);
    }

    #[test]
    fn leases_left_behind_are_taken_over_by_rule() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join(LOCK_FILE);
        let me = hostname();
        let put = |o: &LockOwner| std::fs::write(&file, serde_json::to_vec(o).unwrap()).unwrap();
        // This host, no flock: the holder died.
        put(&owner("dead", &me, now()));
        let l = DirLock::acquire(d.path(), LockOwner::this_process("x")).unwrap();
        assert!(matches!(l.acquired, Acquired::FromDead(ref o) if o.run_id == "dead"));
        drop(l);
        // Another host, a fresh lease: a live run there.
        put(&owner("remote", "other-host", now()));
        let e = DirLock::acquire(d.path(), LockOwner::this_process("x")).unwrap_err();
        assert!(
            e.to_string().contains("run remote (pid 4242 on other-host"),
            "{e}"
        );
        // The same run restarted elsewhere takes its own lease.
        let l = DirLock::acquire(d.path(), LockOwner::this_process("remote")).unwrap();
        assert!(matches!(l.acquired, Acquired::FromSameRun(_)));
        drop(l);
        // Another host, a lease not renewed for longer than LEASE: taken over.
        put(&owner("gone", "other-host", now() - LEASE.as_secs() - 1));
        let l = DirLock::acquire(d.path(), LockOwner::this_process("x")).unwrap();
        assert!(matches!(l.acquired, Acquired::FromExpired(_)));
        let o: LockOwner = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        assert_eq!(o.run_id, "x");
    }
}

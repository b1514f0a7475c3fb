//! Stop requests to a rank: SIGTERM or SIGUSR1 (what Slurm and most schedulers send before
//! they end a job) are recorded here and acted on at the next step boundary, where every
//! rank learns whether any rank got one, so they all save the same step and stop.

use std::sync::atomic::{AtomicI32, Ordering};

/// The last stop signal received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only a lock-free atomic store: async-signal-safe.
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Records SIGTERM and SIGUSR1 instead of dying of them, and ignores SIGXFSZ, so that a
/// file-size limit hit while writing a checkpoint is a write error that can be reported.
pub fn install() -> std::io::Result<()> {
    catch(libc::SIGTERM, on_signal)?;
    catch(libc::SIGUSR1, on_signal)?;
    set_action(libc::SIGXFSZ, libc::SIG_IGN)
}

/// Makes `handler` run on signal `sig` (interrupted system calls restart). The handler must
/// only do async-signal-safe things, such as storing to atomics.
pub fn catch(sig: libc::c_int, handler: extern "C" fn(libc::c_int)) -> std::io::Result<()> {
    set_action(sig, handler as libc::sighandler_t)
}

/// `sigaction(sig)` with `action`: a handler's address, `SIG_IGN` or `SIG_DFL`.
fn set_action(sig: libc::c_int, action: libc::sighandler_t) -> std::io::Result<()> {
    // SAFETY: `sa` is zero-initialised plain data filled in completely; `action` is a handler
    // that is async-signal-safe (the callers' contract) or a disposition constant; the old
    // action is not asked for.
    let rc = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = action;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(sig, &sa, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The stop signal this process received, if any.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The name of a stop signal.
pub fn name(sig: i32) -> &'static str {
    match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        _ => "a stop signal",
    }
}

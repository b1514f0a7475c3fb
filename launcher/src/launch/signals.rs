//! SIGINT, SIGTERM, SIGHUP and SIGUSR1 to the launcher: recorded by a handler, acted on by
//! the supervision loop (which forwards them to every worker).
//!
//! SIGTERM and SIGUSR1 are stop signals: the ranks save a checkpoint at an agreed step and
//! exit with code 3, so the launcher gives them the stop deadline rather than `--grace-s`.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// The last signal received (0: none).
static LAST: AtomicI32 = AtomicI32::new(0);
/// How many signals were received.
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// The signals the launcher catches.
const CAUGHT: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1];

extern "C" fn on_signal(sig: libc::c_int) {
    // Only lock-free atomics here: they are async-signal-safe.
    LAST.store(sig, Ordering::SeqCst);
    COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Installs the handler for SIGINT, SIGTERM, SIGHUP and SIGUSR1. Children get the default
/// dispositions back at `exec`.
pub fn install() -> std::io::Result<()> {
    CAUGHT
        .iter()
        .try_for_each(|&sig| zrun_train::stop::catch(sig, on_signal))
}

/// The last signal received and how many have arrived, or `None` when none has.
pub fn received() -> Option<(i32, usize)> {
    match COUNT.load(Ordering::SeqCst) {
        0 => None,
        n => Some((LAST.load(Ordering::SeqCst), n)),
    }
}

/// How many signals have arrived so far (to tell a second one from the first).
pub fn count() -> usize {
    COUNT.load(Ordering::SeqCst)
}

/// True for the signals that ask the ranks to save a checkpoint and stop (SIGTERM, SIGUSR1).
pub fn is_stop(sig: i32) -> bool {
    sig == libc::SIGTERM || sig == libc::SIGUSR1
}

/// The exit code of a launcher stopped by `sig`: 128 + its number.
pub fn exit_code(sig: i32) -> u8 {
    u8::try_from(128 + sig).unwrap_or(1)
}

/// The conventional name of a signal number (`SIGKILL`), or `signal N`.
pub fn name(sig: i32) -> String {
    let n = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    n.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_common_signals() {
        assert_eq!(name(9), "SIGKILL");
        assert_eq!(name(15), "SIGTERM");
        assert_eq!(name(11), "SIGSEGV");
        assert_eq!(name(63), "signal 63");
    }

    #[test]
    fn a_raised_signal_is_recorded_not_fatal() {
        install().unwrap();
        let before = received().map_or(0, |(_, n)| n);
        // SAFETY: raising a signal whose handler was just installed; the handler only
        // stores to atomics.
        unsafe {
            libc::raise(libc::SIGHUP);
        }
        let (sig, n) = received().unwrap();
        assert_eq!((sig, n), (libc::SIGHUP, before + 1));
        // SIGUSR1 is caught too (its default action would end the launcher).
        // SAFETY: as above.
        unsafe {
            libc::raise(libc::SIGUSR1);
        }
        assert_eq!(received(), Some((libc::SIGUSR1, before + 2)));
        assert_eq!(count(), before + 2);
    }

    #[test]
    fn stop_signals_and_exit_codes() {
        assert!(is_stop(libc::SIGTERM) && is_stop(libc::SIGUSR1));
        assert!(!is_stop(libc::SIGINT) && !is_stop(libc::SIGHUP));
        assert_eq!(exit_code(libc::SIGTERM), 143);
        assert_eq!(exit_code(libc::SIGUSR1), 138);
    }
}

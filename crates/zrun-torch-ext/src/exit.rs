//! Ending a process without running libtorch's static destructors.

use std::io::Write;

/// Ends this process with `code` now: Rust's stdout and stderr and every C stdio stream
/// flushed, then `_exit`, so no atexit handler or static destructor runs (C's `quick_exit`
/// without its handlers).
///
/// libtorch's destructors deregister each of the thousands of operators it registered when
/// it was loaded: about 150 ms of CPU in every process that links it, a third of what
/// loading it costs, and most of a short command's run (a launcher, a rank of a small job,
/// `zrun --dry-run`). They would also run while another thread may still be inside
/// libtorch. Nothing zrun writes waits for them: files are flushed and closed when their
/// owners drop, before this is called.
pub fn quick_exit(code: i32) -> ! {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    flush_c_and_exit(code)
}

/// Flushes every C stdio stream and ends the process with `code`, running nothing else.
fn flush_c_and_exit(code: i32) -> ! {
    // SAFETY: fflush(NULL) flushes every open C output stream and takes no pointer of ours;
    // _exit has no preconditions and does not return.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(code)
    }
}

/// Ends the process that calls `exit(status)` as [`quick_exit`] would; registered by
/// [`end_tests_without_destructors!`].
extern "C" fn end_now(status: libc::c_int, _: *mut libc::c_void) {
    // Rust's stdout was flushed before libc's exit was called: returning from `main` and
    // `std::process::exit` both flush it. Locking it again here could wait on a thread that
    // holds it.
    flush_c_and_exit(status)
}

extern "C" {
    /// glibc's `atexit` that passes the exit status.
    fn on_exit(
        function: extern "C" fn(libc::c_int, *mut libc::c_void),
        arg: *mut libc::c_void,
    ) -> libc::c_int;
}

/// Makes `exit` end the process before the handlers and static destructors registered
/// before this call: see [`end_tests_without_destructors!`].
#[doc(hidden)]
pub extern "C" fn end_at_exit_without_destructors() {
    // SAFETY: registers a function that takes no pointer of ours. If registration fails, the
    // process simply ends the slow way.
    unsafe {
        on_exit(end_now, std::ptr::null_mut());
    }
}

/// In a test binary's root: its processes (nextest's one per test, its listings, the ranks a
/// test starts from it) end without libtorch's static destructors, as `zrun` itself does
/// through [`quick_exit`]. That is ~150 ms of CPU per process, and a test run starts
/// hundreds of them.
///
/// It registers an exit handler from the binary's own constructors, which run after those of
/// the libraries it links (libtorch's among them): `exit` runs handlers in reverse order, so
/// this one comes first, flushes C's streams and ends the process with the same status.
/// Only the handlers registered later still run (function-local statics first used in a
/// test).
#[macro_export]
macro_rules! end_tests_without_destructors {
    () => {
        #[used]
        #[link_section = ".init_array"]
        static ZRUN_END_WITHOUT_DESTRUCTORS: extern "C" fn() =
            $crate::end_at_exit_without_destructors;
    };
}

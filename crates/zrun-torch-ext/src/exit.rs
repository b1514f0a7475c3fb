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
    // SAFETY: fflush(NULL) flushes every open C output stream and takes no pointer of ours;
    // _exit has no preconditions and does not return.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(code)
    }
}

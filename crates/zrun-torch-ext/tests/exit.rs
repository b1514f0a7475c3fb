//! `end_tests_without_destructors!`: a test process still reports what a normal exit would
//! (the status, the panic's message, what it printed through Rust and through C's stdio),
//! and the exit handlers registered before libtorch's constructors do not run.

zrun_torch_ext::end_tests_without_destructors!();

use std::process::{Command, Output};

const MARK: &str = "ZRUN_TEST_EXIT_MARK";

/// Registered from this binary's pre-initialisers, before any library's constructor (and so
/// before libtorch registers its destructors): it runs only if the exit reaches them.
extern "C" fn late_handler() {
    if std::env::var_os(MARK).is_some() {
        let line = b"late exit handler ran\n";
        // SAFETY: writes a static buffer to fd 2.
        unsafe {
            libc::write(2, line.as_ptr().cast(), line.len());
        }
    }
}

extern "C" fn register_late_handler() {
    // SAFETY: registers a function that takes no pointer of ours.
    unsafe {
        libc::atexit(late_handler);
    }
}

#[used]
#[link_section = ".preinit_array"]
static REGISTER_LATE_HANDLER: extern "C" fn() = register_late_handler;

/// Prints through Rust (without a newline) and through C's stdio, with libtorch in use, then
/// passes or fails as `fail` says.
fn print_then(fail: bool) {
    let t = tch::Tensor::from_slice(&[1.0f32, 2.0]);
    print!("rust's line without a newline;");
    // SAFETY: a NUL-terminated format with no conversions.
    unsafe {
        libc::printf(c"c stdio's line without a newline;".as_ptr());
    }
    let sum = t.sum(tch::Kind::Float).double_value(&[]);
    assert!(!fail, "the deliberate failure, sum {sum}");
}

#[test]
#[ignore = "started by ends_with_the_status_and_the_output_of_a_normal_exit"]
fn passes_on_purpose() {
    print_then(false);
}

#[test]
#[ignore = "started by ends_with_the_status_and_the_output_of_a_normal_exit"]
fn fails_on_purpose() {
    print_then(true);
}

fn run(test: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--ignored", "--nocapture"])
        .env(MARK, "1")
        .output()
        .unwrap()
}

#[test]
fn ends_with_the_status_and_the_output_of_a_normal_exit() {
    for (test, code) in [("passes_on_purpose", 0), ("fails_on_purpose", 101)] {
        let out = run(test);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{test}: {stdout}\n{stderr}");
        for want in [
            "rust's line without a newline;",
            "c stdio's line without a newline;",
        ] {
            assert!(stdout.contains(want), "{test}: no {want:?} in {stdout}");
        }
        assert_eq!(
            stderr.contains("the deliberate failure, sum 3"),
            code != 0,
            "{test}: {stderr}"
        );
        assert!(
            !stderr.contains("late exit handler ran"),
            "{test}: the exit ran the handlers registered before libtorch's: {stderr}"
        );
    }
}

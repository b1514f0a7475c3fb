//! Installing the caching CPU allocator keeps transparent huge pages to its arenas (which ask
//! for them): elsewhere (the C heap's thread arenas, thread stacks) a few KiB used would
//! fault in whole 2 MiB pages where the system backs every mapping with them, and a rank's
//! resident memory would stop following the estimate. Alone in its own test binary:
//! installing a CPU allocator and the prctl flag are process-wide.

zrun_torch_ext::end_tests_without_destructors!();

use zrun_torch_ext::install_cpu_caching_allocator;

/// PR_GET_THP_DISABLE's answer: 0 when huge pages are allowed everywhere.
fn thp_disable_flags() -> i32 {
    // SAFETY: PR_GET_THP_DISABLE reads a flag of this process; the other arguments must be 0.
    unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) }
}

/// Whether this kernel knows PR_THP_DISABLE_EXCEPT_ADVISED (Linux 6.18).
fn kernel_has_except_advised() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (6, 18)
}

#[test]
fn huge_pages_stay_with_the_arena() -> anyhow::Result<()> {
    assert_eq!(thp_disable_flags(), 0, "no flag before installation");
    install_cpu_caching_allocator(None)?;
    if !kernel_has_except_advised() {
        eprintln!("skipped: this kernel has no PR_THP_DISABLE_EXCEPT_ADVISED (Linux 6.18)");
        return Ok(());
    }
    // Disabled, except where a mapping asks (bit 1: PR_THP_DISABLE_EXCEPT_ADVISED).
    assert_eq!(thp_disable_flags(), 1 | (1 << 1));
    Ok(())
}

//! Resizing a 256 MiB CPU buffer's storage to 0 gives its pages back to the OS (VmRSS drops)
//! and growing it back gives a working buffer. Alone in its own test binary so no other
//! test's allocations move this process's RSS meanwhile.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_torch_ext::{resize_storage, storage_nbytes};

/// Resident set size of this process in bytes, from /proc/self/status.
fn rss_bytes() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .ok_or_else(|| anyhow::anyhow!("no VmRSS line in /proc/self/status"))?;
    let kib: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib * 1024)
}

#[test]
fn resize_to_zero_releases_rss_and_regrow_works() -> anyhow::Result<()> {
    const BYTES: u64 = 256 << 20;
    let numel = (BYTES / 4) as i64;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;

    let base = rss_bytes()?;
    let flat = Tensor::f_ones([numel], (Kind::Float, Device::Cpu))?; // touches every page
    let half = flat.narrow(0, numel / 2, numel / 2); // a view sharing the storage
    let full = rss_bytes()?;
    assert!(
        full - base >= BYTES * 9 / 10,
        "allocation did not show in RSS"
    );

    resize_storage(&flat, 0)?;
    assert_eq!(storage_nbytes(&flat)?, 0);
    assert_eq!(storage_nbytes(&half)?, 0);
    let freed = rss_bytes()?;
    eprintln!(
        "VmRSS: before {:.1} MiB, with buffer {:.1} MiB, after resize to 0 {:.1} MiB (dropped {:.1} MiB of {:.0})",
        mib(base),
        mib(full),
        mib(freed),
        mib(full.saturating_sub(freed)),
        mib(BYTES)
    );
    assert!(
        full.saturating_sub(freed) >= BYTES * 9 / 10,
        "RSS dropped only {:.1} MiB of {:.0} MiB",
        mib(full.saturating_sub(freed)),
        mib(BYTES)
    );

    resize_storage(&flat, BYTES as usize)?;
    assert_eq!(storage_nbytes(&half)?, BYTES as usize);
    let _ = half.data().f_fill_(3.0)?;
    let _ = flat.data().narrow(0, 0, numel / 2).f_fill_(1.0)?;
    let sum = flat.f_sum(Kind::Double)?.double_value(&[]);
    assert_eq!(
        sum,
        (numel / 2) as f64 * 4.0,
        "both halves, written through different views"
    );
    let regrown = rss_bytes()?;
    eprintln!(
        "VmRSS after growing back and filling: {:.1} MiB",
        mib(regrown)
    );
    assert!(
        regrown - freed >= BYTES * 9 / 10,
        "the regrown buffer is resident once written"
    );
    Ok(())
}

//! A caching allocator for libtorch's CPU tensors (csrc/cpu_allocator.cpp), the CPU
//! counterpart of CUDA's: freed blocks are kept and reused, so a training loop stops taking
//! and faulting in memory after its first steps, and what it holds is counted.
//!
//! The rule, by request size:
//! - below 64 KiB: a 64-byte aligned block from the C heap (glibc's heap keeps and reuses
//!   small blocks itself), counted while live, not cached;
//! - from 64 KiB: rounded up to whole 4 KiB pages and carved out of an arena (a large range
//!   of address space reserved once, made writable as it grows). A request takes the
//!   smallest free block with resident pages that holds it (best fit, the rest stays free);
//!   else a free block at the arena's end, extended; else the smallest free block whose
//!   pages were returned; else fresh pages at the arena's end. Freed blocks merge with their
//!   free neighbours, so what the arena holds at its peak stays close to the most bytes live
//!   at once. They keep their pages until [`cpu_empty_cache`] or the limit returns them
//!   (`madvise(MADV_DONTNEED)`).
//!
//! With a limit, a request that needs fresh pages past it first returns every cached page to
//! the system, then, if still over, fails with libtorch's out-of-memory error ("CPU out of
//! memory: tried to allocate N bytes ..."), which a `tch` `f_` call returns as an `Err`.
//!
//! Installing is process-wide and cannot be undone; tensors made before it keep the default
//! allocator's deleter and are freed by it.

use crate::{ffi, Error};
use std::ptr;

/// The caching CPU allocator's figures, in bytes (and counts of events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuMemoryStats {
    /// Bytes of blocks held by live tensors now (requests rounded to their block).
    pub allocated: u64,
    /// Bytes held from the system: live blocks and cached free ones.
    pub reserved: u64,
    /// Most bytes allocated since the last [`reset_cpu_peak`].
    pub peak_allocated: u64,
    /// Most bytes reserved since the last [`reset_cpu_peak`].
    pub peak_reserved: u64,
    /// Requests from 64 KiB that took pages from the system since installation (the rest
    /// reused cached ones).
    pub fresh: u64,
    /// Free blocks whose pages went back to the system ([`cpu_empty_cache`], or to make room
    /// under the limit).
    pub returned: u64,
    /// The cap on reserved bytes, if any.
    pub limit: Option<u64>,
}

/// Installs the caching allocator as libtorch's CPU allocator, once per process; a later call
/// only sets the limit. `limit`: the most bytes it may reserve (`None`: no cap). A limit below
/// what is reserved now takes effect at the next request that needs a fresh block.
pub fn install_cpu_caching_allocator(limit: Option<u64>) -> Result<(), Error> {
    let op = || format!("install_cpu_caching_allocator(limit {limit:?})");
    if limit == Some(0) {
        return Err(Error::Refused {
            op: op(),
            reason: "a limit of 0 bytes; give a positive limit, or None for no limit".into(),
        });
    }
    let mut err = ptr::null_mut();
    // SAFETY: `err` is a valid out-pointer; the shim catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_cpu_alloc_install(limit.unwrap_or(0), &mut err) };
    ffi::check(status, err, op)
}

/// Whether [`install_cpu_caching_allocator`] has run in this process.
pub fn cpu_caching_allocator_installed() -> bool {
    cpu_memory_stats().is_some()
}

/// The caching allocator's figures, or `None` where it is not installed.
pub fn cpu_memory_stats() -> Option<CpuMemoryStats> {
    let mut out = [0i64; 7];
    // SAFETY: `out` has the 7 places the shim writes; the call takes a lock and cannot throw.
    let installed = unsafe { ffi::zrun_ext_cpu_alloc_stats(out.as_mut_ptr()) } != 0;
    let u = |v: i64| v.max(0) as u64;
    installed.then(|| CpuMemoryStats {
        allocated: u(out[0]),
        reserved: u(out[1]),
        peak_allocated: u(out[2]),
        peak_reserved: u(out[3]),
        fresh: u(out[4]),
        returned: u(out[5]),
        limit: (out[6] > 0).then(|| u(out[6])),
    })
}

/// Resets the peaks [`cpu_memory_stats`] reports to the bytes held now. Does nothing where the
/// allocator is not installed.
pub fn reset_cpu_peak() {
    // SAFETY: takes a lock; cannot throw.
    unsafe { ffi::zrun_ext_cpu_alloc_reset_peak() }
}

/// Returns every cached free block to the system (live tensors keep theirs). Does nothing
/// where the allocator is not installed.
pub fn cpu_empty_cache() {
    // SAFETY: takes a lock; returns pages of blocks no tensor holds; cannot throw.
    unsafe { ffi::zrun_ext_cpu_alloc_empty_cache() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_limit_is_refused_before_anything_is_installed() {
        let e = install_cpu_caching_allocator(Some(0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("positive limit"), "{e}");
        // The crate's unit tests run on c10's default allocator.
        assert!(!cpu_caching_allocator_installed());
        assert_eq!(cpu_memory_stats(), None);
        reset_cpu_peak(); // no-ops, must not crash
        cpu_empty_cache();
    }
}

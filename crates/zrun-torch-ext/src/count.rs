//! Counting libtorch's allocations around a piece of code, through the hook its allocators
//! call for the profiler's memory events: how a test checks that code allocates nothing.

use crate::ffi;
use crate::Error;
use std::ptr;

/// Allocations libtorch's allocators made (or were asked for and failed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocations {
    /// Blocks handed out, and requests that failed.
    pub count: i64,
    /// Their bytes.
    pub bytes: i64,
}

/// Ends the count on drop when `f` unwinds, so the thread's profiler state stays balanced.
struct Counting(bool);

impl Drop for Counting {
    fn drop(&mut self) {
        if self.0 {
            let (mut count, mut bytes, mut err) = (0, 0, ptr::null_mut());
            // SAFETY: out-pointers to locals; the shim catches every C++ exception.
            let status =
                unsafe { ffi::zrun_ext_count_allocations_end(&mut count, &mut bytes, &mut err) };
            let _ = ffi::check(status, err, String::new);
        }
    }
}

/// Runs `f` and counts the allocations libtorch's CPU allocator and CUDA caching allocator
/// made for it on this thread (and on threads that inherit its state, such as autograd's),
/// failed requests included. Allocations outside libtorch (Rust's, a backend's own) are not
/// seen. A profiler recording memory on this thread misses what `f` allocates.
pub fn count_allocations<T>(f: impl FnOnce() -> T) -> Result<(T, Allocations), Error> {
    let mut err = ptr::null_mut();
    // SAFETY: an out-pointer to a local; the shim catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_count_allocations_begin(&mut err) };
    ffi::check(status, err, || "count_allocations (begin)".into())?;
    let mut counting = Counting(true);
    let out = f();
    counting.0 = false;
    let (mut count, mut bytes, mut err) = (0, 0, ptr::null_mut());
    // SAFETY: out-pointers to locals; the shim catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_count_allocations_end(&mut count, &mut bytes, &mut err) };
    ffi::check(status, err, || "count_allocations (end)".into())?;
    Ok((out, Allocations { count, bytes }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn new_storage_is_counted_and_views_and_in_place_ops_are_not() {
        let t = Tensor::zeros([1000], (Kind::Float, Device::Cpu));
        let ((), none) = count_allocations(|| {
            let mut v = t.narrow(0, 10, 100);
            let _ = v.fill_(1.0);
            let _ = v.view_dtype(Kind::Int);
        })
        .unwrap();
        assert_eq!(none, Allocations::default());
        let (u, some) =
            count_allocations(|| Tensor::ones([250], (Kind::Float, Device::Cpu))).unwrap();
        assert_eq!(some.count, 1);
        assert!(some.bytes >= 1000, "{some:?}");
        drop(u);
        // Nested counts: the inner one sees its own, hidden from the outer.
        let ((_, inner), outer) = count_allocations(|| {
            let _a = Tensor::ones([10], (Kind::Float, Device::Cpu));
            count_allocations(|| Tensor::ones([10], (Kind::Float, Device::Cpu))).unwrap()
        })
        .unwrap();
        assert_eq!((inner.count, outer.count), (1, 1));
    }
}

//! libtorch's profiler (Kineto) around a piece of a run: what `log.profile_step` records.

use crate::ffi;
use crate::Error;
use std::ffi::CString;
use std::path::Path;
use std::ptr;

/// Starts libtorch's profiler on the calling thread and the threads that inherit its state
/// (autograd's): operators with their input shapes, and with `cuda` CUDA kernels, copies and
/// memsets. Refused while one is on; [`profiler_stop`] on the same thread ends it.
pub fn profiler_start(cuda: bool) -> Result<(), Error> {
    let mut err = ptr::null_mut();
    // SAFETY: an out-pointer to a local; the shim catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_profiler_start(i32::from(cuda), &mut err) };
    ffi::check(status, err, || "start the profiler".into())
}

/// Stops the profiler started on this thread and writes what it recorded to `path` as a
/// Chrome trace (JSON). libtorch writes `path.tmp` and renames it, and only logs a write
/// that fails (a full disk): `path` is removed first and an error returned when no new one
/// is there after, the partial `path.tmp` removed.
pub fn profiler_stop(path: &Path) -> Result<(), Error> {
    let op = || format!("write the profile to {}", path.display());
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Error::Torch {
        op: op(),
        message: "the path holds a NUL byte".into(),
    })?;
    let _ = std::fs::remove_file(path);
    let mut err = ptr::null_mut();
    // SAFETY: `c` is a NUL-terminated string alive for the call; an out-pointer to a local;
    // the shim catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_profiler_stop(c.as_ptr(), &mut err) };
    ffi::check(status, err, op)?;
    if !path.is_file() {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let _ = std::fs::remove_file(tmp);
        return Err(Error::Torch {
            op: op(),
            message:
                "libtorch could not write it (is the disk full, or the directory not writable?)"
                    .into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn a_profile_records_the_operators_run_meanwhile_refuses_misuse_and_says_when_unwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.json");
        assert!(profiler_stop(&path).is_err(), "nothing to stop");
        profiler_start(false).unwrap();
        assert!(profiler_start(false).is_err(), "one at a time");
        let a = Tensor::ones([64, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        a.matmul(&a).sum(Kind::Float).backward();
        profiler_stop(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
        let names: Vec<&str> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["name"].as_str())
            .collect();
        assert!(names.contains(&"aten::mm"), "{names:?}");
        // The backward's operators, which run on autograd's side of the call.
        assert!(names.iter().any(|n| n.contains("MmBackward")), "{names:?}");
        assert!(profiler_stop(&path).is_err(), "stopped already");

        // A profile that cannot be written (in this same test: Kineto must be set up and
        // used on one thread, and `cargo test` runs tests on several). libtorch writes
        // `path.tmp` first: a directory in its place fails the write as a full disk would,
        // and the profile of an earlier run under `path` must not pass.
        let path = dir.path().join("again.json");
        std::fs::write(&path, "{}").unwrap();
        std::fs::create_dir(dir.path().join("again.json.tmp")).unwrap();
        profiler_start(false).unwrap();
        let a = Tensor::ones([8, 8], (Kind::Float, Device::Cpu));
        let _ = a.matmul(&a);
        let e = profiler_stop(&path).unwrap_err().to_string();
        assert!(
            e.contains("again.json") && e.contains("could not write"),
            "{e}"
        );
        assert!(!path.exists());
    }
}

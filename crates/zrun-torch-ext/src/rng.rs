//! The state of libtorch's default random generators (`torch.get_rng_state()` /
//! `torch.set_rng_state()`, `torch.cuda.get_rng_state(i)` / `torch.cuda.set_rng_state(s, i)`),
//! which `tch` does not expose: a checkpoint saves each rank's state so that a resumed run
//! draws the same random numbers (dropout masks, `Tensor::randn`, ...).
//!
//! The bytes are libtorch's own state layout (for the CPU a Mersenne Twister, for CUDA a
//! Philox seed and offset): restore them with the same libtorch version onto the same kind of
//! device. The shim takes the generator's mutex as PyTorch does, so a call does not race a
//! draw on another thread; whether that draw comes before or after it is up to the caller.

use crate::ffi;
use crate::Error;
use std::ffi::c_int;
use std::ptr;
use tch::{Device, Tensor};

/// The default generator's state bytes for the CPU or for CUDA device `i`, as
/// `torch.get_rng_state()` / `torch.cuda.get_rng_state(i)` return them.
///
/// Errors: [`Error::Refused`] for a CUDA device where CUDA is not available (libtorch's CUDA
/// part not linked: build without feature `cuda`, a CPU libtorch, or no GPU), for a CUDA
/// index the machine does not have, and for MPS / Vulkan; [`Error::Torch`] if libtorch raises.
pub fn state(device: Device) -> Result<Vec<u8>, Error> {
    let op = || format!("rng::state({})", device_name(device));
    let (kind, index) = shim_device(device, op)?;
    let mut out = ptr::null_mut();
    let mut err = ptr::null_mut();
    // SAFETY: `out` and `err` are valid places for one pointer each; the shim writes `out`
    // only on success and catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_rng_state(kind, index, &mut out, &mut err) };
    ffi::check(status, err, op)?;
    // SAFETY: on success `out` is a fresh `new torch::Tensor` (a contiguous uint8 CPU
    // tensor), owned from here on by `t`, whose drop deletes it.
    let t = unsafe { Tensor::from_ptr(out.cast()) };
    let n = t.numel();
    let mut bytes = vec![0u8; n];
    t.f_copy_data_u8(&mut bytes, n).map_err(|e| Error::Torch {
        op: op(),
        message: e.to_string(),
    })?;
    Ok(bytes)
}

/// Restores the default generator of the CPU or of CUDA device `i` from bytes that [`state`]
/// returned (`torch.set_rng_state` / `torch.cuda.set_rng_state(s, i)`): the draws that follow
/// are those that followed the save.
///
/// Errors: as [`state`] for the device; [`Error::Torch`], naming the device and leaving the
/// generator unchanged, for a state libtorch rejects (wrong size or content: a state from
/// another libtorch version or another generator, or corrupt bytes).
pub fn set_state(device: Device, bytes: &[u8]) -> Result<(), Error> {
    let op = || {
        format!(
            "rng::set_state({}, {} bytes)",
            device_name(device),
            bytes.len()
        )
    };
    let (kind, index) = shim_device(device, op)?;
    let mut err = ptr::null_mut();
    // SAFETY: `bytes` is valid for reads of `bytes.len()` bytes for the call (the shim copies
    // them and reads nothing when the length is 0); the shim catches every C++ exception.
    let status =
        unsafe { ffi::zrun_ext_rng_set_state(kind, index, bytes.as_ptr(), bytes.len(), &mut err) };
    ffi::check(status, err, op)
}

/// The device as PyTorch writes it (`cpu`, `cuda:0`).
fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => String::from("cpu"),
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Mps => String::from("mps"),
        Device::Vulkan => String::from("vulkan"),
    }
}

/// The shim's (kind, index) for `device`, or a refusal for the devices it does not handle.
fn shim_device(device: Device, op: impl Fn() -> String) -> Result<(c_int, i64), Error> {
    match device {
        Device::Cpu => Ok((ffi::ZR_DEVICE_CPU, -1)),
        Device::Cuda(i) => i64::try_from(i)
            .map(|i| (ffi::ZR_DEVICE_CUDA, i))
            .map_err(|_| Error::Refused {
                op: op(),
                reason: format!("cuda:{i} does not exist (index out of range)"),
            }),
        Device::Mps | Device::Vulkan => Err(Error::Refused {
            op: op(),
            reason: format!(
                "{} has no generator state this crate saves; only cpu and cuda:N do",
                device_name(device)
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    //! Only what does not touch a generator: the round trips live in tests/rng.rs, alone in
    //! their binary, since the default generators are global and tests run on parallel threads.
    use super::*;

    #[test]
    fn devices_without_a_saved_generator_are_refused_by_name() {
        for dev in [Device::Mps, Device::Vulkan] {
            match state(dev) {
                Err(Error::Refused { op, reason }) => {
                    let name = device_name(dev);
                    assert!(
                        op.contains(&name) && reason.contains(&name),
                        "{op}: {reason}"
                    );
                }
                other => panic!("expected Refused for {dev:?}, got {other:?}"),
            }
            assert!(matches!(
                set_state(dev, &[0; 16]),
                Err(Error::Refused { .. })
            ));
        }
    }
}

//! Raw views of tensor memory handed to the communication thread.

use tch::{Device, Kind, Tensor};

use crate::Error;

/// Element types the collectives support.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    pub(crate) fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::BF16 => 2,
            DType::F16 => 3,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            DType::F32 => "fp32",
            DType::BF16 => "bf16",
            DType::F16 => "fp16",
        }
    }
}

/// A tensor's memory as a (pointer, length) pair, plus a shallow clone that keeps the storage
/// alive while the communication thread uses it.
pub(crate) struct RawBuf {
    pub(crate) ptr: usize,
    pub(crate) numel: usize,
    pub(crate) dtype: DType,
    _keep: Tensor,
}

// SAFETY: the tensor is only a keep-alive; tch::Tensor is Send and the pointer is plain data.
unsafe impl Send for RawBuf {}

impl RawBuf {
    pub(crate) fn bytes(&self) -> usize {
        self.numel * self.dtype.size()
    }

    /// Another view of the same memory that keeps it alive as long as it lives (for work
    /// that outlasts the job which launched it).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the nccl backend's
    pub(crate) fn keeper(&self) -> RawBuf {
        RawBuf {
            ptr: self.ptr,
            numel: self.numel,
            dtype: self.dtype,
            _keep: self._keep.shallow_clone(),
        }
    }

    /// The buffer's bytes.
    ///
    /// # Safety
    /// The caller (the communication thread) must be the only user of the memory while the
    /// returned slice lives, which the [`crate::Communicator`] contract grants until `wait`.
    pub(crate) unsafe fn as_mut<'a>(&self) -> &'a mut [u8] {
        if self.numel == 0 {
            return &mut [];
        }
        // SAFETY: ptr..ptr+bytes is the tensor's contiguous storage, kept alive by `_keep`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.bytes()) }
    }
}

/// Which devices a backend accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    Cpu,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda,
}

/// Checks `t` (contiguous, supported dtype, right device) and takes a raw view of it.
pub(crate) fn raw(
    t: &Tensor,
    rank: usize,
    op: &'static str,
    what: &str,
    place: Placement,
) -> Result<RawBuf, Error> {
    let bad = |detail: String| Error::InvalidArgument { rank, op, detail };
    let dtype = match t.kind() {
        Kind::Float => DType::F32,
        Kind::BFloat16 => DType::BF16,
        Kind::Half => DType::F16,
        k => {
            return Err(bad(format!(
                "`{what}` has dtype {k:?}; supported: fp32, bf16, fp16"
            )))
        }
    };
    let dev = t.device();
    let ok = match place {
        Placement::Cpu => dev == Device::Cpu,
        Placement::Cuda => matches!(dev, Device::Cuda(_)),
    };
    if !ok {
        return Err(bad(format!(
            "`{what}` is on {dev:?}; this backend takes {} tensors",
            if place == Placement::Cpu {
                "CPU"
            } else {
                "CUDA"
            }
        )));
    }
    if !t.is_contiguous() {
        return Err(bad(format!(
            "`{what}` is not contiguous; call .contiguous() first"
        )));
    }
    let numel = t.numel();
    Ok(RawBuf {
        ptr: t.data_ptr() as usize,
        numel,
        dtype,
        _keep: t.shallow_clone(),
    })
}

/// Where a rank sits in a communicator: its world rank (the one errors name), its rank and
/// the size of the communicator, and whether that is a sub-communicator of the world.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seat {
    pub(crate) me: usize,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) sub: bool,
}

/// Checks that `shard` is this rank's chunk of `full` in the [`crate::chunk_sizes`] layout
/// of the communicator `at` sits in.
pub(crate) fn check_shard(
    full: &RawBuf,
    shard: &RawBuf,
    at: Seat,
    op: &'static str,
) -> Result<(), Error> {
    let Seat {
        me,
        rank,
        world,
        sub,
    } = at;
    let within = if sub {
        format!(" (in a sub-communicator of {world} ranks)")
    } else {
        String::new()
    };
    let want = crate::chunk_sizes(full.numel, world)[rank];
    if full.dtype != shard.dtype {
        return Err(Error::InvalidArgument {
            rank: me,
            op,
            detail: format!(
                "shard is {} but full is {}; both must have one dtype{within}",
                shard.dtype.name(),
                full.dtype.name()
            ),
        });
    }
    if shard.numel != want {
        return Err(Error::InvalidArgument {
            rank: me,
            op,
            detail: format!(
                "shard has {} elements, but rank {rank}'s chunk of {} elements over {world} ranks has {want}{within}",
                shard.numel, full.numel
            ),
        });
    }
    Ok(())
}

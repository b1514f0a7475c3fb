//! The trainer's small collectives: a few numbers summed or averaged over the ranks, and a
//! few bytes of every rank. Built on the engine's device (NCCL takes only device tensors)
//! and read back once; at world size 1 no collective runs.

use tch::{Device, Kind, Tensor};
use zrun_comm::{Communicator, ReduceOp};

use crate::Error;

/// Element-wise sum (or mean) over the ranks of a few values, carried as fp32 (exact for
/// integers below 2^24).
pub(crate) fn reduce(
    comm: &dyn Communicator,
    device: Device,
    values: &[f64],
    op: ReduceOp,
) -> Result<Vec<f64>, Error> {
    if comm.world_size() == 1 {
        return Ok(values.to_vec());
    }
    let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    let t = Tensor::f_from_slice(&v)
        .and_then(|t| t.f_to(device))
        .map_err(torch)?;
    comm.all_reduce(&t, op)
        .and_then(|w| w.wait())
        .map_err(zrun_shard::Error::Comm)?;
    let back = t.f_to(Device::Cpu).map_err(torch)?;
    comm.check().map_err(zrun_shard::Error::Comm)?;
    let out = Vec::<f32>::try_from(&back).map_err(torch)?;
    Ok(out.into_iter().map(f64::from).collect())
}

/// `mine` (the same length on every rank) of every rank, in rank order. Exact: the bytes
/// travel as fp32 words and a gather only copies bits.
pub(crate) fn gather_bytes(
    comm: &dyn Communicator,
    device: Device,
    mine: &[u8],
) -> Result<Vec<Vec<u8>>, Error> {
    let w = comm.world_size();
    if w == 1 {
        return Ok(vec![mine.to_vec()]);
    }
    let words = mine.len().div_ceil(4);
    let mut padded = mine.to_vec();
    padded.resize(words * 4, 0);
    let shard = Tensor::f_from_data_size(&padded, &[words as i64], Kind::Float)
        .and_then(|t| t.f_to(device))
        .map_err(torch)?;
    let full = Tensor::f_zeros([(w * words) as i64], (Kind::Float, device)).map_err(torch)?;
    comm.all_gather(&shard, &full)
        .and_then(|x| x.wait())
        .map_err(zrun_shard::Error::Comm)?;
    let full = full.f_to(Device::Cpu).map_err(torch)?;
    comm.check().map_err(zrun_shard::Error::Comm)?;
    let mut bytes = vec![0u8; w * words * 4];
    full.f_copy_data_u8(&mut bytes, w * words).map_err(torch)?;
    Ok(bytes
        .chunks(words * 4)
        .map(|c| c[..mine.len()].to_vec())
        .collect())
}

fn torch(e: tch::TchError) -> Error {
    Error::Engine(zrun_shard::Error::Torch {
        op: "rank figures",
        unit: "-".into(),
        source: e,
    })
}

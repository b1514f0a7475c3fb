//! World size 1: no store, no sockets; collectives are copies or no-ops.

use tch::Tensor;

use crate::{Backend, Communicator, Error, ReduceOp, Work};

/// The communicator of a single-rank job.
pub(crate) struct SingleComm {
    backend: Backend,
}

impl SingleComm {
    pub(crate) fn new(backend: Backend) -> SingleComm {
        SingleComm { backend }
    }
}

fn same_shape_copy(dst: &Tensor, src: &Tensor, op: &'static str) -> Result<Work, Error> {
    if dst.numel() != src.numel() || dst.kind() != src.kind() {
        return Err(Error::InvalidArgument {
            rank: 0,
            op,
            detail: format!(
                "with one rank the shard is the whole tensor: {} {:?} vs {} {:?} elements",
                src.numel(),
                src.kind(),
                dst.numel(),
                dst.kind()
            ),
        });
    }
    if dst.data_ptr() != src.data_ptr() {
        let flat = src.f_reshape([-1]).and_then(|s| s.f_view_as(dst));
        let src = flat.map_err(|source| Error::Torch {
            rank: 0,
            op,
            source,
        })?;
        let mut d = dst.shallow_clone();
        d.f_copy_(&src).map_err(|source| Error::Torch {
            rank: 0,
            op,
            source,
        })?;
    }
    Ok(Work::ready())
}

impl Communicator for SingleComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn backend(&self) -> Backend {
        self.backend
    }
    fn all_gather(&self, shard: &Tensor, full: &Tensor) -> Result<Work, Error> {
        same_shape_copy(full, shard, "all_gather")
    }
    fn reduce_scatter(&self, full: &Tensor, shard: &Tensor, _op: ReduceOp) -> Result<Work, Error> {
        same_shape_copy(shard, full, "reduce_scatter")
    }
    fn all_reduce(&self, _t: &Tensor, _op: ReduceOp) -> Result<Work, Error> {
        Ok(Work::ready())
    }
    fn broadcast(&self, _t: &Tensor, root: usize) -> Result<Work, Error> {
        if root != 0 {
            return Err(Error::InvalidArgument {
                rank: 0,
                op: "broadcast",
                detail: format!("root {root} is not a rank of a 1-rank job"),
            });
        }
        Ok(Work::ready())
    }
    fn barrier(&self) -> Result<Work, Error> {
        Ok(Work::ready())
    }
    /// Every group of a 1-rank communicator has this one rank.
    fn split(&self, _color: usize, _key: usize) -> Result<Box<dyn Communicator>, Error> {
        Ok(Box::new(SingleComm::new(self.backend)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn one_rank_collectives_copy_or_keep() {
        let c = SingleComm::new(Backend::Tcp);
        let shard = Tensor::arange(5, (Kind::Float, Device::Cpu));
        let full = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        c.all_gather(&shard, &full).unwrap().wait().unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&full).unwrap(),
            vec![0., 1., 2., 3., 4.]
        );
        let out = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        c.reduce_scatter(&full, &out, ReduceOp::Avg)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&out).unwrap(),
            vec![0., 1., 2., 3., 4.]
        );
        c.all_reduce(&out, ReduceOp::Sum).unwrap().wait().unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&out).unwrap(),
            vec![0., 1., 2., 3., 4.]
        );
        assert!(c.broadcast(&out, 1).is_err());
        let short = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        assert!(c.all_gather(&short, &full).is_err());
    }

    #[test]
    fn a_split_of_one_rank_is_one_rank_of_the_same_backend() {
        let c = SingleComm::new(Backend::Mpi);
        let s = c.split(5, 3).unwrap();
        assert_eq!(
            (s.rank(), s.world_size(), s.backend()),
            (0, 1, Backend::Mpi)
        );
        let solo = crate::solo(Backend::Tcp);
        assert_eq!((solo.rank(), solo.world_size()), (0, 1));
        let full = Tensor::arange(3, (Kind::Float, Device::Cpu));
        let out = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        solo.reduce_scatter(&full, &out, ReduceOp::Avg)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(Vec::<f32>::try_from(&out).unwrap(), vec![0., 1., 2.]);
    }
}

//! Where a rank's parameters and gradients live at each stage, and the collectives that
//! move them: gathers of parameters, reductions of gradients.
//!
//! With hybrid sharding (`zero.shard_group` = G of W ranks) three communicators are at work:
//! parameters are gathered and gradients reduce-scattered within the rank's shard group (G
//! ranks), each reduced gradient shard is then all-reduced across its replica group (the W/G
//! ranks at the same position of every shard group), and what concerns every rank (the
//! gradient norm's sum) goes over the world. Both reductions average, so the result is
//! `(1/R) Σ_replicas (1/G) Σ_group g = (1/W) Σ_all g`, the average over all W ranks' gradients
//! that a reduce-scatter over the world gives; with G and R = W/G powers of two each division
//! is exact in binary floating point, so only the order of the additions differs.

use crate::layout::ShardLayout;
use crate::{Context, Error, Result, Stage};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};
use zrun_comm::{Communicator, ReduceOp, Work};

/// A collective in flight with the buffers it uses (kept alive until it completes: one
/// dropped unwaited, on an error path, is waited for first, since the communication thread
/// and the peers still read and write its buffers).
pub(crate) struct Pending {
    /// `None` once waited for.
    work: Option<Work>,
    unit: usize,
    /// Source and destination of the collective; taken by [`Pending::wait`].
    buffers: Option<(Tensor, Tensor)>,
}

impl Pending {
    fn new(work: Work, unit: usize, input: Tensor, output: Tensor) -> Pending {
        Pending {
            work: Some(work),
            unit,
            buffers: Some((input, output)),
        }
    }

    fn wait(mut self) -> Result<(usize, Tensor, Tensor)> {
        if let Some(w) = self.work.take() {
            w.wait().map_err(Error::Comm)?;
        }
        let (input, output) = self.buffers.take().ok_or_else(|| {
            Error::Unsupported("a collective's buffers were taken before it was waited for".into())
        })?;
        Ok((self.unit, input, output))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(w) = self.work.take() {
            // An error is already on its way to the caller; this wait only keeps the
            // buffers alive until the collective no longer uses them.
            let _ = w.wait();
        }
    }
}

/// Communication of one rank, with byte accounting of buffers in flight.
pub(crate) struct Mover {
    /// Every rank (the gradient norm's sum).
    pub(crate) comm: Arc<dyn Communicator>,
    /// The rank's shard group: gathers and reduce-scatters (the world without hybrid
    /// sharding).
    pub(crate) shard: Arc<dyn Communicator>,
    /// The rank's replica group, with hybrid sharding: the all-reduce of each reduced
    /// gradient shard across the shard groups.
    pub(crate) replica: Option<Arc<dyn Communicator>>,
    pub(crate) layout: ShardLayout,
    in_flight: i64,
    /// The most bytes of temporary communication buffers alive at once.
    pub(crate) peak_in_flight: i64,
    /// Time spent waiting for collectives to complete (communication not hidden by compute).
    pub(crate) waited: Duration,
    /// Bytes of gathered unit parameters alive now, and at most (stage 3).
    gathered: i64,
    pub(crate) peak_gathered: i64,
    /// The collectives issued since the current micro-step began, in order.
    pub(crate) issued: Vec<(Collective, usize)>,
    /// Whether the micro-step begun last all-reduces across the replica group (the step's
    /// last, with hybrid sharding at stages 2-3): set as it begins, cleared by the step (or
    /// by abandoning it), which then has no all-reduce of its own to do.
    pub(crate) replicates: bool,
}

/// A collective of the micro-step, for matching the other ranks' sequence after a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Collective {
    /// All-gather of a unit's parameters.
    Gather,
    /// Reduce-scatter of a unit's gradient.
    ReduceScatter,
    /// All-reduce of a unit's reduced gradient shard across the replica group (hybrid
    /// sharding).
    Replicate,
}

impl Mover {
    /// The mover of a rank whose world is `comm`, sharding within `shard` and replicating
    /// across `replica` (`None`: one shard group).
    pub(crate) fn new(
        comm: Arc<dyn Communicator>,
        shard: Arc<dyn Communicator>,
        replica: Option<Arc<dyn Communicator>>,
        layout: ShardLayout,
    ) -> Mover {
        Mover {
            comm,
            shard,
            replica,
            layout,
            in_flight: 0,
            peak_in_flight: 0,
            waited: Duration::ZERO,
            gathered: 0,
            peak_gathered: 0,
            issued: Vec::new(),
            replicates: false,
        }
    }

    /// Whether units' parameters are gathered at `stage`: at stage 3 over a shard group of
    /// more than one rank. A group of one (one rank, or hybrid sharding with
    /// `zero.shard_group = 1`) holds every unit whole in its shard, which the units then
    /// read in place, as at stages 0-2.
    pub(crate) fn gathers(&self, stage: Stage) -> bool {
        stage == Stage::Zero3 && !self.group_of_one()
    }

    /// Whether the shard group is this rank alone, so that its collectives are identities: a
    /// reduce-scatter's shard is the full gradient itself, and a gather of the owned slices
    /// leaves a full buffer as it is; no buffer, no copy.
    pub(crate) fn group_of_one(&self) -> bool {
        self.layout.world_size == 1
    }

    fn alloc(
        &mut self,
        numel: i64,
        kind: Kind,
        device: tch::Device,
        unit: usize,
    ) -> Result<Tensor> {
        Tensor::f_empty([numel], (kind, device)).ctx(
            "allocate communication buffer",
            &self.layout.units[unit].unit,
        )
    }

    /// Counts `bytes` more in flight.
    fn count(&mut self, bytes: i64) {
        self.in_flight += bytes;
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
    }

    /// Counts `bytes` more of gathered parameters in flight.
    fn count_gathered(&mut self, bytes: i64) {
        self.gathered += bytes;
        self.peak_gathered = self.peak_gathered.max(self.gathered);
        self.count(bytes);
    }

    /// Forgets buffers of collectives that were abandoned (their tensors are gone).
    pub(crate) fn reset_in_flight(&mut self) {
        self.in_flight = 0;
        self.gathered = 0;
        self.issued.clear();
    }

    fn release(&mut self, t: &Tensor) {
        self.in_flight -= t.numel() as i64 * t.kind().elt_size_in_bytes() as i64;
    }

    fn release_gathered(&mut self, t: &Tensor) {
        self.gathered -= t.numel() as i64 * t.kind().elt_size_in_bytes() as i64;
        self.release(t);
    }

    /// Starts gathering unit `u` from this rank's `shard` slice into a new full buffer.
    pub(crate) fn start_gather(&mut self, shard: &Tensor, u: usize) -> Result<Pending> {
        let numel = self.layout.units[u].padded;
        let full = self.alloc(numel, shard.kind(), shard.device(), u)?;
        self.count_gathered(numel * shard.kind().elt_size_in_bytes() as i64);
        let input = self.shard_of(shard, u)?;
        let work = self.shard.all_gather(&input, &full).map_err(Error::Comm)?;
        self.issued.push((Collective::Gather, u));
        Ok(Pending::new(work, u, input, full))
    }

    /// Waits for a gather and returns the full unit buffer (still counted until `done_with`).
    pub(crate) fn finish_gather(&mut self, p: Pending) -> Result<Tensor> {
        Ok(self.timed(|| p.wait())?.2)
    }

    /// Runs `wait`, adding its time to [`Mover::waited`].
    fn timed<T>(&mut self, wait: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = wait();
        self.waited += t.elapsed();
        r
    }

    /// Re-gathers unit `u` into `full`, a buffer whose storage was freed with [`Mover::free`]
    /// (autograd's saved views of it see the new contents). The write goes through an alias
    /// with its own version counter, so autograd does not take it for an in-place change.
    pub(crate) fn start_gather_into(
        &mut self,
        shard: &Tensor,
        u: usize,
        full: &Tensor,
    ) -> Result<Pending> {
        let name = self.layout.units[u].unit.clone();
        let bytes = full.numel() as i64 * full.kind().elt_size_in_bytes() as i64;
        zrun_torch_ext::resize_storage(full, bytes as usize)
            .map_err(|e| Error::Storage(name.clone(), e))?;
        self.count_gathered(bytes);
        let input = self.shard_of(shard, u)?;
        let output = full.data();
        let work = self
            .shard
            .all_gather(&input, &output)
            .map_err(Error::Comm)?;
        self.issued.push((Collective::Gather, u));
        Ok(Pending::new(work, u, input, output))
    }

    /// Releases a gathered buffer's memory now, even while autograd holds views of it.
    pub(crate) fn free(&mut self, full: &Tensor) -> Result<()> {
        zrun_torch_ext::resize_storage(full, 0)
            .map_err(|e| Error::Storage("gathered unit".into(), e))?;
        self.release_gathered(full);
        Ok(())
    }

    /// Stops counting a gathered buffer that the caller keeps (it is no longer in flight).
    pub(crate) fn untrack(&mut self, full: &Tensor) {
        self.release_gathered(full);
    }

    /// Starts averaging unit `u`'s full gradient `grad` over the shard group into a new
    /// shard buffer. Over a group of one the shard is `grad` itself: nothing is allocated,
    /// copied or sent (the collective is still recorded in [`Mover::issued`]).
    pub(crate) fn start_reduce_scatter(&mut self, grad: Tensor, u: usize) -> Result<Pending> {
        if self.group_of_one() {
            self.issued.push((Collective::ReduceScatter, u));
            let shard = grad.shallow_clone();
            return Ok(Pending::new(Work::ready(), u, grad, shard));
        }
        let len = self.layout.units[u].shard_len();
        let shard = self.alloc(len, grad.kind(), grad.device(), u)?;
        self.count(len * grad.kind().elt_size_in_bytes() as i64);
        let work = self
            .shard
            .reduce_scatter(&grad, &shard, ReduceOp::Avg)
            .map_err(Error::Comm)?;
        self.issued.push((Collective::ReduceScatter, u));
        Ok(Pending::new(work, u, grad, shard))
    }

    /// Whether reduced gradient shards are all-reduced across a replica group (hybrid
    /// sharding).
    pub(crate) fn replicated(&self) -> bool {
        self.replica.is_some()
    }

    /// Waits for the reduce-scatter `p` (its full gradient is freed), then starts averaging
    /// its shard over the replica group, in place: the shard stays counted in flight until
    /// [`Mover::finish_reduce_scatter`]. Issued only after the wait: on a staging backend
    /// (tcp with CUDA tensors) the reduced shard reaches the device only then.
    fn replicate_scattered(&mut self, p: Pending) -> Result<Pending> {
        let (u, grad, shard) = self.timed(|| p.wait())?;
        drop(grad);
        self.start_replicate(shard, u)
    }

    /// Starts averaging unit `u`'s gradient shard `shard` over the replica group, in place:
    /// no buffer of its own (a reduce-scatter's output shard stays counted until
    /// [`Mover::finish_reduce_scatter`]; a slice of the rank's gradient shards is not counted).
    pub(crate) fn start_replicate(&mut self, shard: Tensor, u: usize) -> Result<Pending> {
        let Some(replica) = &self.replica else {
            return Err(Error::Unsupported(
                "a replica all-reduce without a replica group".into(),
            ));
        };
        let work = replica
            .all_reduce(&shard, ReduceOp::Avg)
            .map_err(Error::Comm)?;
        self.issued.push((Collective::Replicate, u));
        Ok(Pending::new(work, u, shard.shallow_clone(), shard))
    }

    /// Waits for an all-reduce from [`Mover::start_replicate`]; returns the unit and its
    /// averaged shard.
    pub(crate) fn finish_replicate(&mut self, p: Pending) -> Result<(usize, Tensor)> {
        let (u, _, shard) = self.timed(|| p.wait())?;
        Ok((u, shard))
    }

    /// Averages every unit of this rank's gradient shards `grads` (stages 2-3) over the
    /// replica group, in place.
    pub(crate) fn replicate_units(&mut self, grads: &Tensor) -> Result<()> {
        let mut pending = Vec::new();
        for u in 0..self.layout.units.len() {
            let shard = self.shard_of(grads, u)?;
            pending.push(self.start_replicate(shard, u)?);
        }
        pending
            .into_iter()
            .try_for_each(|p| self.finish_replicate(p).map(drop))
    }

    /// Issues collective `op` of unit `u` with buffers the caller holds (`input`: this rank's
    /// shard for a gather, the full gradient for a reduce-scatter; `output` the other; for a
    /// replica all-reduce `output`, reduced in place), and waits for it: a stand-in that
    /// keeps the other ranks' collectives in step. Allocates no tensor and counts nothing in
    /// flight: the buffers are the caller's.
    pub(crate) fn stand_in(
        &mut self,
        op: Collective,
        u: usize,
        input: &Tensor,
        output: &Tensor,
    ) -> Result<()> {
        let work = match op {
            Collective::Gather => self.shard.all_gather(input, output),
            Collective::ReduceScatter => self.shard.reduce_scatter(input, output, ReduceOp::Avg),
            Collective::Replicate => match &self.replica {
                Some(r) => r.all_reduce(output, ReduceOp::Avg),
                None => {
                    return Err(Error::Unsupported(
                        "a stand-in replica all-reduce without a replica group".into(),
                    ))
                }
            },
        }
        .map_err(Error::Comm)?;
        self.issued.push((op, u));
        self.timed(|| work.wait()).map_err(Error::Comm)
    }

    /// Waits for a gradient reduction (a reduce-scatter, or the replica all-reduce that
    /// followed it); returns the unit and its reduced shard (count released).
    pub(crate) fn finish_reduce_scatter(&mut self, p: Pending) -> Result<(usize, Tensor)> {
        let (u, _grad, shard) = self.timed(|| p.wait())?;
        if !self.group_of_one() {
            self.release(&shard);
        }
        Ok((u, shard))
    }

    /// Averages every unit of the full buffer `grads` over the ranks, in place (stage 0).
    pub(crate) fn all_reduce_units(&mut self, grads: &Tensor) -> Result<()> {
        let mut pending = Vec::new();
        for (u, l) in self.layout.units.iter().enumerate() {
            let g = grads
                .f_narrow(0, self.layout.full_offsets[u], l.padded)
                .ctx("slice gradients", &l.unit)?;
            pending.push(
                self.comm
                    .all_reduce(&g, ReduceOp::Avg)
                    .map_err(Error::Comm)?,
            );
        }
        self.timed(|| {
            pending
                .into_iter()
                .try_for_each(|w| w.wait().map_err(Error::Comm))
        })
    }

    /// Averages every unit of the full buffer `grads` over the ranks and writes the owned
    /// slice of each unit back in place (stage 1); the rest of the buffer is left stale.
    /// With hybrid sharding each reduced shard is all-reduced across the replica group as
    /// its reduce-scatter completes.
    pub(crate) fn reduce_scatter_units(&mut self, grads: &Tensor) -> Result<()> {
        let mut pending = Vec::new();
        for u in 0..self.layout.units.len() {
            let g = self.unit_full(grads, u)?;
            pending.push(self.start_reduce_scatter(g, u)?);
        }
        if self.replicated() {
            pending = pending
                .into_iter()
                .map(|p| self.replicate_scattered(p))
                .collect::<Result<_>>()?;
        }
        // Every reduction has read its input before any owned slice is overwritten.
        let done: Vec<(usize, Tensor)> = pending
            .into_iter()
            .map(|p| self.finish_reduce_scatter(p))
            .collect::<Result<_>>()?;
        for (u, shard) in done {
            let mut own = self.owned(grads, u)?;
            own.f_copy_(&shard)
                .ctx("store reduced gradient", &self.layout.units[u].unit)?;
        }
        Ok(())
    }

    /// Refreshes every unit of the full buffer `params` from the ranks' owned slices
    /// (stages 1-2, after the optimizer step).
    pub(crate) fn all_gather_units(&mut self, params: &Tensor) -> Result<()> {
        if self.group_of_one() {
            // A group of one owns every unit whole: the full buffer is already its own.
            return Ok(());
        }
        let mut pending = Vec::new();
        for u in 0..self.layout.units.len() {
            // A private copy of the owned slice: the output overlaps it.
            let own = self.owned(params, u)?;
            let mine = own
                .f_detach_copy()
                .ctx("copy owned slice", &self.layout.units[u].unit)?;
            let full = self.unit_full(params, u)?;
            let work = self.shard.all_gather(&mine, &full).map_err(Error::Comm)?;
            pending.push(Pending::new(work, u, mine, full));
        }
        self.timed(|| pending.into_iter().try_for_each(|p| p.wait().map(drop)))
    }

    /// Unit `u`'s padded region of a full buffer of all units.
    pub(crate) fn unit_full(&self, buf: &Tensor, u: usize) -> Result<Tensor> {
        let l = &self.layout.units[u];
        buf.f_narrow(0, self.layout.full_offsets[u], l.padded)
            .ctx("slice flat buffer", &l.unit)
    }

    /// This rank's slice of unit `u` inside a full buffer of all units.
    pub(crate) fn owned(&self, buf: &Tensor, u: usize) -> Result<Tensor> {
        let l = &self.layout.units[u];
        let (start, len) = l.shard_range(self.layout.rank);
        buf.f_narrow(0, self.layout.full_offsets[u] + start, len)
            .ctx("slice owned range", &l.unit)
    }

    /// This rank's slice of unit `u` in the compute parameters `params`: a slice of the
    /// shard buffer at stage 3, the owned range of the full buffer at the other stages.
    pub(crate) fn owned_params(&self, params: &Tensor, u: usize, stage: Stage) -> Result<Tensor> {
        match stage {
            Stage::Zero3 => self.shard_of(params, u),
            _ => self.owned(params, u),
        }
    }

    /// Unit `u`'s slice of a contiguous shard buffer.
    pub(crate) fn shard_of(&self, buf: &Tensor, u: usize) -> Result<Tensor> {
        let l = &self.layout.units[u];
        buf.f_narrow(0, self.layout.shard_offsets[u], l.shard_len())
            .ctx("slice shard", &l.unit)
    }

    /// Sum over the ranks of a local sum of squares, reduced on `device` (NCCL takes device
    /// tensors only) and read back once.
    pub(crate) fn sum_over_ranks(&mut self, local: f64, device: tch::Device) -> Result<f64> {
        if self.comm.world_size() == 1 {
            return Ok(local);
        }
        let t = Tensor::f_from_slice(&[local as f32])
            .and_then(|t| t.f_to_device(device))
            .ctx("place value to reduce", "-")?;
        let work = self
            .comm
            .all_reduce(&t, ReduceOp::Sum)
            .map_err(Error::Comm)?;
        self.timed(|| work.wait()).map_err(Error::Comm)?;
        let sum = t.f_double_value(&[0]).ctx("read reduced value", "-")?;
        self.check()?;
        Ok(sum)
    }

    /// Fails when a communicator (the world, the shard group's, the replica group's) failed
    /// since it was made: after a host read of what the collectives wrote (an aborted NCCL
    /// collective ends without finishing, silently).
    pub(crate) fn check(&self) -> Result<()> {
        // Without hybrid sharding the shard group is the world (and with groups of one, the
        // replica group is): each is checked once.
        let shard = (!Arc::ptr_eq(&self.shard, &self.comm)).then_some(&self.shard);
        let replica = self
            .replica
            .as_ref()
            .filter(|r| !Arc::ptr_eq(r, &self.comm));
        [Some(&self.comm), shard, replica]
            .into_iter()
            .flatten()
            .try_for_each(|c| c.check().map_err(Error::Comm))
    }
}

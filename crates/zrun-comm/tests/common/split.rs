//! Checks of sub-communicators ([`Communicator::split`]) shared by the tcp and mpi suites.
//!
//! Data is keyed by *world* rank (`value(members[q], i)` at rank q of a group), so a group
//! whose ranks were mapped to the wrong processes gives wrong values, not just wrong ranks.

use anyhow::{ensure, Context};
use tch::{Device, Kind, Tensor};
use zrun_comm::{chunk_offset, chunk_sizes, Communicator, ReduceOp};

use super::value;

fn tensor(vals: impl IntoIterator<Item = f64>, kind: Kind) -> Tensor {
    let v: Vec<f64> = vals.into_iter().collect();
    Tensor::from_slice(&v).to_kind(kind)
}

fn to_vec(t: &Tensor) -> anyhow::Result<Vec<f64>> {
    Ok(Vec::<f64>::try_from(&t.to_kind(Kind::Double))?)
}

/// Fails naming `what` and the first wrong element; averages get a 16-bit rounding's slack.
fn expect(what: &str, got: &Tensor, want: impl Fn(usize) -> f64) -> anyhow::Result<()> {
    for (i, g) in to_vec(got)?.into_iter().enumerate() {
        let w = want(i);
        ensure!(
            (g - w).abs() <= w.abs() / 128.0 + 1e-6,
            "{what}: element {i} is {g}, want {w}"
        );
    }
    Ok(())
}

/// The world ranks of the members of `c`, gathered through `c` itself (exact below 2^24).
pub fn members_of(c: &dyn Communicator, me: usize) -> anyhow::Result<Vec<usize>> {
    let w = c.world_size();
    let mine = Tensor::from_slice(&[me as f32]);
    let all = Tensor::zeros([w as i64], (Kind::Float, Device::Cpu));
    c.all_gather(&mine, &all)?.wait()?;
    Ok(Vec::<f32>::try_from(&all)?
        .into_iter()
        .map(|v| v as usize)
        .collect())
}

/// Every collective of group `c` (rank q is world rank `members[q]`), in fp32 and bf16, sizes
/// even and not over the group, all waited on only at the end. With `world` (when every
/// rank of the world checks a group at once), world all-reduces are queued between them.
pub fn check_group(
    c: &dyn Communicator,
    members: &[usize],
    me: usize,
    world: Option<&dyn Communicator>,
) -> anyhow::Result<()> {
    let (r, w) = (c.rank(), c.world_size());
    let ww = world.map_or(1, |x| x.world_size());
    ensure!(
        members.len() == w && members[r] == me,
        "world rank {me} is rank {r} of {w} in a group of {members:?}"
    );
    let v = |q: usize, i: usize| value(members[q], i);
    for kind in [Kind::Float, Kind::BFloat16] {
        for n in [1usize, 7, 2 * w, 300_001] {
            let what = format!("world rank {me} (rank {r} of group {members:?}) {kind:?} n={n}");
            let (sizes, off) = (chunk_sizes(n, w), chunk_offset(n, w, r));
            let owner = |i: usize| (0..w).rfind(|&q| chunk_offset(n, w, q) <= i).unwrap_or(0);
            let world_t = |k: usize| tensor((0..5).map(|i| value(me, i + k)), Kind::Float);
            let world_sum = |t: &Tensor| match world {
                Some(x) => x.all_reduce(t, ReduceOp::Sum),
                None => Ok(zrun_comm::Work::ready()),
            };
            let sum_world = |k: usize| {
                move |i: usize| match world {
                    Some(_) => (0..ww).map(|q| value(q, i + k)).sum::<f64>(),
                    None => value(me, i + k),
                }
            };

            let shard = tensor((off..off + sizes[r]).map(|i| v(r, i)), kind);
            let gathered = Tensor::full([n as i64], 99.0, (kind, Device::Cpu));
            let g = c.all_gather(&shard, &gathered)?;
            let w1 = world_t(1);
            let a1 = world_sum(&w1)?;
            let full = tensor((0..n).map(|i| v(r, i)), kind);
            let out = Tensor::full([sizes[r] as i64], 99.0, (kind, Device::Cpu));
            let rs = c.reduce_scatter(&full, &out, ReduceOp::Sum)?;
            let avg = tensor((0..n).map(|i| v(r, i)), kind);
            let ar = c.all_reduce(&avg, ReduceOp::Avg)?;
            let w2 = world_t(2);
            let a2 = world_sum(&w2)?;
            let root = w - 1;
            let b = tensor((0..n).map(|i| v(r, i)), kind);
            let bc = c.broadcast(&b, root)?;
            let bar = c.barrier()?;
            for (work, op) in [
                (g, "all_gather"),
                (a1, "world all_reduce"),
                (rs, "reduce_scatter"),
            ]
            .into_iter()
            .chain([(ar, "all_reduce"), (a2, "world all_reduce")])
            .chain([(bc, "broadcast"), (bar, "barrier")])
            {
                work.wait().with_context(|| format!("{what}: {op}"))?;
            }
            let sum = |i: usize| (0..w).map(|q| v(q, i)).sum::<f64>();
            expect(&format!("{what} all_gather"), &gathered, |i| v(owner(i), i))?;
            expect(&format!("{what} reduce_scatter"), &out, |j| sum(off + j))?;
            expect(&format!("{what} all_reduce avg"), &avg, |i| {
                sum(i) / w as f64
            })?;
            expect(&format!("{what} broadcast"), &b, |i| v(root, i))?;
            expect(&format!("{what} world all_reduce"), &w1, sum_world(1))?;
            expect(&format!("{what} world all_reduce"), &w2, sum_world(2))?;
        }
    }
    Ok(())
}

/// A group of one: rank 0 of 1, collectives are copies (a reduce-scatter writes its output),
/// and it splits into a group of one again.
pub fn check_alone(c: &dyn Communicator) -> anyhow::Result<()> {
    ensure!(
        (c.rank(), c.world_size()) == (0, 1),
        "a group of one is rank {} of {}",
        c.rank(),
        c.world_size()
    );
    let full = tensor((0..5).map(|i| i as f64), Kind::Float);
    let out = Tensor::full([5], 99.0, (Kind::Float, Device::Cpu));
    c.reduce_scatter(&full, &out, ReduceOp::Avg)?.wait()?;
    expect("alone reduce_scatter", &out, |i| i as f64)?;
    let gathered = Tensor::full([5], 99.0, (Kind::Float, Device::Cpu));
    c.all_gather(&full, &gathered)?.wait()?;
    expect("alone all_gather", &gathered, |i| i as f64)?;
    c.all_reduce(&out, ReduceOp::Sum)?.wait()?;
    c.broadcast(&out, 0)?.wait()?;
    c.barrier()?.wait()?;
    expect("alone all_reduce", &out, |i| i as f64)?;
    let again = c.split(3, 0)?;
    ensure!(again.world_size() == 1, "a group of one split into more");
    Ok(())
}

/// The hybrid-sharding pattern on a world of `2 * g` or more ranks split into shard groups of
/// `g` consecutive ranks (color `r / g`) and replica groups (color `r % g`): a reduce-scatter
/// (average) in the shard group followed by an all-reduce (average) in the replica group
/// gives this rank's chunk of the average over the whole world.
pub fn check_hybrid(
    shard: &dyn Communicator,
    replica: &dyn Communicator,
    world: &dyn Communicator,
) -> anyhow::Result<()> {
    let (me, w, g) = (world.rank(), world.world_size(), shard.world_size());
    let n = 1003;
    let full = tensor((0..n).map(|i| value(me, i)), Kind::Float);
    let r = shard.rank();
    let part = Tensor::zeros([chunk_sizes(n, g)[r] as i64], (Kind::Float, Device::Cpu));
    shard.reduce_scatter(&full, &part, ReduceOp::Avg)?.wait()?;
    replica.all_reduce(&part, ReduceOp::Avg)?.wait()?;
    let off = chunk_offset(n, g, r);
    let mean = |j: usize| (0..w).map(|q| value(q, off + j)).sum::<f64>() / w as f64;
    expect(&format!("world rank {me} hybrid reduce"), &part, mean)
}

/// Shard groups `{0, 1}, {2, 3}` (color `r / 2`) and replica groups `{0, 2}, {1, 3}` (color
/// `r % 2`) of a world of 4; a group split off a group (same members, ops interleaved with
/// its parent's); a key that reverses the order; a group of three beside a group of one;
/// every rank alone. World collectives in between.
pub fn check_splits(world: &dyn Communicator) -> anyhow::Result<()> {
    let (me, w) = (world.rank(), world.world_size());
    ensure!(w == 4, "the split checks want a world of 4, not {w}");
    let shard = world.split(me / 2, me)?;
    let replica = world.split(me % 2, me)?;
    let pair = |a: usize| vec![a, a + 1];
    check_group(shard.as_ref(), &pair(me / 2 * 2), me, Some(world))?;
    check_group(replica.as_ref(), &[me % 2, me % 2 + 2], me, Some(world))?;
    check_hybrid(shard.as_ref(), replica.as_ref(), world)?;

    // a group of a group: the same members, its own order of messages
    let inner = shard.split(0, shard.rank())?;
    ensure!(members_of(inner.as_ref(), me)? == pair(me / 2 * 2));
    let (a, b) = (
        Tensor::ones([3], (Kind::Float, Device::Cpu)),
        Tensor::ones([3], (Kind::Float, Device::Cpu)),
    );
    let (wa, wb) = (
        inner.all_reduce(&a, ReduceOp::Sum)?,
        shard.all_reduce(&b, ReduceOp::Sum)?,
    );
    wa.wait()?;
    wb.wait()?;
    expect("inner all_reduce", &a, |_| 2.0)?;
    expect("shard all_reduce after inner", &b, |_| 2.0)?;
    check_group(inner.as_ref(), &pair(me / 2 * 2), me, Some(world))?;

    // the key orders the group: reversed
    let reversed = world.split(0, w - 1 - me)?;
    ensure!(
        reversed.rank() == w - 1 - me,
        "reversed rank {}",
        reversed.rank()
    );
    check_group(reversed.as_ref(), &[3, 2, 1, 0], me, Some(world))?;

    // three ranks (keys reversing them) and one alone, which meanwhile issues nothing
    let odd = world.split(usize::from(me == 3), w - me)?;
    if me == 3 {
        check_alone(odd.as_ref())?;
    } else {
        check_group(odd.as_ref(), &[2, 1, 0], me, None)?;
    }
    // everyone alone
    let alone = world.split(me, 0)?;
    check_alone(alone.as_ref())?;
    world.barrier()?.wait()?;
    Ok(())
}

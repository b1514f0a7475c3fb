//! The caching CPU allocator: a training loop's reserved bytes and fresh pages stop growing
//! after its first steps; a request past the limit fails catchably with its size; threads
//! allocating and freeing at once leave the books balanced. Alone in its own test binary
//! (installing a CPU allocator is process-wide); the tests take turns (one lock), since each
//! reads the process-wide figures.

zrun_torch_ext::end_tests_without_destructors!();

use std::sync::Mutex;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use zrun_torch_ext::{
    cpu_empty_cache, cpu_memory_stats, install_cpu_caching_allocator, reset_cpu_peak,
    CpuMemoryStats,
};

static TURN: Mutex<()> = Mutex::new(());

fn stats() -> anyhow::Result<CpuMemoryStats> {
    cpu_memory_stats().ok_or_else(|| anyhow::anyhow!("the caching allocator is not installed"))
}

#[test]
fn a_training_loop_takes_no_fresh_pages_after_warm_up() -> anyhow::Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    install_cpu_caching_allocator(None)?;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root();
    // Weights 256 KiB-1 MiB, activations 128-512 KiB: every block comes from the arena.
    let model = nn::seq()
        .add(nn::linear(&p / "a", 256, 512, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(&p / "b", 512, 256, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(&p / "c", 256, 64, Default::default()));
    let mut opt = nn::AdamW::default().build(&vs, 1e-3)?;
    let x = Tensor::f_randn([128, 256], (Kind::Float, Device::Cpu))?;
    let y = Tensor::f_randn([128, 64], (Kind::Float, Device::Cpu))?;
    let mut step = || -> anyhow::Result<f64> {
        let loss = model.forward(&x).f_mse_loss(&y, tch::Reduction::Mean)?;
        opt.backward_step(&loss);
        Ok(loss.double_value(&[]))
    };
    let start = stats()?;
    for _ in 0..5 {
        step()?;
    }
    let warm = stats()?;
    assert!(
        warm.fresh > start.fresh,
        "the loop's tensors do not come from the caching allocator: {start:?} -> {warm:?}"
    );
    reset_cpu_peak();
    let first = step()?;
    let mut last = first;
    for _ in 0..20 {
        last = step()?;
    }
    assert!(last < first, "the loop trains: loss {first} -> {last}");
    let end = stats()?;
    assert_eq!(
        end.fresh, warm.fresh,
        "no fresh pages after warm-up: {warm:?} -> {end:?}"
    );
    assert_eq!(end.reserved, warm.reserved, "reserved stops growing");
    assert!(
        end.peak_reserved <= warm.peak_reserved,
        "steady steps reserve no more than the warm-up did: {warm:?} -> {end:?}"
    );
    assert!(
        end.peak_allocated > end.allocated,
        "the step's temporaries: {end:?}"
    );
    Ok(())
}

#[test]
fn past_the_limit_a_request_fails_catchably_and_the_cache_is_returned_first() -> anyhow::Result<()>
{
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    install_cpu_caching_allocator(None)?;
    const MIB: u64 = 1 << 20;
    let opts = (Kind::Float, Device::Cpu);
    let base = stats()?.allocated;
    install_cpu_caching_allocator(Some(base + 64 * MIB))?;

    // 40 MiB cached (a live 1 MiB after it, so the free block cannot simply grow), then
    // 48 MiB: over the limit with the cache, under it without.
    let a = Tensor::f_ones([(40 * MIB / 4) as i64], opts)?;
    let pin = Tensor::f_ones([(MIB / 4) as i64], opts)?;
    drop(a);
    let cached = stats()?;
    assert!(cached.reserved >= base + 41 * MIB, "{cached:?}");
    let b = Tensor::f_ones([(48 * MIB / 4) as i64], opts)?;
    let after = stats()?;
    assert!(
        after.returned > cached.returned,
        "cache returned: {after:?}"
    );
    assert!(after.reserved <= base + 64 * MIB, "{after:?}");

    let too_big = 32 * MIB; // 1 + 48 + 32 > 64
    let e = Tensor::f_empty([(too_big / 4) as i64], opts)
        .err()
        .ok_or_else(|| anyhow::anyhow!("a request past the limit succeeded"))?
        .to_string();
    assert!(e.contains("out of memory"), "{e}");
    assert!(
        e.contains(&format!("tried to allocate {too_big} bytes")),
        "the message names the request: {e}"
    );
    assert!(e.contains("dist.memory_limit"), "{e}");
    // The process goes on; what fits still works.
    let small = Tensor::f_full([(8 * MIB / 4) as i64], 1.5, opts)?; // 1 + 48 + 8 <= 64
    assert_eq!(
        small.f_sum(Kind::Float)?.double_value(&[]),
        1.5 * (2 * MIB) as f64
    );
    drop((b, small, pin));
    install_cpu_caching_allocator(None)?;
    assert_eq!(stats()?.limit, None);
    let big = Tensor::f_empty([(too_big / 4) as i64], opts)?; // no limit: fine
    drop(big);
    cpu_empty_cache();
    let empty = stats()?;
    // Nothing cached: reserved is what live tensors hold (heap blocks counted in both).
    assert_eq!(empty.reserved, empty.allocated, "{empty:?}");
    Ok(())
}

#[test]
fn threads_allocating_and_freeing_at_once_leave_the_books_balanced() -> anyhow::Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    install_cpu_caching_allocator(None)?;
    let before = stats()?;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            std::thread::spawn(move || -> anyhow::Result<Vec<Tensor>> {
                let mut rng = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(t + 1);
                let mut ring: Vec<Tensor> = Vec::new();
                for i in 0..10_000usize {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    // 4 B to 512 KiB: both the heap path and the arena.
                    let numel = 1 + (rng % (128 << 10)) as i64;
                    let x = Tensor::f_empty([numel], (Kind::Float, Device::Cpu))?;
                    let _ = x.narrow(0, numel - 1, 1).f_fill_(i as f64)?;
                    if ring.len() < 8 {
                        ring.push(x);
                    } else {
                        ring[i % 8] = x;
                    }
                }
                Ok(ring) // freed by the main thread
            })
        })
        .collect();
    let mut kept = Vec::new();
    for t in threads {
        kept.extend(
            t.join()
                .map_err(|_| anyhow::anyhow!("a thread panicked"))??,
        );
    }
    let during = stats()?;
    assert!(during.allocated > before.allocated, "{during:?}");
    drop(kept);
    let after = stats()?;
    assert_eq!(after.allocated, before.allocated, "{before:?} -> {after:?}");
    assert!(after.peak_allocated >= during.allocated);
    Ok(())
}

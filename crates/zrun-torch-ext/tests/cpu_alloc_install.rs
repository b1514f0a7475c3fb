//! Tensors made by c10's default CPU allocator before the caching allocator is installed are
//! freed by their own deleter after it (the caching allocator's figures do not move), and
//! libtorch's profiler hook still sees the caching allocator's blocks. Alone in its own test
//! binary: installing a CPU allocator is process-wide.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_torch_ext::{count_allocations, cpu_memory_stats, install_cpu_caching_allocator};

#[test]
fn tensors_from_before_installation_are_freed_safely_after_it() -> anyhow::Result<()> {
    let opts = (Kind::Float, Device::Cpu);
    // Large (mapped by glibc) and small (from its heap), and a view that outlives its base.
    let big = Tensor::f_full([4 << 20], 2.0, opts)?;
    let small = Tensor::f_full([100], 3.0, opts)?;
    let view = big.narrow(0, 1 << 20, 1 << 20);
    assert_eq!(cpu_memory_stats(), None, "not installed yet");

    install_cpu_caching_allocator(None)?;
    let before = cpu_memory_stats().ok_or_else(|| anyhow::anyhow!("not installed"))?;
    let fresh = Tensor::f_full([4 << 20], 5.0, opts)?;
    let with = cpu_memory_stats().ok_or_else(|| anyhow::anyhow!("not installed"))?;
    assert_eq!(
        with.allocated - before.allocated,
        16 << 20,
        "a new tensor comes from the caching allocator"
    );

    drop(big);
    drop(small);
    assert_eq!(view.double_value(&[(1 << 20) - 1]), 2.0);
    drop(view); // the default allocator's block goes back to it here
    let after = cpu_memory_stats().ok_or_else(|| anyhow::anyhow!("not installed"))?;
    assert_eq!(
        after.allocated, with.allocated,
        "freeing old tensors does not touch the caching allocator's books"
    );
    assert_eq!(fresh.double_value(&[(4 << 20) - 1]), 5.0);
    drop(fresh);
    let freed = cpu_memory_stats().ok_or_else(|| anyhow::anyhow!("not installed"))?;
    assert_eq!(freed.allocated, before.allocated);
    assert_eq!(
        freed.reserved, with.reserved,
        "the freed block stays cached"
    );

    // The profiler's hook sees blocks of every size, as with the default allocator.
    let (t, n) = count_allocations(|| Tensor::ones([250], opts))?;
    assert_eq!((n.count, n.bytes), (1, 1000));
    let (u, m) = count_allocations(|| Tensor::ones([1 << 20], opts))?;
    assert_eq!((m.count, m.bytes), (1, 4 << 20));
    drop((t, u));
    Ok(())
}

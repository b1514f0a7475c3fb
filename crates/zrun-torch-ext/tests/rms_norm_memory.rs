//! What `rms_norm`'s graph holds, measured with the caching CPU allocator zrun's ranks run on:
//! its output and one fp32 rstd per row, where ATen's composite `rms_norm` keeps two fp32
//! copies of the input besides. Alone in its own test binary: installing a CPU allocator is
//! process-wide.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_torch_ext::{cpu_memory_stats, install_cpu_caching_allocator, rms_norm};

fn allocated() -> i64 {
    cpu_memory_stats().expect("installed").allocated as i64
}

#[test]
fn the_graph_holds_the_output_and_an_rstd_per_row() {
    install_cpu_caching_allocator(None).unwrap();
    let (rows, c) = (512i64, 1024i64);
    let x = Tensor::randn([rows, c], (Kind::BFloat16, Device::Cpu)).set_requires_grad(true);
    let w = Tensor::ones([c], (Kind::BFloat16, Device::Cpu)).set_requires_grad(true);
    let out = rows * c * 2;
    let before = allocated();
    let y = rms_norm(&x, &w, 1e-5).unwrap();
    let ours = allocated() - before;
    drop(y);
    let before = allocated();
    let y = x.rms_norm([c], Some(&w), 1e-5);
    let aten = allocated() - before;
    drop(y);
    eprintln!("held after the forward: {ours} bytes, ATen's composite {aten}, output {out}");
    // The output, the rstd (rows x 4), allocator blocks rounded up a little.
    assert!(ours <= out + rows * 4 + (64 << 10), "{ours}");
    // ATen's composite: the output, an fp32 copy of x and the fp32 normalised x.
    assert!(aten >= out + 2 * rows * c * 4, "{aten}");
}

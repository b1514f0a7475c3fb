//! What `swiglu`'s graph holds, measured with the caching CPU allocator zrun's ranks run on:
//! its two inputs and its output, where autograd's silu-then-mul also keeps silu(gate). Alone
//! in its own test binary: installing a CPU allocator is process-wide.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_torch_ext::{cpu_memory_stats, install_cpu_caching_allocator, swiglu};

fn allocated() -> i64 {
    cpu_memory_stats().expect("installed").allocated as i64
}

#[test]
fn the_graph_holds_gate_up_and_the_output() {
    install_cpu_caching_allocator(None).unwrap();
    let n = 1i64 << 20;
    let bytes = n * 2;
    let x = Tensor::randn([n], (Kind::BFloat16, Device::Cpu)).set_requires_grad(true);
    let held = |ours: bool| {
        let before = allocated();
        // gate and up as the MLP's projections make them: outputs of ops, which only the
        // graph keeps once the forward has moved on.
        let (gate, up) = (&x * 2.0, &x * 3.0);
        let y = if ours {
            swiglu(&gate, &up).unwrap()
        } else {
            gate.silu() * &up
        };
        drop((gate, up));
        let held = allocated() - before;
        drop(y);
        held
    };
    let (ours, autograd) = (held(true), held(false));
    eprintln!("held after the forward: {ours} bytes, silu-then-mul {autograd}, one tensor {bytes}");
    assert_eq!(ours, 3 * bytes, "gate, up and the output");
    assert_eq!(autograd, 4 * bytes, "gate, silu(gate), up and the output");
}

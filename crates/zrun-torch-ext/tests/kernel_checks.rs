//! The kernels' checks (`kernels::check_all`) on CPU, where both sides run ATen's ops: what a
//! GPU run meets but for the kernels (shapes, dtypes, targets and weights), and that they draw
//! from no random generator (a check at start must not move a run's random streams). Alone in
//! its own test binary: the generator is process-wide.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_torch_ext::kernels;

#[test]
fn the_checks_run_and_leave_the_generators_alone() {
    tch::manual_seed(9);
    let want = Tensor::randn([4], (Kind::Float, Device::Cpu));
    tch::manual_seed(9);
    kernels::check_all(Device::Cpu).unwrap();
    let got = Tensor::randn([4], (Kind::Float, Device::Cpu));
    assert!(got.equal(&want));
}

//! Saving and restoring the default generators' state: the draws after a restore are bitwise
//! those after the save. Alone in its own test binary, and all in one test, since the default
//! generators are global and tests run on parallel threads.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Cuda, Device, Kind, Tensor};
use zrun_torch_ext::{rng, Error};

/// One draw of the kinds a training step makes: normal (Box-Muller, short and vectorised
/// paths) and uniform, as a dropout mask is drawn.
fn draw(device: Device) -> anyhow::Result<Vec<Tensor>> {
    Ok(vec![
        Tensor::f_randn([7], (Kind::Float, device))?,
        Tensor::f_randn([64, 33], (Kind::Double, device))?,
        Tensor::f_rand([100], (Kind::Float, device))?,
    ])
}

fn same(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.equal(y))
}

/// Save, draw A, draw B, restore: the next draws are A then B again, bitwise; and a state
/// saved after `manual_seed(1)` restores that stream after other draws.
fn round_trip(device: Device) -> anyhow::Result<()> {
    tch::manual_seed(1234);
    let _ = draw(device)?;
    let saved = rng::state(device)?;
    assert!(!saved.is_empty());
    let a = draw(device)?;
    let b = draw(device)?;
    assert!(!same(&a, &b), "{device:?}: two draws should differ");
    rng::set_state(device, &saved)?;
    assert_eq!(rng::state(device)?, saved, "{device:?}: state reads back");
    assert!(
        same(&draw(device)?, &a),
        "{device:?}: first draw after restore is A"
    );
    assert!(
        same(&draw(device)?, &b),
        "{device:?}: second draw after restore is B"
    );

    tch::manual_seed(1);
    let seeded = rng::state(device)?;
    let first = draw(device)?;
    tch::manual_seed(99);
    let _ = draw(device)?;
    rng::set_state(device, &seeded)?;
    assert!(
        same(&draw(device)?, &first),
        "{device:?}: the manual_seed(1) stream"
    );
    tch::manual_seed(1);
    assert!(
        same(&draw(device)?, &first),
        "{device:?}: as manual_seed(1) itself gives"
    );
    Ok(())
}

/// Truncated, empty, corrupt and another generator's states are errors naming the device, and
/// leave the generator as it was.
fn bad_states(device: Device, other_kind_state: &[u8]) -> anyhow::Result<()> {
    let good = rng::state(device)?;
    let (name, corrupt) = match device {
        // A Mersenne Twister state whose `seeded` and `left` are 0: invalid.
        Device::Cpu => ("cpu".to_string(), vec![0u8; good.len()]),
        // Seed, then a Philox offset that is not a multiple of 4: libtorch sets the seed
        // before it rejects the offset, so this also checks that the shim puts it back.
        Device::Cuda(i) => {
            let mut s = good.clone();
            s[0] ^= 0x5a;
            s[8..].copy_from_slice(&1i64.to_le_bytes());
            (format!("cuda:{i}"), s)
        }
        other => anyhow::bail!("no bad states for {other:?}"),
    };
    let cases: [(&str, &[u8]); 4] = [
        ("truncated", &good[..good.len() - 1]),
        ("empty", &[]),
        ("corrupt", &corrupt),
        ("other generator", other_kind_state),
    ];
    for (what, bytes) in cases {
        match rng::set_state(device, bytes) {
            Err(Error::Torch { op, message }) => {
                assert!(op.contains(&name), "{what}: {op}");
                assert!(message.contains(&name), "{what}: {message}");
                assert!(
                    message.contains("another libtorch version"),
                    "{what}: {message}"
                );
            }
            other => panic!("{name} {what}: expected Error::Torch, got {other:?}"),
        }
        assert_eq!(
            rng::state(device)?,
            good,
            "{name} {what}: generator unchanged"
        );
    }
    Ok(())
}

#[test]
fn restore_replays_the_draws_and_bad_states_are_errors() -> anyhow::Result<()> {
    round_trip(Device::Cpu)?;
    if Cuda::is_available() {
        round_trip(Device::Cuda(0))?;
        let cpu = rng::state(Device::Cpu)?;
        let cuda = rng::state(Device::Cuda(0))?;
        bad_states(Device::Cpu, &cuda)?;
        bad_states(Device::Cuda(0), &cpu)?;
        let past = Cuda::device_count() as usize;
        match rng::state(Device::Cuda(past)) {
            Err(Error::Refused { reason, .. }) => assert!(reason.contains("does not exist")),
            other => panic!("cuda:{past}: expected Refused, got {other:?}"),
        }
    } else {
        // What a CUDA generator's state looks like (seed, offset: 16 bytes).
        bad_states(Device::Cpu, &[0u8; 16])?;
        for result in [
            rng::state(Device::Cuda(0)).map(drop),
            rng::set_state(Device::Cuda(0), &[0u8; 16]),
        ] {
            match result {
                Err(Error::Refused { op, reason }) => {
                    assert!(op.contains("cuda:0"), "{op}");
                    assert!(reason.contains("cuda:0"), "{reason}");
                    assert!(reason.contains("CUDA is not available"), "{reason}");
                }
                other => panic!("cuda:0 without CUDA: expected Refused, got {other:?}"),
            }
        }
    }
    Ok(())
}

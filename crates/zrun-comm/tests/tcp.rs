//! The `tcp` backend in real processes: both transports (cross-memory on one host, and the
//! socket ring), world sizes 2-4, dead and stuck peers, wrong tokens.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use common::{assert_all_ok, is_worker, spawn_ranks, worker};
use tch::{Device, Kind, Tensor};
use zrun_comm::{init, Backend, ReduceOp, Topology, CMA_ENV};

const LIMIT: Duration = Duration::from_secs(120);

fn collectives() {
    worker(|| {
        let topo = Topology::from_env()?;
        let c = init(&topo, Backend::Tcp, Duration::from_secs(30))?;
        common::check_collectives(c.as_ref()).unwrap_or_else(|e| common::fail_now(e));
        Ok(())
    });
}

macro_rules! collective_test {
    ($name:ident, $world:expr, $cma:expr) => {
        #[test]
        fn $name() {
            if is_worker(stringify!($name)) {
                return collectives();
            }
            let outs = spawn_ranks(stringify!($name), $world, &[(CMA_ENV, $cma)], LIMIT);
            assert_all_ok(stringify!($name), &outs);
        }
    };
}

collective_test!(ring_world2_every_collective_and_dtype, 2, "0");
collective_test!(ring_world3_every_collective_and_dtype, 3, "0");
collective_test!(ring_world4_every_collective_and_dtype, 4, "0");
collective_test!(cma_world2_every_collective_and_dtype, 2, "1");
collective_test!(cma_world3_every_collective_and_dtype, 3, "1");
collective_test!(cma_world4_every_collective_and_dtype, 4, "1");

/// Ranks 0 and 1 loop over all-reduces; rank 2 dies 300 ms into them (`victim` = kill) or
/// never joins while staying alive past the deadline (`victim` = hang). The survivors must fail within the deadline, naming
/// themselves, the op and the bytes.
fn lost_peer(victim: &'static str) {
    worker(|| {
        let topo = Topology::from_env()?;
        let timeout = Duration::from_secs(2);
        let c = init(&topo, Backend::Tcp, timeout)?;
        let n = 4 << 20;
        let t = Tensor::ones([n], (Kind::Float, Device::Cpu));
        if topo.rank == 2 {
            if victim == "hang" {
                // Alive but silent past the survivors' deadline.
                std::thread::sleep(timeout + Duration::from_secs(4));
                return Ok(());
            }
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: sends SIGKILL to this very process.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            });
        }
        let start = Instant::now();
        let mut last_ok = start;
        for _ in 0..10_000 {
            let w = c.all_reduce(&t, ReduceOp::Sum)?;
            match w.wait() {
                Ok(()) => last_ok = Instant::now(),
                Err(e) => {
                    let waited = last_ok.elapsed();
                    let msg = e.to_string();
                    let bytes = format!("all_reduce of {} bytes", n * 4);
                    let me = format!("rank {}", topo.rank);
                    if !(msg.contains(&me) && msg.contains(&bytes) && msg.contains("peer rank")) {
                        bail!("error does not name rank, op, bytes and peer: {msg}");
                    }
                    if victim == "hang"
                        && topo.rank == 0
                        && !msg.contains("peer rank 2 did not answer")
                    {
                        bail!("rank 0 should time out on the silent rank 2: {msg}");
                    }
                    if waited > timeout + Duration::from_secs(3) {
                        bail!("failed only after {waited:?} (deadline {timeout:?}): {msg}");
                    }
                    // A later collective is refused at once.
                    let again = c.barrier()?.wait().err().context("barrier after failure")?;
                    if !again.to_string().contains("unusable") {
                        bail!("second failure is not a poisoned error: {again}");
                    }
                    println!(
                        "rank {} failed as expected after {waited:?}: {msg}",
                        topo.rank
                    );
                    return Ok(());
                }
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!("no failure 20 s after the peer was lost");
            }
        }
        bail!("all collectives succeeded although rank 2 was lost")
    });
}

fn check_survivors(name: &str, outs: &[common::Outcome]) {
    for (r, o) in outs.iter().enumerate().take(2) {
        assert_eq!(o.code, Some(0), "{name}: rank {r} output:\n{}", o.output);
        let line = o.output.lines().find(|l| l.contains("failed as expected"));
        assert!(line.is_some(), "{}", o.output);
        println!("{}", line.unwrap_or_default());
    }
}

macro_rules! lost_peer_test {
    ($name:ident, $victim:expr, $cma:expr) => {
        #[test]
        fn $name() {
            if is_worker(stringify!($name)) {
                return lost_peer($victim);
            }
            let outs = spawn_ranks(stringify!($name), 3, &[(CMA_ENV, $cma)], LIMIT);
            check_survivors(stringify!($name), &outs);
        }
    };
}

lost_peer_test!(
    ring_killed_peer_fails_the_others_within_the_deadline,
    "kill",
    "0"
);
lost_peer_test!(
    cma_killed_peer_fails_the_others_within_the_deadline,
    "kill",
    "1"
);
lost_peer_test!(ring_silent_peer_times_out_naming_it, "hang", "0");
lost_peer_test!(cma_silent_peer_times_out_naming_it, "hang", "1");

#[test]
fn rank_with_a_wrong_token_is_refused() {
    const NAME: &str = "rank_with_a_wrong_token_is_refused";
    if is_worker(NAME) {
        return worker(|| {
            let topo = Topology::from_env()?;
            match init(&topo, Backend::Tcp, Duration::from_secs(5)) {
                Ok(_) => bail!("connected with a wrong token"),
                Err(e) if e.to_string().contains("wrong job token") => Ok(()),
                Err(e) => bail!("unexpected error: {e}"),
            }
        });
    }
    let outs = spawn_ranks(NAME, 2, &[("ZRUN_JOB_TOKEN", "not-the-token")], LIMIT);
    assert_all_ok(NAME, &outs);
}

/// A restarted group meets on the launcher's store, which outlives the rounds: in round 0
/// rank 1 dies before it connects while rank 0 gives up waiting for it; in round 1 both
/// connect (before the count of communicators was kept per round, rank 0 looked for its
/// peers under the job's second communicator and rank 1 under the first, until the timeout).
#[test]
fn a_restarted_group_connects_after_a_rank_died_before_connecting() {
    const NAME: &str = "a_restarted_group_connects_after_a_rank_died_before_connecting";
    if is_worker(NAME) {
        return worker(|| {
            let topo = Topology::from_env()?;
            let round = zrun_comm::restart_round();
            match init(
                &topo,
                Backend::Tcp,
                Duration::from_secs(if round == 0 { 1 } else { 20 }),
            ) {
                Err(e) if round == 0 => {
                    anyhow::ensure!(
                        e.to_string()
                            .contains("rank 0: rank 1 (1 of 2) did not join"),
                        "{e}"
                    );
                    Ok(())
                }
                Err(e) => Err(e.into()),
                Ok(c) if round == 0 => bail!("connected without rank 1 ({})", c.world_size()),
                Ok(c) => {
                    let t = Tensor::ones([8], (Kind::Float, Device::Cpu));
                    c.all_reduce(&t, ReduceOp::Sum)?.wait()?;
                    anyhow::ensure!(t.double_value(&[0]) == 2.0, "sum {t}");
                    Ok(())
                }
            }
        });
    }
    let token = common::test_token();
    let server = zrun_comm::StoreServer::start("127.0.0.1:0", &token).expect("store");
    let first = common::spawn_on(&server, &token, NAME, &[0], 2, &[], LIMIT);
    assert_all_ok(NAME, &first);
    let env = [("TORCHELASTIC_RESTART_COUNT", "1")];
    let second = common::spawn_on(&server, &token, NAME, &[0, 1], 2, &env, LIMIT);
    assert_all_ok(NAME, &second);
}

#[test]
fn single_rank_needs_no_store() {
    let c = init(&Topology::single(), Backend::Tcp, Duration::from_secs(1)).unwrap();
    assert_eq!((c.rank(), c.world_size()), (0, 1));
    let shard = Tensor::arange(3, (Kind::Float, Device::Cpu));
    let full = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    c.all_gather(&shard, &full).unwrap().wait().unwrap();
    assert_eq!(Vec::<f32>::try_from(&full).unwrap(), vec![0., 1., 2.]);
}

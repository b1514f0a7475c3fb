//! Real multi-process jobs for the trainer's tests: the test binary re-executes itself once
//! per rank (with `ROLE=rank`), and the child runs the test's ignored entry function as one
//! rank of a tcp job whose rendezvous store this process hosts. Also the files such a job
//! leaves: per-step figures from metrics.jsonl and the final parameters rank 0 writes.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zrun_comm::{Backend, Communicator, StoreServer, Topology};

#[path = "../../../../tests/scratch.rs"]
mod scratch;
pub use scratch::Scratch;

/// Set to `rank` in the processes [`spawn_ranks`] starts.
pub const ROLE: &str = "ZRUN_TEST_ROLE";

/// A fresh scratch directory (see [`Scratch`]).
pub fn scratch(prefix: &str, name: &str) -> Scratch {
    Scratch::fresh(
        std::env::temp_dir().join(format!("zrun-{prefix}-{}-{name}", std::process::id())),
    )
}

/// Whether this process is a rank started by [`spawn_ranks`].
pub fn is_rank() -> bool {
    std::env::var(ROLE).as_deref() == Ok("rank")
}

/// Ends a rank process: exit 0 after `result` succeeded, else its error printed and exit 3.
/// Without libtorch's static destructors, as zrun's own ranks end (everything the rank
/// wrote was closed when its owners dropped).
pub fn end_rank(result: anyhow::Result<()>) -> ! {
    if let Err(e) = result {
        let rank = std::env::var("RANK").unwrap_or_default();
        eprintln!("rank {rank} failed: {e:#}");
        zrun_torch_ext::quick_exit(3);
    }
    zrun_torch_ext::quick_exit(0)
}

/// This rank's communicator over tcp, from the environment [`spawn_ranks`] set.
pub fn rank_comm() -> Arc<dyn Communicator> {
    let topo = Topology::from_env().unwrap();
    Arc::from(zrun_comm::init(&topo, Backend::Tcp, Duration::from_secs(60)).unwrap())
}

/// Runs `world` ranks of this test binary, each running the ignored test `entry` with
/// `env`, and waits for them; panics with a failing rank's output.
pub fn spawn_ranks(entry: &str, name: &str, world: usize, env: &[(&str, String)]) {
    let token = format!("t-{}-{name}", std::process::id());
    let store = StoreServer::start("127.0.0.1:0", &token).unwrap();
    let mut children = Vec::new();
    for rank in 0..world {
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                entry,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, "rank")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", store.port().to_string())
            .env("ZRUN_JOB_TOKEN", &token)
            .env("ZRUN_STORE_EXTERNAL", "1")
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        children.push(child);
    }
    let start = Instant::now();
    for (rank, mut c) in children.into_iter().enumerate() {
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                let out = c.wait_with_output().unwrap();
                assert!(
                    status.success(),
                    "{name}: rank {rank} failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                break;
            }
            if start.elapsed() > Duration::from_secs(240) {
                let _ = c.kill();
                panic!("{name}: rank {rank} still running after 240 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Writes `params` (name, tensor) to `dir/params.bin`: per parameter the name length, the
/// name, the element count and the f32 values.
pub fn write_params(dir: &Path, params: Vec<(String, tch::Tensor)>) -> anyhow::Result<()> {
    let mut out = Vec::new();
    for (name, t) in params {
        let v = Vec::<f32>::try_from(t.flatten(0, -1))?;
        out.extend((name.len() as u64).to_le_bytes());
        out.extend(name.as_bytes());
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    }
    std::fs::write(dir.join("params.bin"), out)?;
    Ok(())
}

/// Reads what [`write_params`] wrote.
pub fn read_params(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("params.bin")).unwrap();
    let (mut at, mut params) = (0usize, Vec::new());
    let u64_at = |at: &mut usize| {
        let v = u64::from_le_bytes(bytes[*at..*at + 8].try_into().unwrap()) as usize;
        *at += 8;
        v
    };
    while at < bytes.len() {
        let n = u64_at(&mut at);
        let name = String::from_utf8(bytes[at..at + n].to_vec()).unwrap();
        at += n;
        let k = u64_at(&mut at);
        let v = bytes[at..at + 4 * k]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        at += 4 * k;
        params.push((name, v));
    }
    params
}

/// Column `key` of every line of `dir/metrics.jsonl`, with its step.
pub fn metric(dir: &Path, key: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|l| (l["step"].as_u64().unwrap(), l[key].as_f64().unwrap()))
        .collect()
}

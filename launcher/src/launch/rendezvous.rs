//! The store that node 0's launcher hosts, and how the launchers of several nodes meet,
//! number their ranks, learn of each other's failures and finish together.
//!
//! Keys (all under `zrun/launcher/`): `claim/K` (a counter, so a node rank used twice is
//! caught), `nproc/K` (ranks on node K), `beat/K` (node K's heartbeat counter), `failures`
//! (a counter: the first to increment it writes `failure`, the message every node prints),
//! and `exit/K` (node K's ranks all finished).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use zrun_comm::{StoreClient, StoreServer};

use super::plan::{Layout, Plan};
use super::{signals, BadInput};

const NS: &str = "zrun/launcher";
/// How often a node beats and the watchers look.
const TICK: Duration = Duration::from_millis(500);
/// A node whose heartbeat stalls this long is taken to be dead.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// News from the other nodes, for the supervision loop.
#[derive(Debug)]
pub enum Remote {
    /// Another node failed: its message.
    Failed(String),
    /// The store (node 0's launcher) cannot be reached any more.
    StoreLost(String),
}

/// This node's connection to the job: the store (hosted here on node 0), and for several
/// nodes a watcher thread.
pub struct Rendezvous {
    /// Kept alive for the job's lifetime on node 0.
    _server: Option<StoreServer>,
    client: Option<StoreClient>,
    /// Where this node's ranks sit in the job.
    pub layout: Layout,
    node_rank: usize,
    nnodes: usize,
    stop: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
    /// Messages from the watcher.
    pub remote: Option<Receiver<Remote>>,
}

fn key(name: &str) -> String {
    format!("{NS}/{name}")
}

/// Starts the store on `addr:port`; a port that is taken is bad input.
fn host(plan: &Plan) -> anyhow::Result<StoreServer> {
    let loopback = plan.master_addr == "localhost"
        || plan
            .master_addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let bind = if loopback {
        format!("{}:{}", plan.master_addr, plan.master_port)
    } else {
        format!("0.0.0.0:{}", plan.master_port)
    };
    StoreServer::start(&bind, &plan.token).map_err(|e| match &e {
        zrun_comm::Error::Store { op: "listen", .. } => BadInput(format!(
            "--master-port {}: cannot listen on {bind} (in use by another job?); pick another port{}",
            plan.master_port,
            if plan.nnodes == 1 { " or leave --master-port out for a free one" } else { "" }
        ))
        .into(),
        _ => anyhow::Error::new(e).context(format!("hosting the rendezvous store on {bind}")),
    })
}

/// Connects to the store, retrying until `deadline` (node 0 may start later) and giving up
/// at once when the launcher gets a signal.
fn connect(addr: &str, plan: &Plan, deadline: Instant) -> anyhow::Result<StoreClient> {
    loop {
        match StoreClient::connect(addr, &plan.token, TICK) {
            Ok(c) => return Ok(c),
            Err(zrun_comm::Error::StoreUnreachable { detail, .. }) => {
                if let Some((sig, _)) = signals::received() {
                    bail!(
                        "stopped by {} while connecting to node 0's store",
                        signals::name(sig)
                    );
                }
                if Instant::now() >= deadline {
                    bail!(
                        "node {}: node 0's rendezvous store at {addr} did not answer within {:?} (--rdzv-timeout-s): {detail}; start zrun with --node-rank 0 on {}",
                        plan.node_rank,
                        plan.rdzv_timeout,
                        plan.master_addr
                    );
                }
            }
            Err(e) => {
                return Err(e).with_context(|| format!("node {} joining the job", plan.node_rank))
            }
        }
    }
}

impl Rendezvous {
    /// One node: host the store; nothing to meet.
    pub fn single(plan: &Plan) -> anyhow::Result<Rendezvous> {
        let server = host(plan)?;
        let layout = Layout {
            rank_offset: 0,
            world_size: plan.nproc,
            master_port: server.port(),
        };
        Ok(Rendezvous {
            _server: Some(server),
            client: None,
            layout,
            node_rank: 0,
            nnodes: 1,
            stop: Arc::new(AtomicBool::new(false)),
            watcher: None,
            remote: None,
        })
    }

    /// Several nodes: node 0 hosts the store; every node registers its rank count, waits for
    /// the others (up to `--rdzv-timeout-s`, or until a signal), and starts its watcher.
    pub fn join(plan: &Plan) -> anyhow::Result<Rendezvous> {
        let server = if plan.node_rank == 0 {
            Some(host(plan)?)
        } else {
            None
        };
        let addr = format!("{}:{}", plan.master_addr, plan.master_port);
        let deadline = Instant::now() + plan.rdzv_timeout;
        let client = connect(&addr, plan, deadline)?;
        let k = plan.node_rank;
        if client.add(&key(&format!("claim/{k}")), 1)? > 1 {
            return Err(BadInput(format!(
                "--node-rank {k}: another zrun already joined this job as node {k}; give each node its own --node-rank"
            ))
            .into());
        }
        client.set(
            &key(&format!("nproc/{k}")),
            plan.nproc.to_string().as_bytes(),
        )?;
        let names: Vec<String> = (0..plan.nnodes)
            .map(|j| key(&format!("nproc/{j}")))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        loop {
            match client.wait(&refs, TICK) {
                Ok(()) => break,
                Err(zrun_comm::Error::StoreTimeout { missing, .. }) => {
                    if let Some((sig, _)) = signals::received() {
                        bail!(
                            "stopped by {} while waiting for the other nodes",
                            signals::name(sig)
                        );
                    }
                    if Instant::now() >= deadline {
                        bail!(
                            "node {k}: nodes {} did not join within {:?} (--rdzv-timeout-s); start zrun on every node with the same --nnodes, --master-addr and --master-port",
                            missing.iter().map(|m| m.rsplit('/').next().unwrap_or(m)).collect::<Vec<_>>().join(", "),
                            plan.rdzv_timeout
                        );
                    }
                }
                Err(e) => return Err(e).context("waiting for the other nodes"),
            }
        }
        let mut counts = Vec::with_capacity(plan.nnodes);
        for name in &names {
            let v = client.get(name)?;
            let n: usize = String::from_utf8_lossy(&v)
                .parse()
                .with_context(|| format!("store key {name} is not a rank count"))?;
            counts.push(n);
        }
        let layout = Layout {
            rank_offset: counts[..k].iter().sum(),
            world_size: counts.iter().sum(),
            master_port: plan.master_port,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = channel();
        let watch_client = connect(&addr, plan, Instant::now() + plan.rdzv_timeout)?;
        let (stop2, nnodes) = (stop.clone(), plan.nnodes);
        let watcher = std::thread::Builder::new()
            .name("zrun-watch".into())
            .spawn(move || {
                if let Some(news) = watch(&watch_client, k, nnodes, &stop2) {
                    let _ = tx.send(news);
                }
            })?;
        Ok(Rendezvous {
            _server: server,
            client: Some(client),
            layout,
            node_rank: k,
            nnodes: plan.nnodes,
            stop,
            watcher: Some(watcher),
            remote: Some(rx),
        })
    }

    /// Tells the other nodes that this job failed (only the first report is kept).
    pub fn publish_failure(&self, message: &str) {
        if let Some(c) = &self.client {
            if c.add(&key("failures"), 1).is_ok_and(|n| n == 1) {
                let _ = c.set(&key("failure"), message.as_bytes());
            }
        }
    }

    /// Marks this node's ranks as finished; node 0 then waits until every node has finished
    /// (so the store outlives their last use of it), a failure is reported, or a signal comes.
    pub fn finish(&self) -> Result<(), String> {
        let Some(c) = &self.client else {
            return Ok(());
        };
        let _ = c.set(&key(&format!("exit/{}", self.node_rank)), b"ok");
        if self.node_rank != 0 {
            return Ok(());
        }
        let names: Vec<String> = (0..self.nnodes)
            .map(|j| key(&format!("exit/{j}")))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        loop {
            match c.wait(&refs, TICK) {
                Ok(()) => return Ok(()),
                Err(zrun_comm::Error::StoreTimeout { .. }) => {
                    if let Some((sig, _)) = signals::received() {
                        return Err(format!(
                            "stopped by {} while waiting for the other nodes to finish",
                            signals::name(sig)
                        ));
                    }
                    // The watcher still runs: failures and stalled heartbeats arrive here.
                    if let Some(news) = self.remote.as_ref().and_then(|r| r.try_recv().ok()) {
                        return Err(match news {
                            Remote::Failed(m) | Remote::StoreLost(m) => m,
                        });
                    }
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Stops the watcher thread.
    pub fn close(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        self.close();
    }
}

/// Beats for node `k`, and returns the first news: a failure message, the store gone, or (on
/// node 0) another node whose heartbeat stalled. Returns `None` when asked to stop.
fn watch(c: &StoreClient, k: usize, nnodes: usize, stop: &AtomicBool) -> Option<Remote> {
    let failure = key("failure");
    // Per other node: the last counter seen and when it changed.
    let mut seen: Vec<(i64, Instant)> = vec![(-1, Instant::now()); nnodes];
    while !stop.load(Ordering::SeqCst) {
        if let Err(e) = c.add(&key(&format!("beat/{k}")), 1) {
            return Some(Remote::StoreLost(e.to_string()));
        }
        match c.wait(&[failure.as_str()], TICK) {
            Ok(()) => {
                let msg = c.get(&failure).unwrap_or_default();
                return Some(Remote::Failed(String::from_utf8_lossy(&msg).into_owned()));
            }
            Err(zrun_comm::Error::StoreTimeout { .. }) => {}
            Err(e) => return Some(Remote::StoreLost(e.to_string())),
        }
        if k != 0 {
            continue;
        }
        for (j, s) in seen.iter_mut().enumerate().skip(1) {
            let done = c
                .wait(&[key(&format!("exit/{j}")).as_str()], Duration::ZERO)
                .is_ok();
            let beat = c.add(&key(&format!("beat/{j}")), 0).unwrap_or(s.0);
            if done || beat != s.0 {
                *s = (beat, Instant::now());
            } else if s.1.elapsed() > HEARTBEAT_TIMEOUT {
                return Some(Remote::Failed(format!(
                    "node {j}'s zrun stopped answering (no heartbeat for {HEARTBEAT_TIMEOUT:?})"
                )));
            }
        }
    }
    None
}

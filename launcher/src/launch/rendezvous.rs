//! The store that node 0's launcher hosts, and how the launchers of several nodes meet,
//! number their ranks, learn of each other's failures, restart together and finish together.
//!
//! Keys (all under `zrun/launcher/`):
//! - `claim/K` (a counter, so a node rank used twice is caught), `joined` (a counter of the
//!   nodes that claimed their rank), `shared/K` (node K's flags that every node must give
//!   alike: `--nnodes`, `--max-restarts`, `--run-id`; set before `nproc/K`), `nproc/K` (ranks
//!   on node K), `refused` (the first disagreement a node found, which every node then
//!   prints; `refusals` counts who tried to write it), `checked` (a counter of the nodes that
//!   have their verdict: node 0 keeps the store up for them), `beat/K` (node K's heartbeat
//!   counter, beaten across every round).
//! - Per round R (0 for the first start, `TORCHELASTIC_RESTART_COUNT`): `failures/R` (a
//!   counter: the first node to fail in round R writes `failure/R`, the message every node
//!   prints and the sign to stop its ranks), `exit/R/K` (node K's ranks all ended well in
//!   round R), `bye/R/K` (node K > 0 leaves after round R: it needs the store no more and
//!   stops beating),
//!   `ready/R/K` (node K stopped its ranks after round R-1 failed and waits to start round R).
//! - `aborts` and `abort`: a node that ends the job for good (no restarts left, exit code 2,
//!   a signal, a lost node) writes `abort` before `failure/R`, so that no node waits at the
//!   next round's barrier for it.
//!
//! A restart: every node that sees `failure/R` (its own rank failed, or the watcher's news)
//! stops its ranks, writes `ready/R+1/K` and waits until every node has (up to
//! `--rdzv-timeout-s`; `abort`, a signal or a lost node ends the wait), then starts its ranks
//! again and watches `failure/R+1`. A node whose ranks all finished waits in [`finish`] until
//! every node finished (`exit/R/*`) or `failure/R` appears, and then restarts with the others.
//!
//! [`finish`]: Rendezvous::finish

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
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
/// How long node 0 keeps the store up for nodes that have not yet seen that all finished.
const BYE_TIMEOUT: Duration = Duration::from_secs(5);

/// News from the other nodes, for the supervision loop.
#[derive(Debug)]
pub enum Remote {
    /// A node failed in this round: its message.
    Failed(String),
    /// Node 0 saw another node's heartbeat stall.
    NodeLost(String),
    /// The store (node 0's launcher) cannot be reached any more.
    StoreLost(String),
}

/// News as the watcher sends it: a failure carries its round.
#[derive(Debug)]
enum Watched {
    Failed { round: u32, message: String },
    Other(Remote),
}

/// How a wait for the other nodes ended.
#[derive(Debug)]
pub enum Waited {
    /// Every node's ranks ended well.
    Done,
    /// A node failed in this round (`failure/R`): its message. A restart may follow.
    Failed(String),
    /// Anything else ended the wait (a signal, a lost node or store, the time limit).
    Ended(String),
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
    /// The round the ranks run in (shared with the watcher).
    round: Arc<AtomicU32>,
    stop: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
    news: Option<Receiver<Watched>>,
    /// Node 0's random word for this job, the same on every node (several nodes only).
    pub instance: Option<String>,
}

fn key(name: &str) -> String {
    format!("{NS}/{name}")
}

/// The keys `what/0` .. `what/nnodes-1`, skipping node 0 when `others` is set.
fn per_node(what: &str, nnodes: usize, others: bool) -> Vec<String> {
    (usize::from(others)..nnodes)
        .map(|j| key(&format!("{what}/{j}")))
        .collect()
}

/// The nodes missing from a wait for the keys `what/0..nnodes` ([`per_node`] without
/// `others`), whose indices are the node numbers: `1, 3-5`.
fn nodes_of(missing: &[std::ops::Range<usize>]) -> String {
    zrun_comm::list_ranges(missing)
}

/// The flags every node of a job must give alike, as (flag, value, why it must agree).
fn shared_flags(plan: &Plan) -> [(&'static str, String, &'static str); 3] {
    [
        (
            "--nnodes",
            plan.nnodes.to_string(),
            "every node waits for that many nodes and numbers the ranks over them",
        ),
        (
            "--max-restarts",
            plan.max_restarts.to_string(),
            "the nodes restart together",
        ),
        (
            "--run-id",
            plan.run_id.clone(),
            "the ranks of every node share one run id (their checkpoints record it)",
        ),
    ]
}

/// How [`shared_flags`] travel in the store: the values, one per line.
fn shared_value(plan: &Plan) -> String {
    shared_flags(plan)
        .iter()
        .map(|(_, v, _)| v.replace('\n', " "))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first of [`shared_flags`] that node `j` (whose `shared/j` is `theirs`) gives otherwise
/// than this node, as the one-line refusal.
fn disagreement(plan: &Plan, j: usize, theirs: &str) -> Option<String> {
    let mut values = theirs.split('\n');
    for (flag, mine, why) in shared_flags(plan) {
        let other = values.next().unwrap_or("");
        if other != mine.replace('\n', " ") {
            return Some(format!(
                "{flag} {mine} on node {} but {other} on node {j}: {why}; give every node the same {flag}",
                plan.node_rank
            ));
        }
    }
    None
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
            // Another service on the port, or a host name that does not exist.
            Err(e) if e.is_bad_input() => {
                return Err(BadInput(format!("node {}: {e}", plan.node_rank)).into())
            }
            Err(e) => {
                return Err(e).with_context(|| format!("node {} joining the job", plan.node_rank))
            }
        }
    }
}

/// One node's comparison of the shared flags while the nodes meet.
struct Meeting<'a> {
    client: &'a StoreClient,
    plan: &'a Plan,
    /// Nodes whose flags this node has compared with its own.
    compared: Vec<bool>,
}

impl Meeting<'_> {
    /// Compares the flags of every registered node not yet compared (those not in
    /// `missing`, indices of `nproc/0..nnodes`) and looks for another node's refusal; a
    /// disagreement found here is published for the others. Either way this node then ends
    /// with the refusal (exit code 2); node 0 first keeps the store up (up to
    /// [`BYE_TIMEOUT`]) until every node that joined has read it.
    fn compare(&mut self, missing: &[std::ops::Range<usize>]) -> anyhow::Result<()> {
        let c = self.client;
        let mut found = None;
        for j in 0..self.compared.len() {
            if self.compared[j] || missing.iter().any(|r| r.contains(&j)) {
                continue;
            }
            let theirs =
                String::from_utf8_lossy(&c.get(&key(&format!("shared/{j}")))?).into_owned();
            self.compared[j] = true;
            if let Some(m) = disagreement(self.plan, j, &theirs) {
                found = Some(m);
                break;
            }
        }
        let refused = key("refused");
        if let Some(m) = &found {
            if c.add(&key("refusals"), 1)? == 1 {
                c.set(&refused, m.as_bytes())?;
            }
        }
        let message = match found {
            Some(m) => m,
            None if c.wait(&[refused.as_str()], Duration::ZERO).is_ok() => {
                let m = String::from_utf8_lossy(&c.get(&refused)?).into_owned();
                format!("another node refused to meet: {m}")
            }
            None => return Ok(()),
        };
        let _ = c.add(&key("checked"), 1);
        if self.plan.node_rank == 0 {
            let until = Instant::now() + BYE_TIMEOUT;
            while Instant::now() < until {
                let (checked, joined) = (c.add(&key("checked"), 0), c.add(&key("joined"), 0));
                if matches!((checked, joined), (Ok(a), Ok(b)) if a >= b) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Err(BadInput(message).into())
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
            round: Arc::new(AtomicU32::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            watcher: None,
            news: None,
            instance: None,
        })
    }

    /// Several nodes: node 0 hosts the store; every node registers its rank count and the
    /// flags every node must share ([`shared_flags`]), waits for the others (up to
    /// `--rdzv-timeout-s`, or until a signal) while comparing those flags with every node
    /// that has registered, and starts its watcher. A disagreement ends the rendezvous on
    /// every node that joined, at once, with the same one line (exit code 2).
    pub fn join(plan: &Plan) -> anyhow::Result<Rendezvous> {
        let server = if plan.node_rank == 0 {
            Some(host(plan)?)
        } else {
            None
        };
        let addr = format!("{}:{}", plan.master_addr, plan.master_port);
        let deadline = zrun_comm::deadline_in(plan.rdzv_timeout);
        let client = connect(&addr, plan, deadline)?;
        let k = plan.node_rank;
        if client.add(&key(&format!("claim/{k}")), 1)? > 1 {
            return Err(BadInput(format!(
                "--node-rank {k}: another zrun already joined this job as node {k}; give each node its own --node-rank"
            ))
            .into());
        }
        client.add(&key("joined"), 1)?;
        // Node 0's random word tells this job from another on the same address and port
        // (their default run ids are equal): set before node 0 registers, read by the rest.
        if k == 0 {
            client.set(&key("instance"), super::plan::random_hex(8).as_bytes())?;
        }
        client.set(&key(&format!("shared/{k}")), shared_value(plan).as_bytes())?;
        client.set(
            &key(&format!("nproc/{k}")),
            plan.nproc.to_string().as_bytes(),
        )?;
        let mut meeting = Meeting {
            client: &client,
            plan,
            compared: vec![false; plan.nnodes],
        };
        let names = per_node("nproc", plan.nnodes, false);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        loop {
            match client.wait(&refs, TICK) {
                Ok(()) => break,
                Err(zrun_comm::Error::StoreTimeout { missing, .. }) => {
                    meeting.compare(&missing)?;
                    if let Some((sig, _)) = signals::received() {
                        bail!(
                            "stopped by {} while waiting for the other nodes",
                            signals::name(sig)
                        );
                    }
                    if Instant::now() >= deadline {
                        bail!(
                            "node {k}: nodes {} did not join within {:?} (--rdzv-timeout-s); start zrun on every node with the same --nnodes, --master-addr and --master-port",
                            nodes_of(&missing),
                            plan.rdzv_timeout
                        );
                    }
                }
                Err(e) => return Err(e).context("waiting for the other nodes"),
            }
        }
        meeting.compare(&[])?;
        // This node has its verdict; node 0 need not keep the store up for it.
        client.add(&key("checked"), 1)?;
        let instance = String::from_utf8_lossy(&client.get(&key("instance"))?).into_owned();
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
        let round = Arc::new(AtomicU32::new(0));
        let (tx, rx) = channel();
        let watch_client = connect(&addr, plan, zrun_comm::deadline_in(plan.rdzv_timeout))?;
        let watcher = Watcher {
            client: watch_client,
            node: k,
            nnodes: plan.nnodes,
            round: round.clone(),
            stop: stop.clone(),
            tx,
        };
        let watcher = std::thread::Builder::new()
            .name("zrun-watch".into())
            .spawn(move || watcher.run())?;
        Ok(Rendezvous {
            _server: server,
            client: Some(client),
            layout,
            node_rank: k,
            nnodes: plan.nnodes,
            round,
            stop,
            watcher: Some(watcher),
            news: Some(rx),
            instance: Some(instance),
        })
    }

    /// Moves this node (and its watcher) to `round`, before its ranks start in it.
    pub fn set_round(&self, round: u32) {
        self.round.store(round, Ordering::SeqCst);
    }

    /// The watcher's next news for the current round, if any (news of earlier rounds, which
    /// this node has acted on already, is dropped).
    pub fn news(&self) -> Option<Remote> {
        let rx = self.news.as_ref()?;
        let now = self.round.load(Ordering::SeqCst);
        while let Ok(w) = rx.try_recv() {
            match w {
                Watched::Failed { round, message } if round == now => {
                    return Some(Remote::Failed(message))
                }
                Watched::Failed { .. } => {}
                Watched::Other(r) => return Some(r),
            }
        }
        None
    }

    /// Tells the other nodes that this round failed (only the first report of a round is
    /// kept); `for_good` also tells them that this node will not restart.
    pub fn publish_failure(&self, message: &str, for_good: bool) {
        let Some(c) = &self.client else {
            return;
        };
        if for_good && c.add(&key("aborts"), 1).is_ok_and(|n| n == 1) {
            let _ = c.set(&key("abort"), message.as_bytes());
        }
        let r = self.round.load(Ordering::SeqCst);
        if c.add(&key(&format!("failures/{r}")), 1)
            .is_ok_and(|n| n == 1)
        {
            let _ = c.set(&key(&format!("failure/{r}")), message.as_bytes());
        }
    }

    /// Why the job ends for good, when a node said so.
    pub fn aborted(&self) -> Option<String> {
        let c = self.client.as_ref()?;
        let k = key("abort");
        c.wait(&[k.as_str()], Duration::ZERO).ok()?;
        let msg = c.get(&k).unwrap_or_default();
        Some(String::from_utf8_lossy(&msg).into_owned())
    }

    /// Marks this node's ranks as having ended well in this round (`how`: "ok" or "stopped"),
    /// then waits for every node's ranks to end well, for a failure of this round, or for the
    /// wait to end otherwise. Node 0 always waits (the store must outlive the others' use of
    /// it); another node waits when `wait_all` (restarts remain, so it must learn whether to
    /// restart, or it reports that every node's ranks stopped). `until` bounds the wait;
    /// a signal beyond the first `signals_seen` ends it.
    pub fn finish(
        &self,
        how: &str,
        wait_all: bool,
        until: Option<Instant>,
        signals_seen: usize,
    ) -> Waited {
        let Some(c) = &self.client else {
            return Waited::Done;
        };
        let (k, r) = (self.node_rank, self.round.load(Ordering::SeqCst));
        let bye = key(&format!("bye/{r}/{k}"));
        let _ = c.set(&key(&format!("exit/{r}/{k}")), how.as_bytes());
        if k != 0 && !wait_all {
            let _ = c.set(&bye, b"");
            return Waited::Done;
        }
        let names = per_node(&format!("exit/{r}"), self.nnodes, false);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        loop {
            match c.wait(&refs, TICK) {
                Ok(()) => break,
                Err(zrun_comm::Error::StoreTimeout { missing, .. }) => {
                    if signals::count() > signals_seen {
                        let sig = signals::received().map_or(0, |(s, _)| s);
                        return Waited::Ended(format!(
                            "stopped by {} while waiting for the other nodes to finish",
                            signals::name(sig)
                        ));
                    }
                    match self.news() {
                        Some(Remote::Failed(m)) => return Waited::Failed(m),
                        Some(Remote::NodeLost(m) | Remote::StoreLost(m)) => {
                            return Waited::Ended(m)
                        }
                        None => {}
                    }
                    if until.is_some_and(|t| Instant::now() >= t) {
                        return Waited::Ended(format!(
                            "the ranks of nodes {} did not stop in time",
                            nodes_of(&missing)
                        ));
                    }
                }
                Err(e) => return Waited::Ended(e.to_string()),
            }
        }
        if k != 0 {
            let _ = c.set(&bye, b"");
        } else {
            // Keep the store up until the others have seen that every node finished.
            let byes = per_node(&format!("bye/{r}"), self.nnodes, true);
            let refs: Vec<&str> = byes.iter().map(String::as_str).collect();
            let _ = c.wait(&refs, BYE_TIMEOUT);
        }
        Waited::Done
    }

    /// The barrier before round `next`: marks this node ready and waits until every node is,
    /// up to `deadline`. Fails with the reason when a node ended the job, a signal arrived,
    /// a node or the store was lost, or time ran out.
    pub fn ready(&self, next: u32, deadline: Instant) -> Result<(), String> {
        let Some(c) = &self.client else {
            return Ok(());
        };
        c.set(&key(&format!("ready/{next}/{}", self.node_rank)), b"")
            .map_err(|e| e.to_string())?;
        let names = per_node(&format!("ready/{next}"), self.nnodes, false);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        loop {
            match c.wait(&refs, TICK) {
                Ok(()) => return Ok(()),
                Err(zrun_comm::Error::StoreTimeout { missing, .. }) => {
                    if let Some(m) = self.aborted() {
                        return Err(format!("another node ended the job: {m}"));
                    }
                    if let Some((sig, _)) = signals::received() {
                        return Err(format!(
                            "stopped by {} while waiting for the other nodes to restart",
                            signals::name(sig)
                        ));
                    }
                    // Failures of the round that just ended are old news here.
                    if let Some(Remote::NodeLost(m) | Remote::StoreLost(m)) = self.news() {
                        return Err(m);
                    }
                    if Instant::now() >= deadline {
                        return Err(format!(
                            "nodes {} were not ready to restart within the --rdzv-timeout-s limit",
                            nodes_of(&missing)
                        ));
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

/// The watcher thread of one node: beats, and sends news of the current round's failure, a
/// lost store and (on node 0) another node's stalled heartbeat. It runs across rounds.
struct Watcher {
    client: StoreClient,
    node: usize,
    nnodes: usize,
    round: Arc<AtomicU32>,
    stop: Arc<AtomicBool>,
    tx: Sender<Watched>,
}

impl Watcher {
    fn run(self) {
        let c = &self.client;
        let send = |w: Watched| {
            let _ = self.tx.send(w);
        };
        // Per other node: the last counter seen and when it changed.
        let mut seen: Vec<(i64, Instant)> = vec![(-1, Instant::now()); self.nnodes];
        let mut reported: Option<u32> = None;
        let mut lost = false;
        while !self.stop.load(Ordering::SeqCst) {
            if let Err(e) = c.add(&key(&format!("beat/{}", self.node)), 1) {
                return send(Watched::Other(Remote::StoreLost(e.to_string())));
            }
            let round = self.round.load(Ordering::SeqCst);
            if reported == Some(round) {
                std::thread::sleep(TICK);
            } else {
                let failure = key(&format!("failure/{round}"));
                match c.wait(&[failure.as_str()], TICK) {
                    Ok(()) => {
                        let msg = c.get(&failure).unwrap_or_default();
                        let message = String::from_utf8_lossy(&msg).into_owned();
                        send(Watched::Failed { round, message });
                        reported = Some(round);
                    }
                    Err(zrun_comm::Error::StoreTimeout { .. }) => {}
                    Err(e) => return send(Watched::Other(Remote::StoreLost(e.to_string()))),
                }
            }
            if self.node != 0 || lost {
                continue;
            }
            for (j, s) in seen.iter_mut().enumerate().skip(1) {
                // A node that said bye has left for good; one that finished and waits for a
                // possible restart still beats.
                let done = c
                    .wait(&[key(&format!("bye/{round}/{j}")).as_str()], Duration::ZERO)
                    .is_ok();
                let beat = c.add(&key(&format!("beat/{j}")), 0).unwrap_or(s.0);
                if done || beat != s.0 {
                    *s = (beat, Instant::now());
                } else if s.1.elapsed() > HEARTBEAT_TIMEOUT && !lost {
                    send(Watched::Other(Remote::NodeLost(format!(
                        "node {j}'s zrun stopped answering (no heartbeat for {HEARTBEAT_TIMEOUT:?})"
                    ))));
                    lost = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_node_keys_and_their_node_numbers() {
        let all = per_node("ready/2", 3, false);
        assert_eq!(
            all,
            [
                "zrun/launcher/ready/2/0",
                "zrun/launcher/ready/2/1",
                "zrun/launcher/ready/2/2"
            ]
        );
        let others = per_node("bye/0", 3, true);
        assert_eq!(others, ["zrun/launcher/bye/0/1", "zrun/launcher/bye/0/2"]);
        assert_eq!(nodes_of(&[1..3, 5..6]), "1-2, 5");
    }

    fn plan(node_rank: usize, nnodes: usize, max_restarts: u32, run_id: &str) -> Plan {
        Plan {
            nproc: 2,
            nnodes,
            node_rank,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            grace: Duration::from_secs(1),
            log_dir: None,
            run_id: run_id.into(),
            run_id_given: true,
            token: "t".into(),
            rdzv_timeout: Duration::from_secs(1),
            max_restarts,
        }
    }

    #[test]
    fn shared_flags_that_differ_are_named_with_both_values_and_nodes() {
        let theirs = shared_value(&plan(1, 3, 0, "job"));
        assert_eq!(theirs, "3\n0\njob");
        let mine = plan(0, 2, 0, "job");
        assert_eq!(
            disagreement(&mine, 1, &theirs).as_deref(),
            Some("--nnodes 2 on node 0 but 3 on node 1: every node waits for that many nodes and numbers the ranks over them; give every node the same --nnodes")
        );
        let e = disagreement(&mine, 1, &shared_value(&plan(1, 2, 4, "job"))).unwrap();
        assert!(
            e.starts_with("--max-restarts 0 on node 0 but 4 on node 1"),
            "{e}"
        );
        let e = disagreement(&mine, 1, &shared_value(&plan(1, 2, 0, "other"))).unwrap();
        assert!(
            e.starts_with("--run-id job on node 0 but other on node 1"),
            "{e}"
        );
        assert_eq!(
            disagreement(&mine, 1, &shared_value(&plan(1, 2, 0, "job"))),
            None
        );
    }
}

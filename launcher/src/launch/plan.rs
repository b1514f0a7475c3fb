//! The validated layout of a launch: ranks per node, nodes, the store's address, the job's
//! token and run id, and the environment each worker gets.

use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{BadInput, LaunchFlags};

/// Store port used when several nodes meet and `--master-port` is not given (torchrun's).
pub const DEFAULT_MULTI_NODE_PORT: u16 = 29500;

/// A launch that passed validation.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Workers started on this node.
    pub nproc: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Host of the rendezvous store (node 0).
    pub master_addr: String,
    /// Port of the store; 0 on a single node means "pick a free one".
    pub master_port: u16,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub grace: Duration,
    /// Directory for one log file per rank.
    pub log_dir: Option<PathBuf>,
    /// Identifies the job to its workers (`ZRUN_RUN_ID`).
    pub run_id: String,
    /// Whether the run id was given (`--run-id`, `ZRUN_RUN_ID`) rather than made here.
    pub run_id_given: bool,
    /// Secret shared by the store and every worker (`ZRUN_JOB_TOKEN`).
    pub token: String,
    /// How long the nodes of a multi-node job wait for each other.
    pub rdzv_timeout: Duration,
    /// How many times the group is started again after a failure.
    pub max_restarts: u32,
}

/// Where this node's workers sit in the whole job (known after the nodes have met).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Global rank of this node's local rank 0.
    pub rank_offset: usize,
    /// Ranks in the job, over every node.
    pub world_size: usize,
    /// The port the store listens on.
    pub master_port: u16,
}

impl Plan {
    /// Checks the flags and fills in the defaults; every error is one line (exit code 2).
    ///
    /// The token is `ZRUN_JOB_TOKEN` when set; otherwise random on one node, and on several
    /// derived from the run id and the per-user secret file (`ZRUN_SECRET_FILE`, default
    /// `~/.config/zrun/secret`, made on first use), which every node must share.
    pub fn new(f: &LaunchFlags) -> Result<Plan, BadInput> {
        Plan::with_secret(f, None)
    }

    /// [`Plan::new`] reading the multi-node secret from `secret` instead of the default file.
    fn with_secret(f: &LaunchFlags, secret: Option<&Path>) -> Result<Plan, BadInput> {
        let nproc = match f.nproc {
            Some(0) => {
                return Err(BadInput(
                    "--nproc 0: a node needs at least one rank; give --nproc 1 or more".into(),
                ))
            }
            Some(n) => n,
            None => default_nproc(),
        };
        let nnodes = f.nnodes.unwrap_or(1);
        if nnodes == 0 {
            return Err(BadInput(
                "--nnodes 0: a job needs at least one node; give --nnodes 1 or more".into(),
            ));
        }
        check_world(nproc, nnodes)?;
        let node_rank = f.node_rank.unwrap_or(0);
        if node_rank >= nnodes {
            return Err(BadInput(format!(
                "--node-rank {node_rank} is out of range for --nnodes {nnodes}: use 0..={}",
                nnodes - 1
            )));
        }
        let master_addr = match (&f.master_addr, nnodes) {
            (Some(a), _) if a.trim().is_empty() => {
                return Err(BadInput(
                    "--master-addr is empty: give node 0's host name or IP".into(),
                ))
            }
            (Some(a), _) => a.trim().to_string(),
            (None, 1) => "127.0.0.1".to_string(),
            (None, n) => {
                return Err(BadInput(format!(
                    "--nnodes {n} needs --master-addr: node 0's host name or IP, reachable from every node"
                )))
            }
        };
        let master_port = match (f.master_port, nnodes) {
            (Some(0), n) if n > 1 => {
                return Err(BadInput(
                    "--master-port 0: every node must know the port; give one such as 29500".into(),
                ))
            }
            (Some(p), _) => p,
            (None, 1) => 0,
            (None, _) => DEFAULT_MULTI_NODE_PORT,
        };
        resolve(&master_addr, master_port)?;
        let most = zrun_comm::MAX_TIMEOUT_S;
        if !(f.grace_s.is_finite() && f.grace_s >= 0.0 && f.grace_s <= most as f64) {
            return Err(BadInput(format!(
                "--grace-s {}: give a number of seconds from 0 to {most} (a year)",
                f.grace_s
            )));
        }
        if f.rdzv_timeout_s > most {
            return Err(BadInput(format!(
                "--rdzv-timeout-s {}: give a number of seconds from 1 to {most} (a year)",
                f.rdzv_timeout_s
            )));
        }
        if let Some(dir) = &f.log_dir {
            std::fs::create_dir_all(dir).map_err(|e| {
                BadInput(format!(
                    "--log-dir {}: cannot create it: {e}; give a writable directory",
                    dir.display()
                ))
            })?;
        }
        let given = f
            .run_id
            .clone()
            .or_else(|| std::env::var("ZRUN_RUN_ID").ok().filter(|s| !s.is_empty()));
        let run_id_given = given.is_some();
        let run_id = given.unwrap_or_else(|| default_run_id(nnodes, &master_addr, master_port));
        let token = match std::env::var(zrun_comm::TOKEN_ENV)
            .ok()
            .filter(|t| !t.is_empty())
        {
            Some(t) => t,
            None if nnodes == 1 => random_hex(16),
            // Every node must derive the same token without talking first, and nobody else
            // may: the run id is keyed with a secret only this user's files hold.
            None => shared_token(secret, &run_id)?,
        };
        Ok(Plan {
            nproc,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            grace: Duration::from_secs_f64(f.grace_s),
            log_dir: f.log_dir.clone(),
            run_id,
            run_id_given,
            token,
            rdzv_timeout: Duration::from_secs(f.rdzv_timeout_s.max(1)),
            max_restarts: f.max_restarts,
        })
    }

    /// The environment of local rank `local` in round `restart` (0 for the first start):
    /// torchrun's variables plus zrun's.
    ///
    /// `omp_threads` is `None` when the user set `OMP_NUM_THREADS` (it is then inherited).
    pub fn worker_env(
        &self,
        layout: &Layout,
        local: usize,
        omp_threads: Option<usize>,
        restart: u32,
    ) -> Vec<(String, String)> {
        let mut env = vec![
            ("RANK", (layout.rank_offset + local).to_string()),
            ("LOCAL_RANK", local.to_string()),
            ("WORLD_SIZE", layout.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.nproc.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", self.nnodes.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", layout.master_port.to_string()),
            (zrun_comm::TOKEN_ENV, self.token.clone()),
            ("ZRUN_RUN_ID", self.run_id.clone()),
            (zrun_comm::STORE_EXTERNAL_ENV, "1".to_string()),
            ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
        ];
        if let Some(n) = omp_threads {
            env.push(("OMP_NUM_THREADS", n.to_string()));
        }
        let mut env: Vec<(String, String)> =
            env.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        env.extend(zrun_comm::share::launch_env(layout.rank_offset + local));
        env
    }
}

/// The most ranks one node's launcher starts: far above a node's GPUs or useful CPU ranks,
/// and below the point where the processes alone exhaust a machine (each maps libtorch).
pub const MAX_NPROC: usize = 1024;

/// The most ranks of one job: past the largest clusters, and where a plan over every rank
/// (`zrun estimate`) still takes seconds.
pub const MAX_WORLD: usize = 1 << 17;

/// Refuses more than [`MAX_NPROC`] ranks per node or [`MAX_WORLD`] in all, naming the flags.
pub fn check_world(nproc: usize, nnodes: usize) -> Result<(), BadInput> {
    if nproc > MAX_NPROC {
        return Err(BadInput(format!(
            "--nproc {nproc}: more ranks than one node runs (at most {MAX_NPROC}: a rank is a process, one per GPU or per share of the cores); give --nproc {MAX_NPROC} or fewer and more nodes"
        )));
    }
    match nproc.checked_mul(nnodes) {
        Some(w) if w <= MAX_WORLD => Ok(()),
        _ => Err(BadInput(format!(
            "--nnodes {nnodes} x --nproc {nproc}: more ranks than one job runs (at most {MAX_WORLD}); give fewer nodes"
        ))),
    }
}

/// Each local rank's share of this node's cores: `cores / nproc`, at least 1.
pub fn omp_share(cores: usize, nproc: usize) -> usize {
    (cores / nproc.max(1)).max(1)
}

/// The thread count for workers, or `None` when the user's `OMP_NUM_THREADS` is to be kept.
pub fn omp_threads_for(nproc: usize) -> Option<usize> {
    if std::env::var_os("OMP_NUM_THREADS").is_some_and(|v| !v.is_empty()) {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some(omp_share(cores, nproc))
}

/// Visible GPUs, or 1 when there is none.
fn default_nproc() -> usize {
    let gpus = tch::Cuda::device_count();
    usize::try_from(gpus).unwrap_or(0).max(1)
}

/// Fails with one line when `addr` does not resolve.
fn resolve(addr: &str, port: u16) -> Result<(), BadInput> {
    let found = (addr, port)
        .to_socket_addrs()
        .map_err(|e| e.to_string())
        .and_then(|mut it| it.next().ok_or_else(|| "no address".to_string()));
    found.map(|_| ()).map_err(|e| {
        BadInput(format!(
            "--master-addr {addr} does not resolve ({e}); give node 0's host name or IP"
        ))
    })
}

/// The multi-node token of `run_id`, keyed with the secret at `secret` (default: the per-user
/// secret file, made on first use).
fn shared_token(secret: Option<&Path>, run_id: &str) -> Result<String, BadInput> {
    let bad = |e: zrun_comm::Error| BadInput(e.to_string());
    let path = match secret {
        Some(p) => p.to_path_buf(),
        None => zrun_comm::secret_path().map_err(bad)?,
    };
    let key = zrun_comm::load_or_create_secret(&path).map_err(bad)?;
    Ok(zrun_comm::job_token(&key, run_id))
}

/// The run id when none is given: on one node the time and pid; on several, which cannot
/// agree on anything before meeting, node 0's `addr-port` (the same for every job there: give
/// `--run-id`, e.g. the scheduler's job id, to tell jobs apart).
fn default_run_id(nnodes: usize, addr: &str, port: u16) -> String {
    if nnodes > 1 {
        return format!("{addr}-{port}");
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{secs}-{}", std::process::id())
}

/// `n` random bytes (at most 16) as hex, from the kernel (time and pid when /dev/urandom
/// is unreadable).
pub(super) fn random_hex(n: usize) -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok();
    if !ok {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b = (t ^ (u128::from(std::process::id()) << 64)).to_le_bytes();
    }
    b[..n.min(16)].iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags() -> LaunchFlags {
        LaunchFlags {
            nproc: Some(2),
            nnodes: None,
            node_rank: None,
            master_addr: None,
            master_port: None,
            log_dir: None,
            grace_s: 10.0,
            run_id: None,
            rdzv_timeout_s: 300,
            max_restarts: 0,
            quiet: false,
            log_format: None,
        }
    }

    #[test]
    fn defaults_for_one_node() {
        let p = Plan::new(&flags()).unwrap();
        assert_eq!((p.nproc, p.nnodes, p.node_rank), (2, 1, 0));
        assert_eq!((p.master_addr.as_str(), p.master_port), ("127.0.0.1", 0));
        assert_eq!(p.grace, Duration::from_secs(10));
        assert!(!p.token.is_empty() && !p.run_id.is_empty());
    }

    #[test]
    fn bad_layouts_are_one_line_errors() {
        let mut f = flags();
        f.nproc = Some(0);
        assert!(Plan::new(&f).unwrap_err().0.contains("--nproc 0"));
        f.nproc = Some(MAX_NPROC + 1);
        assert!(Plan::new(&f).unwrap_err().0.contains("--nproc 1025"));
        f.nproc = Some(MAX_NPROC);
        assert_eq!(Plan::new(&f).unwrap().nproc, MAX_NPROC);
        f.nnodes = Some(MAX_WORLD / MAX_NPROC + 1);
        f.master_addr = Some("127.0.0.1".into());
        let e = Plan::new(&f).unwrap_err().0;
        assert!(e.contains("--nnodes 129 x --nproc 1024"), "{e}");
        f.nnodes = Some(usize::MAX);
        assert!(Plan::new(&f).unwrap_err().0.contains("at most 131072"));
        let mut f = flags();
        f.nnodes = Some(2);
        f.node_rank = Some(2);
        f.master_addr = Some("127.0.0.1".into());
        let e = Plan::new(&f).unwrap_err().0;
        assert!(e.contains("--node-rank 2") && e.contains("0..=1"), "{e}");
        let mut f = flags();
        f.nnodes = Some(2);
        assert!(Plan::new(&f).unwrap_err().0.contains("needs --master-addr"));
        let mut f = flags();
        f.master_addr = Some("no-such-host.invalid".into());
        assert!(Plan::new(&f).unwrap_err().0.contains("does not resolve"));
        let mut f = flags();
        f.grace_s = -1.0;
        assert!(Plan::new(&f).unwrap_err().0.contains("--grace-s"));
        // Past a year: once a panic converting to a Duration or adding it to the clock.
        f.grace_s = 1e20;
        let e = Plan::new(&f).unwrap_err().0;
        assert!(
            e.contains(
                "--grace-s 100000000000000000000: give a number of seconds from 0 to 31536000"
            ),
            "{e}"
        );
        f.grace_s = zrun_comm::MAX_TIMEOUT_S as f64;
        assert!(Plan::new(&f).is_ok());
        f.rdzv_timeout_s = u64::MAX;
        let e = Plan::new(&f).unwrap_err().0;
        assert!(e.contains("--rdzv-timeout-s 18446744073709551615: give a number of seconds from 1 to 31536000"), "{e}");
    }

    /// A fresh directory for secret files.
    fn secret_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("zrun-plan-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn two_nodes() -> LaunchFlags {
        let mut f = flags();
        f.nnodes = Some(2);
        f.master_addr = Some("127.0.0.1".into());
        f
    }

    #[test]
    fn multi_node_defaults_agree_across_nodes() {
        let d = secret_dir("agree");
        let secret = d.join("secret");
        let mut f = two_nodes();
        let a = Plan::with_secret(&f, Some(&secret)).unwrap();
        f.node_rank = Some(1);
        let b = Plan::with_secret(&f, Some(&secret)).unwrap();
        assert_eq!(a.master_port, DEFAULT_MULTI_NODE_PORT);
        if std::env::var_os(zrun_comm::TOKEN_ENV).is_none() {
            assert_eq!(a.token, b.token, "nodes must derive the same token");
        }
        assert_eq!(a.run_id, b.run_id);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn multi_node_default_token_needs_the_secret() {
        if std::env::var_os(zrun_comm::TOKEN_ENV).is_some() {
            return;
        }
        let d = secret_dir("unguessable");
        let (mine, theirs) = (d.join("mine/secret"), d.join("theirs/secret"));
        let f = two_nodes();
        let a = Plan::with_secret(&f, Some(&mine)).unwrap();
        let b = Plan::with_secret(&f, Some(&theirs)).unwrap();
        // Same address, port and run id: only the secret tells the tokens apart.
        assert_eq!(a.run_id, b.run_id);
        assert_ne!(a.token, b.token);
        for public in [&a.run_id, &a.master_addr, &format!("zrun-run-{}", a.run_id)] {
            assert!(!a.token.contains(public.as_str()), "{}", a.token);
        }
        assert_eq!(a.token.len(), 64);
        assert!(a.token.chars().all(|c| c.is_ascii_hexdigit()));
        // Another run id under the same secret gets another token.
        let mut g = two_nodes();
        g.run_id = Some("job-2".into());
        assert_ne!(Plan::with_secret(&g, Some(&mine)).unwrap().token, a.token);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_secret_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        if std::env::var_os(zrun_comm::TOKEN_ENV).is_some() {
            return;
        }
        let d = secret_dir("mode");
        let secret = d.join("secret");
        Plan::with_secret(&two_nodes(), Some(&secret)).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = Plan::with_secret(&two_nodes(), Some(&secret))
            .unwrap_err()
            .0;
        assert!(e.contains("chmod 600") && e.contains("mode 640"), "{e}");
        assert!(!e.contains('\n'));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn worker_env_numbers_ranks_node_by_node() {
        let mut f = flags();
        f.nnodes = Some(2);
        f.node_rank = Some(1);
        f.nproc = Some(3);
        f.master_addr = Some("127.0.0.1".into());
        f.master_port = Some(4321);
        f.max_restarts = 4;
        let layout = Layout {
            rank_offset: 3,
            world_size: 6,
            master_port: 4321,
        };
        let p = Plan::new(&f).unwrap();
        let env = p.worker_env(&layout, 2, Some(5), 3);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("5"));
        assert_eq!(get("LOCAL_RANK"), Some("2"));
        assert_eq!(get("WORLD_SIZE"), Some("6"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("3"));
        assert_eq!(get("GROUP_RANK"), Some("1"));
        assert_eq!(get("MASTER_PORT"), Some("4321"));
        assert_eq!(get("OMP_NUM_THREADS"), Some("5"));
        assert_eq!(get("ZRUN_STORE_EXTERNAL"), Some("1"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("3"));
        assert_eq!(get("TORCHELASTIC_MAX_RESTARTS"), Some("4"));
        assert!(p
            .worker_env(&layout, 0, None, 0)
            .iter()
            .all(|(k, _)| k != "OMP_NUM_THREADS"));
    }

    #[test]
    fn cores_are_shared_between_local_ranks() {
        assert_eq!(omp_share(16, 4), 4);
        assert_eq!(omp_share(16, 3), 5);
        assert_eq!(omp_share(2, 4), 1);
        assert_eq!(omp_share(8, 0), 8);
    }

    #[test]
    fn tokens_are_random_hex() {
        let (a, b) = (random_hex(16), random_hex(16));
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}

//! Where this process sits in the job, read from the launcher's environment variables.

use crate::Error;

mod slurm;

use slurm::{slurm, SLURM_HINT};

/// Which launcher's variables the topology came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopologySource {
    /// zrun's launcher (torchrun's variables plus `ZRUN_JOB_TOKEN`).
    Zrun,
    /// torchrun (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
    Torchrun,
    /// OpenMPI's `mpirun` (`OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE`).
    OpenMpi,
    /// MPICH/Hydra or another PMI launcher (`PMI_RANK`, `PMI_SIZE`).
    Pmi,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
    /// No variables at all: a single process.
    Single,
}

/// What to do about a topology error under zrun's or torchrun's variables.
const TORCHRUN_HINT: &str = "set RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT consistently (or start under zrun, torchrun, mpirun or srun)";
/// What to do about a topology error under OpenMPI's variables.
const OPENMPI_HINT: &str = "start every rank with OpenMPI's mpirun, which sets OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; on several hosts also pass MASTER_ADDR (and MASTER_PORT) with mpirun -x";
/// What to do about a topology error under PMI's variables.
const PMI_HINT: &str = "start every rank with mpiexec (MPICH/Hydra), which sets PMI_RANK/PMI_SIZE and MPI_LOCALRANKID/MPI_LOCALNRANKS; on several hosts also pass MASTER_ADDR (and MASTER_PORT) with mpiexec -genv";

impl TopologySource {
    /// The launcher's name for messages: `zrun`, `torchrun`, `OpenMPI`, `PMI/MPICH`, `Slurm`,
    /// `none`.
    pub fn name(self) -> &'static str {
        match self {
            TopologySource::Zrun => "zrun",
            TopologySource::Torchrun => "torchrun",
            TopologySource::OpenMpi => "OpenMPI",
            TopologySource::Pmi => "PMI/MPICH",
            TopologySource::Slurm => "Slurm",
            TopologySource::Single => "none",
        }
    }

    /// What to do when this launcher's variables are missing, malformed or contradictory.
    pub fn hint(self) -> &'static str {
        match self {
            TopologySource::Zrun | TopologySource::Torchrun | TopologySource::Single => {
                TORCHRUN_HINT
            }
            TopologySource::OpenMpi => OPENMPI_HINT,
            TopologySource::Pmi => PMI_HINT,
            TopologySource::Slurm => SLURM_HINT,
        }
    }
}

impl std::fmt::Display for TopologySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Rank among the processes of this host, `0..local_world_size`.
    pub local_rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Number of processes on this host.
    pub local_world_size: usize,
    /// Host of the rendezvous store (empty when unknown: an MPI job over several hosts
    /// without `MASTER_ADDR`, which only the `mpi` backend can use).
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Which variables it came from.
    pub source: TopologySource,
}

/// Port used when a launcher gives none (torchrun's default).
pub const DEFAULT_PORT: u16 = 29500;

struct Reader<'a, F: Fn(&str) -> Option<String>> {
    get: &'a F,
    /// The launcher's name, for messages.
    source: &'static str,
    /// What to do, for messages.
    hint: &'static str,
}

impl<F: Fn(&str) -> Option<String>> Reader<'_, F> {
    fn err(&self, detail: String) -> Error {
        Error::Topology {
            source_name: self.source.into(),
            detail,
            hint: self.hint,
        }
    }

    fn num(&self, key: &str) -> Result<Option<usize>, Error> {
        match (self.get)(key) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<usize>()
                .map(Some)
                .map_err(|_| self.err(format!("{key}={v:?} is not a non-negative integer"))),
        }
    }

    fn need(&self, key: &str, with: &str) -> Result<usize, Error> {
        self.num(key)?
            .ok_or_else(|| self.err(format!("{with} is set but {key} is missing")))
    }

    /// Both or neither of a pair.
    fn pair(&self, a: &str, b: &str) -> Result<Option<(usize, usize)>, Error> {
        match (self.num(a)?, self.num(b)?) {
            (Some(x), Some(y)) => Ok(Some((x, y))),
            (None, None) => Ok(None),
            (Some(_), None) => Err(self.err(format!("{a} is set but {b} is missing"))),
            (None, Some(_)) => Err(self.err(format!("{b} is set but {a} is missing"))),
        }
    }

    fn port(&self) -> Result<Option<u16>, Error> {
        match (self.get)("MASTER_PORT") {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<u16>()
                .map(Some)
                .map_err(|_| self.err(format!("MASTER_PORT={v:?} is not a port number"))),
        }
    }
}

impl Topology {
    /// A single process: rank 0 of 1, no store needed.
    pub fn single() -> Topology {
        Topology {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_PORT,
            source: TopologySource::Single,
        }
    }

    /// Reads the process environment; see [`Topology::from_vars`].
    pub fn from_env() -> Result<Topology, Error> {
        Topology::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the topology through `lookup`: zrun/torchrun variables first, then OpenMPI, PMI and
    /// Slurm. When several flavours are present they must agree on rank and world size.
    ///
    /// Slurm's variables are read only when no other launcher's are there: under mpirun
    /// inside a Slurm allocation they describe the allocation's step, not this process.
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Topology, Error> {
        let mut found: Vec<Topology> = Vec::new();
        if let Some(t) = torchrun(&lookup)? {
            found.push(t);
        }
        if let Some(t) = openmpi(&lookup)? {
            found.push(t);
        }
        if let Some(t) = pmi(&lookup)? {
            found.push(t);
        }
        if found.is_empty() {
            if let Some(t) = slurm(&lookup)? {
                found.push(t);
            }
        }
        let Some(first) = found.first().cloned() else {
            return Ok(Topology::single());
        };
        for other in &found[1..] {
            if (other.rank, other.world_size) != (first.rank, first.world_size) {
                return Err(Error::Topology {
                    source_name: format!("{} and {}", first.source, other.source),
                    detail: format!(
                        "contradictory variables: {} says rank {} of {}, {} says rank {} of {}",
                        first.source,
                        first.rank,
                        first.world_size,
                        other.source,
                        other.rank,
                        other.world_size
                    ),
                    hint: "unset the variables of the launchers not in use, or start every rank under one launcher",
                });
            }
        }
        Ok(first)
    }
}

fn validate(
    r: &Reader<'_, impl Fn(&str) -> Option<String>>,
    t: Topology,
) -> Result<Topology, Error> {
    if t.world_size == 0 {
        return Err(r.err("world size is 0".into()));
    }
    if t.rank >= t.world_size {
        return Err(r.err(format!(
            "rank {} is not below world size {}",
            t.rank, t.world_size
        )));
    }
    if t.local_world_size == 0 || t.local_world_size > t.world_size {
        return Err(r.err(format!(
            "local world size {} is not in 1..={}",
            t.local_world_size, t.world_size
        )));
    }
    if t.local_rank >= t.local_world_size {
        return Err(r.err(format!(
            "local rank {} is not below local world size {}",
            t.local_rank, t.local_world_size
        )));
    }
    Ok(t)
}

/// MASTER_ADDR/PORT when set; otherwise loopback for a one-host job, empty for several hosts.
fn master(
    r: &Reader<'_, impl Fn(&str) -> Option<String>>,
    one_host: bool,
) -> Result<(String, u16), Error> {
    let addr = (r.get)("MASTER_ADDR").filter(|a| !a.trim().is_empty());
    let addr = match addr {
        Some(a) => a.trim().to_string(),
        None if one_host => "127.0.0.1".into(),
        None => String::new(),
    };
    Ok((addr, r.port()?.unwrap_or(DEFAULT_PORT)))
}

fn torchrun(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Topology>, Error> {
    let r = Reader {
        get,
        source: "zrun/torchrun",
        hint: TORCHRUN_HINT,
    };
    let Some((rank, world)) = r.pair("RANK", "WORLD_SIZE")? else {
        if let Some(k) = ["LOCAL_RANK", "LOCAL_WORLD_SIZE"]
            .into_iter()
            .find(|k| get(k).is_some())
        {
            return Err(r.err(format!("{k} is set but RANK and WORLD_SIZE are missing")));
        }
        return Ok(None);
    };
    let (local_rank, local_world) = r
        .pair("LOCAL_RANK", "LOCAL_WORLD_SIZE")?
        .unwrap_or((rank, world));
    if world > 1 && (get("MASTER_ADDR").is_none() || get("MASTER_PORT").is_none()) {
        return Err(r.err(format!(
            "WORLD_SIZE={world} but MASTER_ADDR or MASTER_PORT is missing"
        )));
    }
    let (master_addr, master_port) = master(&r, true)?;
    let source = if get(crate::TOKEN_ENV).is_some() {
        TopologySource::Zrun
    } else {
        TopologySource::Torchrun
    };
    validate(
        &r,
        Topology {
            rank,
            local_rank,
            world_size: world,
            local_world_size: local_world,
            master_addr,
            master_port,
            source,
        },
    )
    .map(Some)
}

fn openmpi(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Topology>, Error> {
    let r = Reader {
        get,
        source: TopologySource::OpenMpi.name(),
        hint: OPENMPI_HINT,
    };
    let Some((rank, world)) = r.pair("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")? else {
        return Ok(None);
    };
    let local_rank = r.need("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK")?;
    let local_world = r.need("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK")?;
    let (master_addr, master_port) = master(&r, local_world == world)?;
    validate(
        &r,
        Topology {
            rank,
            local_rank,
            world_size: world,
            local_world_size: local_world,
            master_addr,
            master_port,
            source: TopologySource::OpenMpi,
        },
    )
    .map(Some)
}

fn pmi(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Topology>, Error> {
    let r = Reader {
        get,
        source: TopologySource::Pmi.name(),
        hint: PMI_HINT,
    };
    let Some((rank, world)) = r.pair("PMI_RANK", "PMI_SIZE")? else {
        return Ok(None);
    };
    // Hydra's local variables; without them the job is taken to be on one host.
    let (local_rank, local_world) = r
        .pair("MPI_LOCALRANKID", "MPI_LOCALNRANKS")?
        .unwrap_or((rank, world));
    let (master_addr, master_port) = master(&r, local_world == world)?;
    validate(
        &r,
        Topology {
            rank,
            local_rank,
            world_size: world,
            local_world_size: local_world,
            master_addr,
            master_port,
            source: TopologySource::Pmi,
        },
    )
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    pub(super) fn vars(kv: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = kv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    pub(super) fn err(kv: &[(&str, &str)]) -> String {
        Topology::from_vars(vars(kv)).unwrap_err().to_string()
    }

    #[test]
    fn no_variables_is_a_single_process() {
        assert_eq!(Topology::from_vars(vars(&[])).unwrap(), Topology::single());
    }

    #[test]
    fn torchrun_and_zrun_variables() {
        let kv = [
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h0"),
            ("MASTER_PORT", "1234"),
        ];
        let t = Topology::from_vars(vars(&kv)).unwrap();
        assert_eq!(
            (t.rank, t.local_rank, t.world_size, t.local_world_size),
            (5, 1, 8, 4)
        );
        assert_eq!((t.master_addr.as_str(), t.master_port), ("h0", 1234));
        assert_eq!(t.source, TopologySource::Torchrun);
        let mut z = kv.to_vec();
        z.push(("ZRUN_JOB_TOKEN", "x"));
        assert_eq!(
            Topology::from_vars(vars(&z)).unwrap().source,
            TopologySource::Zrun
        );
    }

    #[test]
    fn openmpi_pmi_and_slurm_variables() {
        let t = Topology::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
        ]))
        .unwrap();
        assert_eq!(
            (t.rank, t.world_size, t.local_rank, t.source),
            (2, 3, 2, TopologySource::OpenMpi)
        );
        assert_eq!(t.master_addr, "127.0.0.1");
        let t = Topology::from_vars(vars(&[("PMI_RANK", "1"), ("PMI_SIZE", "4")])).unwrap();
        assert_eq!(
            (t.rank, t.world_size, t.local_world_size, t.source),
            (1, 4, 4, TopologySource::Pmi)
        );
        let t = Topology::from_vars(vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NNODES", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("MASTER_ADDR", "node1"),
        ]))
        .unwrap();
        assert_eq!(
            (
                t.rank,
                t.world_size,
                t.local_rank,
                t.local_world_size,
                t.source
            ),
            (5, 8, 1, 4, TopologySource::Slurm)
        );
        assert_eq!(
            (t.master_addr.as_str(), t.master_port),
            ("node1", DEFAULT_PORT)
        );
        // several hosts without MASTER_ADDR: unknown store host, left to the backend
        let t = Topology::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!(t.master_addr, "");
    }

    #[test]
    fn agreeing_flavours_are_accepted_and_slurm_under_mpirun_is_ignored() {
        let t = Topology::from_vars(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
        ]))
        .unwrap();
        assert_eq!((t.rank, t.source), (1, TopologySource::Torchrun));
    }

    #[test]
    fn broken_environments_give_clear_errors() {
        let e = err(&[("RANK", "0")]);
        assert!(e.contains("RANK is set but WORLD_SIZE is missing"), "{e}");
        let e = err(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(e.contains("rank 3 is not below world size 2"), "{e}");
        let e = err(&[("RANK", "x"), ("WORLD_SIZE", "2")]);
        assert!(
            e.contains("RANK=\"x\" is not a non-negative integer"),
            "{e}"
        );
        let e = err(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("MASTER_ADDR or MASTER_PORT is missing"), "{e}");
        let e = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "99999"),
        ]);
        assert!(
            e.contains("MASTER_PORT=\"99999\" is not a port number"),
            "{e}"
        );
        let e = err(&[("LOCAL_RANK", "0")]);
        assert!(
            e.contains("LOCAL_RANK is set but RANK and WORLD_SIZE are missing"),
            "{e}"
        );
        let e = err(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        assert!(e.contains("OMPI_COMM_WORLD_LOCAL_RANK is missing"), "{e}");
        let e = err(&[("SLURM_PROCID", "0")]);
        assert!(e.contains("SLURM_NPROCS is missing"), "{e}");
        let e = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
        ]);
        assert!(
            e.contains("contradictory") && e.contains("PMI/MPICH says rank 1 of 2"),
            "{e}"
        );
        let e = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(
            e.contains("local rank 2 is not below local world size 2"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_the_launcher_in_use_and_give_its_hint() {
        let e = err(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        assert!(e.contains("(OpenMPI)") && e.contains("mpirun -x"), "{e}");
        assert!(!e.contains("set RANK/WORLD_SIZE"), "{e}");
        let e = err(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")]);
        assert!(
            e.contains("(PMI/MPICH)") && e.contains("mpiexec -genv"),
            "{e}"
        );
        assert!(!e.contains("set RANK/WORLD_SIZE"), "{e}");
        let e = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "x")]);
        assert!(
            e.contains("(Slurm)") && e.contains("start every rank with srun"),
            "{e}"
        );
        assert!(!e.contains("set RANK/WORLD_SIZE"), "{e}");
        let e = err(&[("RANK", "0")]);
        assert!(e.contains("set RANK/WORLD_SIZE"), "{e}");
        let e = err(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
        ]);
        assert!(
            e.contains("OpenMPI says rank 1 of 2, PMI/MPICH says rank 0 of 2")
                && e.contains("unset the variables of the launchers not in use"),
            "{e}"
        );
        assert!(
            !e.contains("OpenMpi") && !e.contains("set RANK/WORLD_SIZE"),
            "{e}"
        );
        assert_eq!(TopologySource::OpenMpi.to_string(), "OpenMPI");
    }

    #[test]
    fn slurm_variables_under_another_launcher_are_not_read() {
        // mpirun inside an allocation: the batch step's Slurm variables, however odd, do not
        // stop a rank that OpenMPI places.
        let t = Topology::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_TASKS_PER_NODE", "1(x3)"),
        ]))
        .unwrap();
        assert_eq!((t.rank, t.source), (1, TopologySource::OpenMpi));
    }
}

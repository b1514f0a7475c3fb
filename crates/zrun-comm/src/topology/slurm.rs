//! Slurm's variables: where a task started by `srun` sits, including `SLURM_TASKS_PER_NODE`'s
//! per-node counts on uneven layouts.

use super::{master, validate, Reader, Topology, TopologySource};
use crate::Error;

/// What to do about a topology error under Slurm's variables.
pub(super) const SLURM_HINT: &str = "start every rank with srun, which sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NNODES/SLURM_NODEID/SLURM_TASKS_PER_NODE; on several nodes also export MASTER_ADDR (the first host of `scontrol show hostnames $SLURM_JOB_NODELIST`) and MASTER_PORT";

/// Tasks on node `node` from `SLURM_TASKS_PER_NODE`, a comma-separated list of counts where
/// `N(xK)` stands for K nodes of N tasks (`4(x2),3` is 4, 4, 3), and how many nodes the list
/// describes. `node` `None` (no `SLURM_NODEID`) is allowed only when every node has the same
/// count. Groups are not expanded, so a list of many nodes costs nothing.
fn slurm_tasks_per_node(v: &str, node: Option<usize>) -> Result<(usize, usize), String> {
    let bad = |why: &str| format!("SLURM_TASKS_PER_NODE={v:?} {why}");
    let mut nodes: usize = 0;
    let mut mine: Option<usize> = None;
    let mut counts = std::collections::BTreeSet::new();
    for group in v.split(',') {
        let group = group.trim();
        let (tasks, repeat) = match group.split_once('(') {
            None => (group, "1"),
            Some((n, rest)) => {
                let k = rest
                    .strip_prefix('x')
                    .and_then(|k| k.strip_suffix(')'))
                    .ok_or_else(|| bad(&format!("has a group {group:?} that is not N or N(xK)")))?;
                (n, k)
            }
        };
        let parse = |t: &str| t.trim().parse::<usize>().ok();
        let (Some(tasks), Some(repeat)) = (parse(tasks), parse(repeat)) else {
            return Err(bad(&format!(
                "has a group {group:?} that is not N or N(xK) with N, K whole numbers"
            )));
        };
        if repeat == 0 {
            return Err(bad(&format!("has a group {group:?} of no nodes")));
        }
        let end = nodes
            .checked_add(repeat)
            .ok_or_else(|| bad("lists more nodes than can be counted"))?;
        if node.is_some_and(|n| (nodes..end).contains(&n)) {
            mine = Some(tasks);
        }
        counts.insert(tasks);
        nodes = end;
    }
    match (node, mine) {
        (Some(_), Some(t)) => Ok((t, nodes)),
        // Past the list's end: the caller reports the length against SLURM_NNODES.
        (Some(_), None) => Ok((0, nodes)),
        (None, _) if counts.len() == 1 => Ok((counts.into_iter().next().unwrap_or(0), nodes)),
        (None, _) => Err(bad(
            "gives the nodes different task counts but SLURM_NODEID is missing",
        )),
    }
}

/// Slurm's variables (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NNODES`,
/// `SLURM_NODEID`, `SLURM_NTASKS_PER_NODE` or `SLURM_TASKS_PER_NODE`), when `SLURM_PROCID` is set.
pub(super) fn slurm(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Topology>, Error> {
    let r = Reader {
        get,
        source: TopologySource::Slurm.name(),
        hint: SLURM_HINT,
    };
    let Some(rank) = r.num("SLURM_PROCID")? else {
        return Ok(None);
    };
    let world = match r.num("SLURM_NTASKS")? {
        Some(w) => w,
        None => r.need("SLURM_NPROCS", "SLURM_PROCID")?,
    };
    let local_rank = r.need("SLURM_LOCALID", "SLURM_PROCID")?;
    let nodes = r.num("SLURM_NNODES")?.unwrap_or(1);
    let node = r.num("SLURM_NODEID")?;
    if let Some(n) = node.filter(|&n| n >= nodes) {
        return Err(r.err(format!(
            "SLURM_NODEID={n} is not below SLURM_NNODES={nodes}"
        )));
    }
    let local_world = match r.num("SLURM_NTASKS_PER_NODE")? {
        Some(n) => n,
        None => match get("SLURM_TASKS_PER_NODE") {
            Some(v) => {
                let (tasks, listed) = slurm_tasks_per_node(&v, node).map_err(|e| r.err(e))?;
                if listed != nodes {
                    return Err(r.err(format!(
                        "SLURM_TASKS_PER_NODE={v:?} lists {listed} node(s) but SLURM_NNODES={nodes}"
                    )));
                }
                tasks
            }
            None if nodes == 1 => world,
            None => {
                return Err(r.err(format!(
                    "SLURM_NNODES={nodes} but neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set"
                )))
            }
        },
    };
    let (master_addr, master_port) = master(&r, nodes == 1)?;
    validate(
        &r,
        Topology {
            rank,
            local_rank,
            world_size: world,
            local_world_size: local_world,
            master_addr,
            master_port,
            source: TopologySource::Slurm,
        },
    )
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, vars};
    use super::super::Topology;

    /// Slurm variables of rank `rank` on node `node` of `nodes`, `tasks` its SLURM_TASKS_PER_NODE.
    fn slurm_vars(
        rank: &'static str,
        ntasks: &'static str,
        local: &'static str,
        nodes: &'static str,
        node: &'static str,
        tasks: &'static str,
    ) -> Vec<(&'static str, &'static str)> {
        vec![
            ("SLURM_PROCID", rank),
            ("SLURM_NTASKS", ntasks),
            ("SLURM_LOCALID", local),
            ("SLURM_NNODES", nodes),
            ("SLURM_NODEID", node),
            ("SLURM_TASKS_PER_NODE", tasks),
            ("MASTER_ADDR", "node0"),
        ]
    }

    #[test]
    fn slurm_uneven_layouts_give_each_node_its_own_count() {
        let local_world = |kv: &[(&str, &str)]| {
            let t = Topology::from_vars(vars(kv)).unwrap();
            (t.rank, t.local_rank, t.local_world_size)
        };
        // 3 tasks on node 0, 4 on node 1: rank 6 is node 1's local rank 3 of 4.
        assert_eq!(
            local_world(&slurm_vars("6", "7", "3", "2", "1", "3,4")),
            (6, 3, 4)
        );
        assert_eq!(
            local_world(&slurm_vars("0", "7", "0", "2", "0", "3,4")),
            (0, 0, 3)
        );
        // 4(x2),3: nodes 0 and 1 have 4, node 2 has 3.
        assert_eq!(
            local_world(&slurm_vars("10", "11", "2", "3", "2", "4(x2),3")),
            (10, 2, 3)
        );
        assert_eq!(
            local_world(&slurm_vars("5", "11", "1", "3", "1", "4(x2),3")),
            (5, 1, 4)
        );
        assert_eq!(
            local_world(&slurm_vars("1", "11", "1", "3", "0", " 2(x1), 4(x1),5")),
            (1, 1, 2)
        );
        // A huge repeat count is counted, not expanded.
        assert_eq!(
            local_world(&slurm_vars(
                "7",
                "8000000000",
                "7",
                "1000000000",
                "999999999",
                "8(x1000000000)"
            )),
            (7, 7, 8)
        );
    }

    #[test]
    fn slurm_task_lists_that_do_not_fit_the_job_are_refused() {
        let cases: [(&[(&str, &str)], &str); 7] = [
            (
                &slurm_vars("6", "7", "3", "3", "1", "3,4"),
                "SLURM_TASKS_PER_NODE=\"3,4\" lists 2 node(s) but SLURM_NNODES=3",
            ),
            (
                &slurm_vars("6", "7", "3", "1", "0", "4(x2),3"),
                "SLURM_TASKS_PER_NODE=\"4(x2),3\" lists 3 node(s) but SLURM_NNODES=1",
            ),
            (
                &slurm_vars("0", "8", "0", "2", "0", "4(x2"),
                "SLURM_TASKS_PER_NODE=\"4(x2\" has a group \"4(x2\" that is not N or N(xK)",
            ),
            (
                &slurm_vars("0", "8", "0", "2", "0", "four(x2)"),
                "that is not N or N(xK) with N, K whole numbers",
            ),
            (
                &slurm_vars("0", "8", "0", "2", "0", "4(x0),4"),
                "has a group \"4(x0)\" of no nodes",
            ),
            (
                &slurm_vars("0", "8", "0", "2", "2", "4(x2)"),
                "SLURM_NODEID=2 is not below SLURM_NNODES=2",
            ),
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "7"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_NNODES", "2"),
                    ("SLURM_TASKS_PER_NODE", "3,4"),
                    ("MASTER_ADDR", "node0"),
                ],
                "gives the nodes different task counts but SLURM_NODEID is missing",
            ),
        ];
        for (kv, want) in cases {
            let e = err(kv);
            assert!(e.contains(want), "want {want:?} in: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        let mut kv = slurm_vars("0", "8", "0", "2", "0", "4(x2)");
        kv.push(("SLURM_NTASKS_PER_NODE", "abc"));
        let e = err(&kv);
        assert!(
            e.contains("SLURM_NTASKS_PER_NODE=\"abc\" is not a non-negative integer"),
            "{e}"
        );
    }
}

//! `[dist]`: the communication backend and the compute device, and how they resolve against
//! what this build and this machine offer: once, before any rank starts, with one-line errors
//! naming the keys and the fix.

use super::ConfigError;
use serde::{Deserialize, Serialize};
use zrun_comm::Backend;

/// Communication backend choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// nccl when the device is CUDA and every rank has a GPU of its own, tcp when the ranks
    /// share one GPU (its tensors staged through host memory) or compute on CPUs; never mpi.
    #[default]
    Auto,
    /// Built-in TCP rings; CPU tensors, and CUDA tensors staged through pinned host memory.
    Tcp,
    /// MPI (feature `mpi`, under mpirun); CPU tensors.
    Mpi,
    /// NCCL (feature `cuda`); CUDA tensors.
    Nccl,
}

impl From<Backend> for BackendChoice {
    fn from(b: Backend) -> BackendChoice {
        match b {
            Backend::Tcp => BackendChoice::Tcp,
            Backend::Mpi => BackendChoice::Mpi,
            Backend::Nccl => BackendChoice::Nccl,
        }
    }
}

/// Device choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// CUDA when this build has it, a GPU is visible and the backend moves CUDA tensors
    /// (auto or nccl); else CPU.
    #[default]
    Auto,
    /// CPU.
    Cpu,
    /// This rank's GPU (`zrun_comm::gpu_index`: its LOCAL_RANK, or 0 when it sees one GPU).
    Cuda,
}

/// `[dist]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// auto, tcp, mpi or nccl.
    pub backend: BackendChoice,
    /// auto, cpu or cuda.
    pub device: DeviceChoice,
    /// Deadline of every collective and of rendezvous, seconds.
    pub timeout_s: u64,
    /// Everything one rank may use, e.g. "6GiB": a real limit on CPU (the process's data
    /// segment), the caching allocator's share of the GPU on CUDA; `zrun plan` fits to it.
    /// A bare number (TOML integer) is bytes.
    #[serde(deserialize_with = "size_text")]
    pub memory_limit: Option<String>,
}

/// A size as the config gives it: a string ("6GiB") or a bare number of bytes, kept as text
/// for [`crate::memory::parse_bytes`] to check.
fn size_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct Size;
    impl serde::de::Visitor<'_> for Size {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a size such as \"6GiB\", or a number of bytes")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
    }
    d.deserialize_any(Size)
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig {
            backend: BackendChoice::Auto,
            device: DeviceChoice::Auto,
            timeout_s: 600,
            memory_limit: None,
        }
    }
}

impl DistConfig {
    /// `memory_limit` in bytes; a malformed size is a config error naming the key.
    pub fn memory_limit_bytes(&self) -> Result<Option<i64>, ConfigError> {
        self.memory_limit
            .as_deref()
            .map(|s| {
                crate::memory::parse_bytes(s)
                    .map_err(|e| ConfigError(format!("dist.memory_limit: {e}")))
            })
            .transpose()
    }
}

/// What this build and this machine offer: the inputs of [`DistConfig::resolve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// CUDA devices libtorch sees (after `CUDA_VISIBLE_DEVICES`).
    pub gpus: usize,
    /// Built with zrun's `cuda` feature (the nccl backend and libtorch's CUDA part).
    pub cuda_built: bool,
    /// Built with zrun's `mpi` feature (the mpi backend).
    pub mpi_built: bool,
    /// `ZRUN_NCCL_SHARE_GPU=1`: NCCL ranks may share one GPU (a test mode, zrun_comm::share).
    pub nccl_share: bool,
}

impl Capabilities {
    /// This process: the backends compiled into it and the GPUs libtorch sees.
    pub fn detect() -> Capabilities {
        Capabilities {
            gpus: if tch::Cuda::is_available() {
                usize::try_from(tch::Cuda::device_count()).unwrap_or(0)
            } else {
                0
            },
            cuda_built: zrun_comm::compiled(Backend::Nccl),
            mpi_built: zrun_comm::compiled(Backend::Mpi),
            nccl_share: zrun_comm::share::requested(),
        }
    }
}

/// The kind of device the ranks compute on; which GPU is each rank's own is decided per rank
/// (`zrun_train::trainer::rank_device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host memory and cores.
    Cpu,
    /// One GPU per rank.
    Cuda,
}

/// `[dist]` resolved: a backend and a device kind that work together in this build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResolvedDist {
    /// The communication backend.
    pub backend: Backend,
    /// The compute device kind.
    pub device: DeviceKind,
}

impl ResolvedDist {
    /// What `auto` chose, as one line for the log; `None` when neither key was `auto`.
    pub fn auto_choices(&self, cfg: &DistConfig) -> Option<String> {
        let mut parts = Vec::new();
        if cfg.backend == BackendChoice::Auto {
            parts.push(format!("dist.backend = \"auto\" chose {}", self.backend));
        }
        if cfg.device == DeviceChoice::Auto {
            let d = match self.device {
                DeviceKind::Cpu => "cpu",
                DeviceKind::Cuda if self.backend == Backend::Nccl => "cuda (one GPU per rank)",
                DeviceKind::Cuda => "cuda",
            };
            parts.push(format!("dist.device = \"auto\" chose {d}"));
        }
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

impl ResolvedDist {
    /// Checks, in the launcher, that the `nproc` ranks it starts on this node (which inherit
    /// its `CUDA_VISIBLE_DEVICES`, so each sees the `visible` devices it sees) can each have
    /// a GPU: refuses more ranks than GPUs ([`zrun_comm::gpu_index`]'s rule), and with nccl
    /// several ranks on one GPU, which NCCL refuses at its init, unless `caps.nccl_share`
    /// (`ZRUN_NCCL_SHARE_GPU=1`, refused in turn where the ranks have GPUs of their own or
    /// the job spans nodes: `world` ranks in all). Nothing to check on CPU.
    pub fn check_node(
        &self,
        nproc: usize,
        world: usize,
        caps: Capabilities,
    ) -> Result<(), ConfigError> {
        if self.device != DeviceKind::Cuda {
            return Ok(());
        }
        let visible = caps.gpus;
        if self.backend == Backend::Nccl {
            zrun_comm::share::check(caps.nccl_share, 0, nproc, world, visible)
                .map_err(|e| ConfigError(format!("--nproc {nproc}: {e}")))?;
        }
        let fix = "start one rank per GPU, or leave --nproc out (it defaults to the visible GPUs); to check the NCCL path with several ranks on one GPU, set ZRUN_NCCL_SHARE_GPU=1 (slow, correctness only)";
        if nproc > 1 && visible == 1 && self.backend == Backend::Nccl && !caps.nccl_share {
            return Err(ConfigError(format!(
                "--nproc {nproc} with dist.backend = nccl: the {nproc} ranks would share the one visible GPU, which NCCL refuses; {fix}"
            )));
        }
        zrun_comm::gpu_index(0, nproc, visible)
            .map(drop)
            .map_err(|e| ConfigError(format!("--nproc {nproc} on CUDA: {e}")))
    }
}

const REBUILD_CUDA: &str = "rebuild with `cargo build --release --features cuda`";

impl DistConfig {
    /// The backend and device kind this config asks for, given what `caps` offers, as one
    /// rank sees it: [`DistConfig::resolve_for`] with one rank per view of the GPUs.
    pub fn resolve(&self, caps: Capabilities) -> Result<ResolvedDist, ConfigError> {
        self.resolve_for(caps, 1)
    }

    /// The backend and device kind for `node_ranks` ranks that see the GPUs `caps` counts (the
    /// launcher's `--nproc`; 1 in a rank, which sees only what it was given). The device
    /// comes first: `cpu` and `cuda` are taken as given; `auto` is CUDA when this build has
    /// it, a GPU is visible and the backend can choose CUDA (`auto` or `nccl`), else CPU.
    /// Then the backend: `auto` is nccl on CUDA, except tcp where several ranks share the one
    /// visible GPU (NCCL refuses two ranks on one device; tcp stages CUDA tensors through
    /// host memory), and tcp on CPU (never mpi).
    ///
    /// Refused, with one line naming the keys and the fix: nccl with cpu; mpi with cuda
    /// (it moves CPU tensors only); a backend or device this build lacks (mpi without the
    /// `mpi` feature, nccl or cuda without `cuda`); cuda, or nccl with auto, where no GPU is
    /// visible.
    pub fn resolve_for(
        &self,
        caps: Capabilities,
        node_ranks: usize,
    ) -> Result<ResolvedDist, ConfigError> {
        use BackendChoice as B;
        use DeviceChoice as D;
        let err = |m: String| Err(ConfigError(m));
        // Pairs that cannot work anywhere come first: the config itself is wrong.
        match (self.backend, self.device) {
            (B::Nccl, D::Cpu) => {
                return err("dist.backend = \"nccl\" with dist.device = \"cpu\": NCCL moves CUDA tensors only; set dist.device = \"cuda\" (or \"auto\") to train on GPUs, or dist.backend = \"tcp\" (or \"auto\") to train on CPUs".into());
            }
            (B::Mpi, D::Cuda) => {
                return err("dist.backend = \"mpi\" with dist.device = \"cuda\": the mpi backend moves CPU tensors only; set dist.backend = \"nccl\" (or \"auto\") to train on GPUs, \"tcp\" to share one GPU between ranks, or dist.device = \"cpu\"".into());
            }
            _ => {}
        }
        // Then what this build lacks.
        if self.backend == B::Mpi && !caps.mpi_built {
            return err("dist.backend = \"mpi\" but this zrun was built without MPI; rebuild with `cargo build --release --features mpi` (needs OpenMPI, see make setup), or set dist.backend = \"tcp\" (or \"auto\")".into());
        }
        if self.backend == B::Nccl && !caps.cuda_built {
            return err(format!("dist.backend = \"nccl\" but this zrun was built without CUDA; {REBUILD_CUDA}, or set dist.backend = \"tcp\" (or \"auto\") to train on CPUs"));
        }
        if self.device == D::Cuda && !caps.cuda_built {
            return err(format!("dist.device = \"cuda\" but this zrun was built without CUDA; {REBUILD_CUDA}, or set dist.device = \"cpu\" (or \"auto\")"));
        }
        // Then this machine.
        let cuda = caps.cuda_built && caps.gpus > 0;
        let device = match (self.device, self.backend) {
            (D::Cpu, _) => DeviceKind::Cpu,
            (D::Cuda, _) if cuda => DeviceKind::Cuda,
            (D::Cuda, _) => {
                return err("dist.device = \"cuda\" but no CUDA device is visible (check CUDA_VISIBLE_DEVICES and nvidia-smi); run on a GPU machine, or set dist.device = \"cpu\" (or \"auto\")".into());
            }
            (D::Auto, B::Tcp | B::Mpi) => DeviceKind::Cpu,
            (D::Auto, B::Nccl) if !cuda => {
                return err("dist.backend = \"nccl\" needs a CUDA device, but none is visible (check CUDA_VISIBLE_DEVICES and nvidia-smi); run on a GPU machine, or set dist.backend = \"tcp\" (or \"auto\") to train on CPUs".into());
            }
            (D::Auto, _) if cuda => DeviceKind::Cuda,
            (D::Auto, _) => DeviceKind::Cpu,
        };
        let backend = match self.backend {
            B::Auto
                if device == DeviceKind::Cuda
                    && node_ranks > 1
                    && caps.gpus == 1
                    && !caps.nccl_share =>
            {
                Backend::Tcp
            }
            B::Auto if device == DeviceKind::Cuda => Backend::Nccl,
            B::Auto | B::Tcp => Backend::Tcp,
            B::Mpi => Backend::Mpi,
            B::Nccl => Backend::Nccl,
        };
        Ok(ResolvedDist { backend, device })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use BackendChoice as B;
    use DeviceChoice as D;

    fn caps(cuda_visible: bool, cuda_built: bool, mpi_built: bool) -> Capabilities {
        Capabilities {
            gpus: usize::from(cuda_visible),
            cuda_built,
            mpi_built,
            nccl_share: false,
        }
    }

    fn resolve(b: B, d: D, c: Capabilities) -> Result<ResolvedDist, String> {
        let cfg = DistConfig {
            backend: b,
            device: d,
            ..DistConfig::default()
        };
        cfg.resolve(c).map_err(|e| e.0)
    }

    fn ok(b: B, d: D, c: Capabilities) -> (Backend, DeviceKind) {
        let r = resolve(b, d, c).unwrap_or_else(|e| panic!("{b:?} {d:?} {c:?}: {e}"));
        (r.backend, r.device)
    }

    /// The error for (b, d, c), checked to be one line naming `needles`.
    fn refused(b: B, d: D, c: Capabilities, needles: &[&str]) {
        let e = resolve(b, d, c).expect_err("must be refused");
        assert!(!e.contains('\n'), "one line: {e}");
        for n in needles {
            assert!(e.contains(n), "{b:?} {d:?} {c:?}: {e:?} lacks {n:?}");
        }
    }

    #[test]
    fn a_memory_limit_is_a_size_string_or_a_bare_number_of_bytes() {
        let parse = |v: &str| toml::from_str::<DistConfig>(&format!("memory_limit = {v}"));
        let bytes = |v: &str| parse(v).unwrap().memory_limit_bytes().unwrap();
        assert_eq!(bytes("1073741824"), Some(1 << 30));
        assert_eq!(bytes("\"6GiB\""), Some(6 << 30));
        assert_eq!(bytes("\"1PiB\""), Some(1 << 50));
        assert!(parse("1e3").unwrap().memory_limit_bytes().is_err());
        let e = parse("true").unwrap_err().to_string();
        assert!(
            e.contains("a size such as \"6GiB\", or a number of bytes"),
            "{e}"
        );
        assert_eq!(toml::from_str::<DistConfig>("").unwrap().memory_limit, None);
    }

    #[test]
    fn auto_picks_nccl_only_for_a_cuda_device() {
        let gpu = caps(true, true, false);
        assert_eq!(ok(B::Auto, D::Auto, gpu), (Backend::Nccl, DeviceKind::Cuda));
        assert_eq!(ok(B::Auto, D::Cuda, gpu), (Backend::Nccl, DeviceKind::Cuda));
        // a CPU config on a GPU machine with a CUDA build: tcp, not nccl (the demo, the tests)
        assert_eq!(ok(B::Auto, D::Cpu, gpu), (Backend::Tcp, DeviceKind::Cpu));
        // no GPU, or a build without CUDA: CPU and tcp; auto never picks mpi
        for c in [
            caps(false, true, true),
            caps(true, false, true),
            caps(false, false, false),
        ] {
            assert_eq!(ok(B::Auto, D::Auto, c), (Backend::Tcp, DeviceKind::Cpu));
        }
    }

    #[test]
    fn auto_device_follows_an_explicit_backend() {
        let gpu = caps(true, true, true);
        assert_eq!(ok(B::Tcp, D::Auto, gpu), (Backend::Tcp, DeviceKind::Cpu));
        assert_eq!(ok(B::Mpi, D::Auto, gpu), (Backend::Mpi, DeviceKind::Cpu));
        assert_eq!(ok(B::Nccl, D::Auto, gpu), (Backend::Nccl, DeviceKind::Cuda));
        assert_eq!(ok(B::Nccl, D::Cuda, gpu), (Backend::Nccl, DeviceKind::Cuda));
        assert_eq!(ok(B::Tcp, D::Cpu, gpu), (Backend::Tcp, DeviceKind::Cpu));
        assert_eq!(
            ok(B::Mpi, D::Cpu, caps(false, false, true)),
            (Backend::Mpi, DeviceKind::Cpu)
        );
    }

    #[test]
    fn impossible_pairs_are_refused_on_any_machine() {
        for c in [caps(true, true, true), caps(false, false, false)] {
            refused(
                B::Nccl,
                D::Cpu,
                c,
                &[
                    "dist.backend = \"nccl\"",
                    "dist.device = \"cpu\"",
                    "set dist.device = \"cuda\"",
                ],
            );
            refused(
                B::Mpi,
                D::Cuda,
                c,
                &[
                    "dist.backend = \"mpi\"",
                    "dist.device = \"cuda\"",
                    "CPU tensors only",
                    "dist.backend = \"nccl\"",
                ],
            );
        }
    }

    #[test]
    fn ranks_sharing_one_gpu_get_tcp_and_ranks_with_their_own_get_nccl() {
        let cfg = |b| DistConfig {
            backend: b,
            ..DistConfig::default()
        };
        let with = |gpus| Capabilities {
            gpus,
            cuda_built: true,
            mpi_built: false,
            nccl_share: false,
        };
        let r = |b, gpus, ranks| {
            let r = cfg(b).resolve_for(with(gpus), ranks).unwrap();
            (r.backend, r.device)
        };
        // one GPU, two ranks of the launcher: tcp, staged, on CUDA
        assert_eq!(r(B::Auto, 1, 2), (Backend::Tcp, DeviceKind::Cuda));
        // a GPU per rank, or a rank that sees only its own: nccl
        assert_eq!(r(B::Auto, 4, 4), (Backend::Nccl, DeviceKind::Cuda));
        assert_eq!(r(B::Auto, 1, 1), (Backend::Nccl, DeviceKind::Cuda));
        // tcp with cuda is a real choice now; nccl stays as asked (check_node refuses it)
        let tcp_cuda = DistConfig {
            backend: B::Tcp,
            device: D::Cuda,
            ..DistConfig::default()
        };
        let t = tcp_cuda.resolve_for(with(1), 2).unwrap();
        assert_eq!((t.backend, t.device), (Backend::Tcp, DeviceKind::Cuda));
        assert_eq!(r(B::Nccl, 1, 2), (Backend::Nccl, DeviceKind::Cuda));
        // ZRUN_NCCL_SHARE_GPU=1: auto keeps nccl for ranks sharing the GPU
        let sharing = Capabilities {
            nccl_share: true,
            ..with(1)
        };
        let s = cfg(B::Auto).resolve_for(sharing, 2).unwrap();
        assert_eq!((s.backend, s.device), (Backend::Nccl, DeviceKind::Cuda));
        let shared = cfg(B::Auto).resolve_for(with(1), 2).unwrap();
        assert_eq!(
            shared.auto_choices(&cfg(B::Auto)).unwrap(),
            "dist.backend = \"auto\" chose tcp, dist.device = \"auto\" chose cuda"
        );
    }

    #[test]
    fn what_the_build_lacks_is_refused_with_the_feature_to_build() {
        let gpu_no_features = caps(true, false, false);
        refused(
            B::Mpi,
            D::Auto,
            gpu_no_features,
            &["dist.backend = \"mpi\"", "without MPI", "--features mpi"],
        );
        refused(
            B::Nccl,
            D::Auto,
            gpu_no_features,
            &["dist.backend = \"nccl\"", "without CUDA", "--features cuda"],
        );
        refused(
            B::Auto,
            D::Cuda,
            gpu_no_features,
            &["dist.device = \"cuda\"", "without CUDA", "--features cuda"],
        );
    }

    #[test]
    fn cuda_without_a_visible_gpu_is_refused() {
        let built = caps(false, true, true);
        refused(
            B::Auto,
            D::Cuda,
            built,
            &["dist.device = \"cuda\"", "no CUDA device is visible"],
        );
        refused(
            B::Nccl,
            D::Auto,
            built,
            &[
                "dist.backend = \"nccl\"",
                "none is visible",
                "dist.backend = \"tcp\"",
            ],
        );
    }

    #[test]
    fn the_launcher_refuses_more_ranks_than_gpus_on_its_node() {
        let nccl = ResolvedDist {
            backend: Backend::Nccl,
            device: DeviceKind::Cuda,
        };
        let gpus = |gpus| Capabilities {
            gpus,
            cuda_built: true,
            mpi_built: false,
            nccl_share: false,
        };
        assert!(nccl.check_node(8, 8, gpus(8)).is_ok());
        assert!(nccl.check_node(2, 2, gpus(8)).is_ok());
        assert!(nccl.check_node(1, 1, gpus(1)).is_ok());
        let e = nccl.check_node(4, 4, gpus(2)).unwrap_err().0;
        assert!(
            e.contains("--nproc 4") && e.contains("sees 2 CUDA device") && e.contains("--nproc 2"),
            "{e}"
        );
        let e = nccl.check_node(2, 2, gpus(1)).unwrap_err().0;
        assert!(
            e.contains("--nproc 2")
                && e.contains("share the one visible GPU")
                && e.contains("NCCL")
                && e.contains("ZRUN_NCCL_SHARE_GPU=1"),
            "{e}"
        );
        // the test mode: two NCCL ranks on the one GPU; refused where each has its own GPU
        // or where the job spans nodes
        let share = |n| Capabilities {
            nccl_share: true,
            ..gpus(n)
        };
        assert!(nccl.check_node(2, 2, share(1)).is_ok());
        let e = nccl.check_node(2, 2, share(2)).unwrap_err().0;
        assert!(e.contains("GPUs of their own"), "{e}");
        let e = nccl.check_node(2, 4, share(1)).unwrap_err().0;
        assert!(e.contains("one node only"), "{e}");
        // on CPU there is nothing to check
        let cpu = ResolvedDist {
            backend: Backend::Tcp,
            device: DeviceKind::Cpu,
        };
        assert!(cpu.check_node(16, 16, gpus(0)).is_ok());
    }

    #[test]
    fn the_log_line_says_what_auto_chose() {
        let cfg = DistConfig::default();
        let r = cfg.resolve(caps(true, true, false)).unwrap();
        assert_eq!(
            r.auto_choices(&cfg).unwrap(),
            "dist.backend = \"auto\" chose nccl, dist.device = \"auto\" chose cuda (one GPU per rank)"
        );
        let cpu = DistConfig {
            device: D::Cpu,
            ..DistConfig::default()
        };
        let r = cpu.resolve(caps(true, true, false)).unwrap();
        assert_eq!(
            r.auto_choices(&cpu).unwrap(),
            "dist.backend = \"auto\" chose tcp"
        );
        let explicit = DistConfig {
            backend: B::Tcp,
            device: D::Cpu,
            ..DistConfig::default()
        };
        assert_eq!(
            explicit
                .resolve(caps(false, false, false))
                .unwrap()
                .auto_choices(&explicit),
            None
        );
    }
}

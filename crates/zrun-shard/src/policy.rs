//! Policies chosen in the `[zero]` config section, as enums resolved once.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// ZeRO stage: what is sharded across ranks (see the table in DESIGN.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Stage {
    /// Plain data parallelism: everything replicated, gradients all-reduced.
    #[default]
    Zero0,
    /// Optimizer state sharded.
    Zero1,
    /// Optimizer state and gradients sharded.
    Zero2,
    /// Optimizer state, gradients and parameters sharded.
    Zero3,
}

impl Stage {
    /// The stage number 0-3.
    pub fn number(self) -> u8 {
        self as u8
    }

    /// The stage for a number, or `None` outside 0-3.
    pub fn from_number(n: i64) -> Option<Stage> {
        [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3]
            .get(usize::try_from(n).ok()?)
            .copied()
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.number())
    }
}

impl Serialize for Stage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.number())
    }
}

impl<'de> Deserialize<'de> for Stage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Stage, D::Error> {
        let n = i64::deserialize(d)?;
        Stage::from_number(n).ok_or_else(|| {
            serde::de::Error::custom(format!("{n} is not a ZeRO stage; allowed: 0, 1, 2 or 3"))
        })
    }
}

/// Compute precision of parameters, activations and gathers (the master copy is fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in fp32.
    #[default]
    Fp32,
    /// bf16 compute with fp32 master weights.
    Bf16,
    /// fp16 compute with fp32 master weights and dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// Bytes per element of the compute dtype.
    pub fn bytes(self) -> i64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }

    /// The libtorch kind of the compute dtype.
    pub fn kind(self) -> tch::Kind {
        match self {
            Precision::Fp32 => tch::Kind::Float,
            Precision::Bf16 => tch::Kind::BFloat16,
            Precision::Fp16 => tch::Kind::Half,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

/// dtype in which gradients are reduced across ranks and accumulated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceDtype {
    /// fp32 (default): exact accumulation over micro-steps and ranks.
    #[default]
    Fp32,
    /// bf16: half the gradient memory and traffic.
    Bf16,
}

impl ReduceDtype {
    /// The libtorch kind.
    pub fn kind(self) -> tch::Kind {
        match self {
            ReduceDtype::Fp32 => tch::Kind::Float,
            ReduceDtype::Bf16 => tch::Kind::BFloat16,
        }
    }
}

impl fmt::Display for ReduceDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceDtype::Fp32 => "fp32",
            ReduceDtype::Bf16 => "bf16",
        })
    }
}

/// Where the fp32 master and the optimizer state live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// On the compute device.
    #[default]
    None,
    /// In host memory, updated by the CPU AdamW.
    Cpu,
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Cpu => "cpu",
        })
    }
}

//! Whether two checkpoints hold the same state, bit for bit, whatever world sizes wrote them.

use crate::{Checkpoint, Part, Result};

impl Checkpoint {
    /// The first unit and part (master weights, `exp_avg`, `exp_avg_sq`) whose values differ
    /// bit for bit from `other`'s, or a difference in their layouts or optimizer step count;
    /// `None` when both hold the same state. Reads and verifies every file of both.
    pub fn first_difference(&self, other: &Checkpoint) -> Result<Option<String>> {
        let (a, b) = (&self.manifest, &other.manifest);
        if a.optimizer.steps != b.optimizer.steps {
            return Ok(Some(format!(
                "optimizer steps {} against {}",
                a.optimizer.steps, b.optimizer.steps
            )));
        }
        let (mut ra, mut rb) = (self.reader(), other.reader());
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for (u, (ua, ub)) in a.units.iter().zip(&b.units).enumerate() {
            if ua.name != ub.name || ua.numel != ub.numel || ua.views != ub.views {
                return Ok(Some(format!("unit {} is laid out differently", ua.name)));
            }
            for part in Part::ALL {
                let n = ua.numel as usize;
                x.resize(n, 0.0);
                y.resize(n, 0.0);
                ra.read(u, part, 0, &mut x)?;
                rb.read(u, part, 0, &mut y)?;
                if let Some(i) = (0..n).find(|&i| x[i].to_bits() != y[i].to_bits()) {
                    return Ok(Some(format!(
                        "unit {} {}: element {i} is {} against {}",
                        ua.name,
                        part.suffix(),
                        x[i],
                        y[i]
                    )));
                }
            }
        }
        if a.units.len() != b.units.len() {
            return Ok(Some("the unit counts differ".into()));
        }
        ra.verify()?;
        rb.verify()?;
        Ok(None)
    }
}

//! Print every GPT and Llama preset's parameter count and training FLOPs per token, and time
//! the counter-based init of the largest parameter of `gpt2-xl`.
//!
//!     cargo run --release -p zrun-models --example presets

use std::time::Instant;

use zrun_models::{ArchConfig, Gpt, GptConfig, LlamaConfig, Model};

fn main() -> Result<(), zrun_models::Error> {
    println!(
        "{:<12} {:>14} {:>18} {:>8}",
        "preset", "params", "train FLOP/token", "/ 6N"
    );
    let all = GptConfig::PRESETS
        .iter()
        .map(|n| ("gpt", n))
        .chain(LlamaConfig::PRESETS.iter().map(|n| ("llama", n)));
    for (arch, name) in all {
        let model = ArchConfig::preset(arch, name)?.build()?;
        let n = model.param_count();
        let f = model.flops_per_token();
        println!(
            "{name:<12} {n:>14} {f:>18.4e} {:>8.3}",
            f / (6.0 * n as f64)
        );
    }
    let xl = Gpt::new(GptConfig::preset("gpt2-xl")?)?;
    let wte = &xl.units()[0].params()[0];
    let mut buf = vec![0f32; wte.numel() as usize];
    let t0 = Instant::now();
    wte.init_into(0, 0, &mut buf);
    let s = t0.elapsed().as_secs_f64();
    println!(
        "init_into {} ({} elements): {:.3} s, {:.1} M elements/s",
        wte.name,
        buf.len(),
        s,
        buf.len() as f64 / s / 1e6
    );
    Ok(())
}

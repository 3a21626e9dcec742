//! train — the smallest complete training loop through libctr's Rust binding.
//!
//! The Rust counterpart of examples/c/train.c: builds a tiny GPT in memory,
//! trains 60 steps on one CPU rank over the library's built-in synthetic
//! corpus and prints the loss every 10. It exits with status 1 if a call fails
//! (printing the status name and the library's message) or if the final loss
//! is not below the first, so it doubles as a test.
//!
//! Run: CTR_LIB_DIR=<build>/lib LD_LIBRARY_PATH=<build>/lib cargo run --release

use ctr::{Graph, Loader, Mesh, Options, Step};

const BATCH: usize = 8;
const SEQ: usize = 64;
const STEPS: i64 = 60;

fn main() {
    match train() {
        Ok((first, last)) if last < first => println!("loss {first:.4} -> {last:.4}"),
        Ok((first, last)) => {
            eprintln!(
                "train: the loss did not fall: {first:.4} at step 1, {last:.4} at step {STEPS}"
            );
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("train: {e}");
            std::process::exit(1);
        }
    }
}

fn train() -> ctr::Result<(f64, f64)> {
    // The model: gpt preset, small enough to train in seconds on a CPU.
    let graph = Graph::preset(
        "gpt",
        &Options::new()
            .int("layers", 2)
            .int("dim", 128)
            .int("heads", 4)
            .int("vocab", 256)
            .int("seq", SEQ as i64),
    )?;
    // One CPU rank; empty options take every default.
    let mesh = Mesh::new(&Options::new())?;
    // The compiled step: autodiff, memory plan, AdamW state.
    let mut step = Step::new(
        &mesh,
        &graph,
        &Options::new()
            .int("batch", BATCH as i64)
            .int("seq", SEQ as i64)
            .float("lr", 1e-3)
            .int("warmup_steps", 10),
    )?;
    let mem = step.memory()?;
    println!(
        "gpt: {} params, {:.1} MiB planned",
        graph.param_count()?,
        (mem.arena_bytes + mem.param_bytes + mem.optimizer_bytes) as f64 / (1024.0 * 1024.0)
    );

    // The built-in corpus (no path); attached, so a checkpoint would carry
    // the data position along with the weights.
    step.attach_loader(Loader::builtin(&Options::new().int("seq", SEQ as i64))?)?;

    let (mut first, mut last) = (0.0, 0.0);
    for i in 1..=STEPS {
        step.feed_from_loader(BATCH)?;
        let m = step.run()?;
        if i == 1 {
            first = m.loss;
        }
        last = m.loss;
        if i == 1 || i % 10 == 0 {
            println!("step {i:2} | loss {:.4} | lr {:.2e} | {:.0} ms", m.loss, m.lr, m.step_ms);
        }
    }
    Ok((first, last))
}

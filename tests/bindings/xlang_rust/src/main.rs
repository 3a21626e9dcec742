//! The Rust side of the cross-language bit-identity test.
//!
//! Runs the recipe of tests/bindings/xlang.c through the safe `ctr` crate and
//! prints `step <i> loss <%.17g>` per step; run_xlang.py compares the output
//! byte for byte with the C, Go and Python programs.

use ctr::{Graph, Loader, Mesh, Options, Step};

const SEQ: usize = 64;
const BATCH: usize = 4;

/// C's `%.17g`, which Rust's formatter has no direct equivalent of: 17
/// significant digits, trailing zeros dropped, exponent form when the decimal
/// exponent is below -4 or at least 17. Rust's float formatting is exactly
/// rounded, as glibc's printf is, so the digits agree.
fn format_g17(v: f64) -> String {
    const P: i32 = 17;
    if !v.is_finite() {
        return if v.is_nan() {
            "nan".into()
        } else if v > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    // Rounded to P significant digits; the exponent after rounding decides the form.
    let sci = format!("{:.*e}", (P - 1) as usize, v);
    let (mantissa, exp) = sci.split_once('e').expect("exponent");
    let exp: i32 = exp.parse().expect("exponent digits");
    fn trim(s: &str) -> &str {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.')
        } else {
            s
        }
    }
    if !(-4..P).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{}{:02}", trim(mantissa), sign, exp.abs())
    } else {
        trim(&format!("{:.*}", (P - 1 - exp) as usize, v)).to_string()
    }
}

fn run() -> ctr::Result<()> {
    let graph = Graph::preset(
        "gpt",
        &Options::new()
            .int("layers", 2)
            .int("dim", 64)
            .int("heads", 4)
            .int("vocab", 256)
            .int("seq", SEQ as i64),
    )?;
    let mesh = Mesh::new(&Options::new())?;
    let mut step = Step::new(
        &mesh,
        &graph,
        &Options::new()
            .int("batch", BATCH as i64)
            .int("seed", 1)
            .float("lr", 1e-3)
            .int("warmup_steps", 2)
            .int("decay_steps", 10),
    )?;
    let mut loader = Loader::builtin(&Options::new().int("seq", SEQ as i64).int("seed", 0))?;
    let (mut tokens, mut targets) = (vec![0i32; BATCH * SEQ], vec![0i32; BATCH * SEQ]);
    for i in 1..=10 {
        loader.next(BATCH, &mut tokens, &mut targets)?;
        step.set_input("tokens", &tokens)?;
        step.set_input("targets", &targets)?;
        let m = step.run()?;
        println!("step {i} loss {}", format_g17(m.loss));
    }
    Ok(())
}

fn main() {
    // The formatter is checked against values whose %.17g is known.
    assert_eq!(format_g17(5.548063278198242), "5.5480632781982422");
    assert_eq!(format_g17(4.690710544586182), "4.6907105445861816");
    assert_eq!(format_g17(0.5), "0.5");
    assert_eq!(format_g17(1e-5), "1.0000000000000001e-05");
    assert_eq!(format_g17(1e20), "1e+20");
    assert_eq!(format_g17(100.0), "100");
    if let Err(e) = run() {
        eprintln!("xlang_rust: {e}");
        std::process::exit(1);
    }
}

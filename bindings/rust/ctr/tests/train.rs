//! End-to-end tests of the safe binding against the real libctr: training
//! lowers the loss, a checkpoint restores the exact trajectory, errors carry
//! the library's status and message, and handles can be dropped in any order.
//!
//! Needs libctr at link and run time (CTR_LIB_DIR or pkg-config, and
//! LD_LIBRARY_PATH); tests/bindings/run_rust.sh sets both.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use ctr::{Graph, Loader, Mesh, Options, Resumed, Status, Step, TokenWriter, Tokens};

const SEQ: usize = 64;
const BATCH: usize = 4;

fn graph() -> Graph {
    let opts = Options::new()
        .int("layers", 2)
        .int("dim", 64)
        .int("heads", 4)
        .int("vocab", 256)
        .int("seq", SEQ as i64);
    Graph::preset("gpt", &opts).expect("gpt preset")
}

fn step_options() -> Options {
    Options::new()
        .int("batch", BATCH as i64)
        .int("seed", 1)
        .float("lr", 3e-3)
        .int("warmup_steps", 2)
        .int("decay_steps", 20)
}

fn loader() -> Loader {
    Loader::builtin(&Options::new().int("seq", SEQ as i64).int("seed", 0)).expect("loader")
}

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ctr_rust_{tag}_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// A cluster profile for the planner: two devices per host.
const PROFILE: &str = r#"{"name": "t", "devices_per_host": 2, "device": {"name": "core", "memory_bytes": 17179869184, "flops": 1e11, "bytes_per_s": 1e10, "launch_us": 5}, "links": {"host": {"latency_us": 3, "bytes_per_s": 4e9}, "network": {"latency_us": 50, "bytes_per_s": 1e8}}}"#;

#[test]
fn abi_and_version() {
    ctr::check_abi().expect("the loaded libctr speaks this binding's ABI");
    assert_eq!(ctr::abi_version(), ctr::ABI_VERSION);
    assert_eq!(ctr::version().split('.').count(), 3, "version {}", ctr::version());
    assert_eq!(Status::INVALID_GRAPH.name(), "invalid graph");
    assert_eq!(ctr::DType::F32.size(), 4);
}

#[test]
fn graph_and_mesh_introspection() {
    let g = graph();
    assert_eq!(g.input_names().unwrap(), vec!["tokens".to_string(), "targets".to_string()]);
    let params = g.param_names().unwrap();
    assert!(!params.is_empty());
    let total: usize = params.iter().map(|p| g.tensor_info(p).unwrap().numel().unwrap()).sum();
    assert_eq!(total as i64, g.param_count().unwrap());
    assert!(g.flops_per_token(0).unwrap() > 0.0);
    let plan = g
        .plan(&Options::new().int("world", 2).int("global_batch", 4).string("cluster", PROFILE))
        .unwrap();
    assert!(plan.contains("\"mesh\":\"fsdp=2\"") && plan.contains("\"step_ms\""), "{plan}");
    let err = g.plan(&Options::new().int("world", 2).int("global_batch", 4)).unwrap_err();
    assert!(err.to_string().contains("'cluster'"), "{err}");
    let info = g.tensor_info("tokens").unwrap();
    assert_eq!(info.dtype, ctr::DType::I32);

    let mesh = Mesh::new(&Options::new()).unwrap();
    assert_eq!((mesh.rank(), mesh.world_size()), (0, 1));
    assert_eq!(mesh.device(), "cpu");
    assert_eq!(mesh.axis_size("dp"), 1);
    // Host collectives on one rank: the group is this rank alone.
    assert_eq!(mesh.group("world").unwrap(), (0, 1, vec![0]));
    let mut x = [1.5f32, -2.0];
    mesh.all_reduce("world", &mut x, "max").unwrap();
    assert_eq!(x, [1.5, -2.0]);
    assert_eq!(mesh.all_gather("world", &[7i64, 8]).unwrap(), vec![7, 8]);
    mesh.barrier("world").unwrap();
    let err = mesh.all_reduce("xp", &mut x, "sum").unwrap_err();
    assert!(err.to_string().contains("no axis 'xp'"), "{err}");
    assert!(mesh.all_reduce("world", &mut x, "mean").is_err());
    assert!(mesh.describe().unwrap().contains("\"world\":1"));

    // A graph survives a save/load round trip through a file and a buffer.
    let dir = TempDir::new("graph");
    let path = dir.0.join("g.ctrg");
    g.save_file(&path).unwrap();
    let again = Graph::load_file(&path).unwrap();
    assert_eq!(again.param_names().unwrap(), params);
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(
        Graph::load_buffer(&bytes).unwrap().param_count().unwrap(),
        g.param_count().unwrap()
    );
}

#[test]
fn moe_metrics_count_the_tokens_of_each_expert() {
    let mesh = Mesh::new(&Options::new()).unwrap();
    let opts = Options::new()
        .int("layers", 1)
        .int("dim", 32)
        .int("heads", 4)
        .int("kv_heads", 2)
        .int("vocab", 256)
        .int("seq", 16)
        .int("experts", 4)
        .int("top_k", 2)
        .int("ffn_dim", 32);
    let g = Graph::preset("moe", &opts).unwrap();
    let mut step = Step::new(&mesh, &g, &Options::new().int("batch", 2).int("seq", 16)).unwrap();
    assert_eq!(step.moe_metrics().unwrap(), "[]");
    // One rank: its data share is the whole batch, and no collective runs.
    assert_eq!((mesh.data_rank(), mesh.data_size()), (0, 1));
    let ids: Vec<i32> = (0..32).collect();
    step.set_input("tokens", &ids).unwrap();
    step.set_input("targets", &ids).unwrap();
    step.run().unwrap();
    assert_eq!(step.comm_metrics().unwrap(), "{}");
    let text = step.moe_metrics().unwrap();
    assert!(text.contains("\"layer\":\"layers.0.moe\"") && text.contains("tokens_per_expert"), "{text}");
    // Every token picks 2 of the 4 experts: the counts sum to 2 * 32.
    let counts = text.split("\"tokens_per_expert\":[").nth(1).unwrap().split(']').next().unwrap();
    let total: i64 = counts.split(',').map(|c| c.trim().parse::<i64>().unwrap()).sum();
    assert_eq!(total, 64, "{text}");

    // The struct call reports the same layer and counts.
    let layers = step.moe_layers().unwrap();
    assert_eq!(layers.len(), 1, "{layers:?}");
    let l = &layers[0];
    assert_eq!(l.layer, "layers.0.moe");
    assert_eq!(l.experts, 4);
    assert_eq!(l.tokens_per_expert.len(), 4);
    assert_eq!(l.tokens_per_expert.iter().sum::<i64>(), 64, "{l:?}");
    let listed: Vec<String> = l.tokens_per_expert.iter().map(|n| n.to_string()).collect();
    assert_eq!(counts.split(',').map(|c| c.trim()).collect::<Vec<_>>(), listed, "{text}");
    for (key, value) in [("aux_loss", l.aux_loss), ("z_loss", l.z_loss)] {
        assert_eq!(text.contains(&format!("\"{key}\"")), value.is_some(), "{key}: {text} {l:?}");
    }
    // The moe preset's layers have both terms.
    assert!(l.aux_loss.unwrap() > 0.0 && l.z_loss.unwrap() > 0.0, "{l:?}");
}

#[test]
fn moe_layers_empty_without_experts() {
    let mesh = Mesh::new(&Options::new()).unwrap();
    let mut step = Step::new(&mesh, &graph(), &step_options()).unwrap();
    assert!(step.moe_layers().unwrap().is_empty());
    step.attach_loader(loader()).unwrap();
    step.feed_from_loader(BATCH).unwrap();
    step.run().unwrap();
    assert!(step.moe_layers().unwrap().is_empty());
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn token_files_written_and_read_as_the_loader_reads_them() {
    let dir = TempDir::new("tokens");
    let ids: Vec<u32> = (0..1000u32).map(|i| i % 300).collect();
    let a = dir.0.join("a.bin");
    // Written in two pieces, renamed into place by finish.
    let mut w = TokenWriter::create(&a, "llmc", 2, ids.len() as i64).unwrap();
    w.write(&ids[..400]).unwrap();
    w.write(&ids[400..]).unwrap();
    assert!(!a.exists());
    w.finish().unwrap();
    ctr::write_tokens(dir.0.join("b.npy"), &ids[..500], "npy", 4).unwrap();
    assert_eq!(files_in(&dir.0), ["a.bin", "b.npy"]);

    let t = Tokens::open(&a, None).unwrap();
    let info = t.info().unwrap();
    assert!(info.contains("\"tokens\":1000") && info.contains("\"max_id\":299"), "{info}");
    assert!(info.contains("llm.c") && info.contains("\"width\":2"), "{info}");
    assert!(info.contains("\"header_bytes\":1024"), "{info}");
    assert_eq!(t.read(0, 1000).unwrap(), ids);
    assert_eq!(t.read(295, 10).unwrap(), [295, 296, 297, 298, 299, 0, 1, 2, 3, 4]);
    let mut buf = [0u32; 3];
    t.read_into(998, &mut buf[..2]).unwrap();
    assert_eq!(buf, [98, 99, 0]);
    assert!(t.read(1000, 0).unwrap().is_empty());
    // Windows of seq inputs need seq + 1 tokens and overlap by one.
    assert_eq!(t.samples(16, "windows", -1).unwrap(), (1000 - 1) / 16);
    assert!(t.samples(16, "documents", 299).unwrap() > 0);
    let npy = Tokens::open_as(dir.0.join("b.npy"), "npy", None).unwrap();
    assert!(npy.info().unwrap().contains("\"tokens\":500"));
    assert_eq!(npy.read(0, 500).unwrap(), &ids[..500]);

    // A manifest of both files: listed, and each sub-dataset opened as one.
    let m = dir.0.join("m.json");
    std::fs::write(
        &m,
        r#"{"datasets": [{"name": "x", "files": ["a.bin"], "weight": 3}, {"name": "y", "files": ["b.npy"]}]}"#,
    )
    .unwrap();
    let listed = ctr::manifest_info(&m).unwrap();
    assert!(listed.contains("\"name\":\"x\"") && listed.contains("\"name\":\"y\""), "{listed}");
    assert!(listed.contains("\"weight\":3"), "{listed}");
    let y = Tokens::open(&m, Some(&Options::new().int("dataset", 1))).unwrap();
    let yi = y.info().unwrap();
    assert!(yi.contains("\"tokens\":500") && yi.contains("\"width\":4"), "{yi}");
    assert_eq!(Tokens::open_as(&m, "auto", Some(0)).unwrap().read(0, 3).unwrap(), [0, 1, 2]);

    // Refusals carry the library's status and message.
    let err = Tokens::open(&m, None).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT, "{err}");
    assert!(err.message().contains("option 'dataset'"), "{err}");
    let err = Tokens::open_as(&a, "llmc", Some(0)).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT, "{err}");
    let err = t.read(995, 10).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT, "{err}");
    assert!(err.message().contains("[995, 1005) of 1000"), "{err}");
    assert_eq!(t.samples(5000, "windows", -1).unwrap_err().status(), Status::DATA_ERROR);
    assert_eq!(t.samples(16, "sentences", -1).unwrap_err().status(), Status::INVALID_ARGUMENT);
    let err = Tokens::open(dir.0.join("missing.bin"), None).unwrap_err();
    assert_eq!(err.status(), Status::IO_ERROR, "{err}");
    assert!(err.message().contains("missing.bin"), "{err}");
    std::fs::write(dir.0.join("bad.json"), r#"{"datasets": [{"name": "x"}]}"#).unwrap();
    let err = ctr::manifest_info(dir.0.join("bad.json")).unwrap_err();
    assert_eq!(err.status(), Status::DATA_ERROR, "{err}");
    assert_eq!(
        TokenWriter::create(dir.0.join("c.bin"), "bytes", 2, 1).unwrap_err().status(),
        Status::INVALID_ARGUMENT
    );
    assert_eq!(
        TokenWriter::create(dir.0.join("c.bin"), "llmc", 3, 1).unwrap_err().status(),
        Status::INVALID_ARGUMENT
    );

    // An id too big for width 2, a short file and a writer dropped unfinished
    // leave nothing behind.
    let c = dir.0.join("c.bin");
    let err = ctr::write_tokens(&c, &[1, 70000], "llmc", 2).unwrap_err();
    assert_eq!(err.status(), Status::DATA_ERROR, "{err}");
    assert!(err.message().contains("70000"), "{err}");
    let mut short = TokenWriter::create(&c, "u16", 2, 3).unwrap();
    short.write(&[1, 2]).unwrap();
    assert_eq!(short.finish().unwrap_err().status(), Status::DATA_ERROR);
    let mut unfinished = TokenWriter::create(&c, "u32", 4, 2).unwrap();
    unfinished.write(&[1, 2]).unwrap();
    assert!(files_in(&dir.0).contains(&"c.bin.tmp".to_string()), "{:?}", files_in(&dir.0));
    drop(unfinished);
    assert_eq!(files_in(&dir.0), ["a.bin", "b.npy", "bad.json", "m.json"]);

    // The loader reads the file the writer wrote.
    let mut l = Loader::open(&a, &Options::new().int("seq", 16).int("seed", 0)).unwrap();
    assert_eq!(l.info().unwrap(), (1000, 299));
    let (tokens, targets) = l.next_batch(2).unwrap();
    assert!(tokens.iter().chain(&targets).all(|&x| (0..300).contains(&x)));
}

#[test]
fn ten_steps_lower_the_loss() {
    let mesh = Mesh::new(&Options::new()).unwrap();
    let mut step = Step::new(&mesh, &graph(), &step_options()).unwrap();
    let mem = step.memory().unwrap();
    assert!(mem.arena_bytes > 0 && mem.param_bytes > 0 && mem.optimizer_bytes > 0);
    step.attach_loader(loader()).unwrap();
    let mut losses = Vec::new();
    for i in 1..=10 {
        step.feed_from_loader(BATCH).unwrap();
        let m = step.run().unwrap();
        assert_eq!(m.step, i);
        assert_eq!(m.tokens, (BATCH * SEQ) as i64);
        assert!(m.loss.is_finite());
        // One rank: no collectives, so compute is the forward and backward time.
        assert!(m.compute_ms > 0.0 && m.compute_ms <= m.step_ms, "{m:?}");
        assert!(m.comm_ms >= 0.0 && m.exposed_comm_ms >= 0.0, "{m:?}");
        assert!(m.save_wait_ms >= 0.0, "{m:?}");
        losses.push(m.loss);
    }
    assert_eq!(step.count(), 10);
    // Near ln(256) at the start; the built-in corpus is learnable.
    assert!((losses[0] - (256f64).ln()).abs() < 0.5, "first loss {}", losses[0]);
    assert!(losses[9] < losses[0] - 0.1, "loss did not fall: {losses:?}");
    // evaluate does not step.
    let before = step.count();
    assert!(step.evaluate().unwrap().is_finite());
    assert_eq!(step.count(), before);
}

#[test]
fn checkpoint_restores_the_trajectory() {
    let mesh = Mesh::new(&Options::new()).unwrap();
    let g = graph();
    let dir = TempDir::new("ckpt");
    let ckpt = dir.0.join("step3");

    // Train 3 steps, save, train 3 more and remember those losses and weights.
    let mut a = Step::new(&mesh, &g, &step_options()).unwrap();
    a.attach_loader(loader()).unwrap();
    for _ in 0..3 {
        a.feed_from_loader(BATCH).unwrap();
        a.run().unwrap();
    }
    a.save(&ckpt).unwrap();
    let first_param = g.param_names().unwrap()[0].clone();
    let saved_weights = a.param(&first_param).unwrap();
    let mut expected = Vec::new();
    for _ in 0..3 {
        a.feed_from_loader(BATCH).unwrap();
        expected.push(a.run().unwrap().loss);
    }

    // A step with other initial weights and a fresh loader, restored from the
    // checkpoint, continues exactly where the first one was: weights, optimizer
    // state, schedule and data position.
    let mut b = Step::new(&mesh, &g, &step_options().int("seed", 99)).unwrap();
    b.attach_loader(loader()).unwrap();
    assert_ne!(b.param(&first_param).unwrap(), saved_weights);
    b.load(&ckpt).unwrap();
    assert_eq!(b.count(), 3);
    assert_eq!(b.param(&first_param).unwrap(), saved_weights);
    let mut got = Vec::new();
    for _ in 0..3 {
        b.feed_from_loader(BATCH).unwrap();
        got.push(b.run().unwrap().loss);
    }
    assert_eq!(got, expected, "resumed losses differ");

    // A missing checkpoint fails and leaves the step as it was.
    let err = b.load(dir.0.join("missing")).unwrap_err();
    assert_eq!(err.status(), Status::CHECKPOINT_ERROR, "{err}");
    assert!(err.message().contains("missing"), "{err}");
    assert_eq!(b.count(), 6);

    let loader = b.detach_loader().unwrap().expect("attached loader comes back");
    assert_eq!(loader.seq(), SEQ);
    assert!(b.detach_loader().unwrap().is_none());
}

fn latest(root: &Path) -> String {
    std::fs::read_to_string(root.join("latest")).unwrap().trim().to_string()
}

fn train(step: &mut Step, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            step.feed_from_loader(BATCH).unwrap();
            step.run().unwrap().loss
        })
        .collect()
}

#[test]
fn checkpoint_directory_keeps_the_newest_and_resumes_exactly() {
    let mesh = Mesh::new(&Options::new()).unwrap();
    let g = graph();
    let dir = TempDir::new("ckdir");
    let root = dir.0.join("ckpts");
    let keep1 = Options::new().int("keep", 1);

    let mut a = Step::new(&mesh, &g, &step_options()).unwrap();
    a.attach_loader(loader()).unwrap();
    train(&mut a, 2);
    assert_eq!(a.save_checkpoint(&root, &keep1).unwrap(), root.join("step_00000002"));
    assert_eq!(latest(&root), "step_00000002");
    train(&mut a, 2);
    let path = a.save_checkpoint(&root, &keep1).unwrap();
    assert_eq!(path, root.join("step_00000004"));
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["latest", "step_00000004"]);
    assert_eq!(latest(&root), "step_00000004");
    let expected = train(&mut a, 3);
    let err = a.save_checkpoint(&root, &Options::new().int("keep_last", 2)).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_OPTION, "{err}");
    assert!(err.message().contains("keep_last"), "{err}");

    // Another seed and a fresh loader: `latest` brings back weights, optimizer
    // state, schedule and data position, so the losses match bit for bit.
    let mut b = Step::new(&mesh, &g, &step_options().int("seed", 99)).unwrap();
    b.attach_loader(loader()).unwrap();
    let r = b.resume(&root, None).unwrap();
    assert_eq!(r, Resumed { path: path.clone(), skipped: vec![] });
    assert_eq!(b.count(), 4);
    assert_eq!(train(&mut b, 3), expected, "resumed losses differ");
    assert_eq!(b.resume(&root, Some(Path::new("step_00000004"))).unwrap().path, path);
    assert_eq!(b.count(), 4);
}

#[test]
fn checkpoint_directory_falls_back_past_a_damaged_checkpoint() {
    let mesh = Mesh::new(&Options::new()).unwrap();
    let g = graph();
    let dir = TempDir::new("ckdamage");
    let root = dir.0.join("ckpts");
    let keep2 = Options::new().int("keep", 2);

    let mut a = Step::new(&mesh, &g, &step_options()).unwrap();
    a.attach_loader(loader()).unwrap();
    train(&mut a, 2);
    let older = a.save_checkpoint(&root, &keep2).unwrap();
    train(&mut a, 2);
    let newest = a.save_checkpoint(&root, &keep2).unwrap();
    let shard = newest.join("rank00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[100] ^= 0x01;
    std::fs::write(&shard, bytes).unwrap();

    let mut b = Step::new(&mesh, &g, &step_options()).unwrap();
    let r = b.resume(&root, None).unwrap();
    assert_eq!(r.path, older);
    assert_eq!(r.skipped.len(), 1, "{:?}", r.skipped);
    assert!(r.skipped[0].starts_with(&format!("{}: ", newest.display())), "{:?}", r.skipped);
    assert!(r.skipped[0].contains("checksum mismatch"), "{:?}", r.skipped);
    assert_eq!(b.count(), 2);

    // Named explicitly, the damaged one is an error and the step keeps its state.
    let err = b.resume(&root, Some(&newest)).unwrap_err();
    assert_eq!(err.status(), Status::CHECKPOINT_ERROR, "{err}");
    assert!(err.message().contains("rank00000.bin"), "{err}");
    assert_eq!(b.count(), 2);

    // No checkpoint at all: NOT_FOUND naming the directory.
    let empty = dir.0.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = b.resume(&empty, None).unwrap_err();
    assert_eq!(err.status(), Status::NOT_FOUND, "{err}");
    assert!(err.message().contains(&*empty.to_string_lossy()), "{err}");
    assert_eq!(b.resume(dir.0.join("absent"), None).unwrap_err().status(), Status::NOT_FOUND);
    assert_eq!(b.count(), 2);
}

#[test]
fn loader_slices_match_the_global_batch() {
    // Two "ranks" reading halves of each global batch see exactly the rows a
    // single reader of the whole batch sees, and stay in step with it.
    let (mut whole, mut r0, mut r1) = (loader(), loader(), loader());
    let half = 2 * SEQ;
    for _ in 0..3 {
        let (tokens, targets) = whole.next_batch(4).unwrap();
        let (mut t0, mut g0) = (vec![0; half], vec![0; half]);
        let (mut t1, mut g1) = (vec![0; half], vec![0; half]);
        r0.next_slice(4, 0, &mut t0, &mut g0).unwrap();
        r1.next_slice(4, 2, &mut t1, &mut g1).unwrap();
        assert_eq!([t0, t1].concat(), tokens);
        assert_eq!([g0, g1].concat(), targets);
    }
    // A rank that reads no rows still advances with the others.
    r0.next_slice(4, 4, &mut [], &mut []).unwrap();
    whole.next_batch(4).unwrap();
    assert_eq!(r0.next_batch(1).unwrap(), whole.next_batch(1).unwrap());
    // Rows past the global batch are refused.
    let err = r1.next_slice(4, 3, &mut vec![0; half], &mut vec![0; half]).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT, "{err}");
}

#[test]
fn safetensors_round_trip() {
    let mesh = Mesh::new(&Options::new()).unwrap();
    let g = graph();
    let dir = TempDir::new("st");
    let path = dir.0.join("w.safetensors");
    let mut a = Step::new(&mesh, &g, &step_options()).unwrap();
    a.export_safetensors(&path).unwrap();
    let mut b = Step::new(&mesh, &g, &step_options().int("seed", 7)).unwrap();
    b.import_safetensors(&path, &Options::new()).unwrap();
    for name in g.param_names().unwrap() {
        assert_eq!(a.param(&name).unwrap(), b.param(&name).unwrap(), "{name}");
    }
}

#[test]
fn params_and_outputs() {
    let mesh = Mesh::new(&Options::new()).unwrap();
    let g = graph();
    let mut step = Step::new(&mesh, &g, &step_options().string("keep", "logits")).unwrap();
    let name = g.param_names().unwrap()[0].clone();
    let mut w = step.param(&name).unwrap();
    w.iter_mut().for_each(|x| *x = 0.25);
    step.set_param(&name, &w).unwrap();
    assert!(step.param(&name).unwrap().iter().all(|&x| x == 0.25));

    let (tokens, targets) = loader().next_batch(BATCH).unwrap();
    step.set_input("tokens", &tokens).unwrap();
    step.set_input("targets", &targets).unwrap();
    step.run().unwrap();
    let mut logits = vec![f32::NAN; BATCH * SEQ * 256];
    step.get_output("logits", &mut logits).unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    step.set_lr(1e-4).unwrap();
    assert!((step.run().unwrap().lr - 1e-4).abs() < 1e-12);
}

#[test]
fn errors_carry_status_and_message() {
    // A file that does not exist.
    let err = Graph::load_file("/nonexistent/dir/model.ctrg").unwrap_err();
    assert_eq!(err.status(), Status::IO_ERROR, "{err}");
    assert_eq!(err.name(), "i/o error");
    assert!(err.message().contains("/nonexistent/dir/model.ctrg"), "{err}");

    // A file that is not a graph.
    let dir = TempDir::new("err");
    let junk = dir.0.join("junk.ctrg");
    std::fs::write(&junk, b"definitely not a flatbuffer").unwrap();
    let err = Graph::load_file(&junk).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_GRAPH, "{err}");
    assert!(!err.message().is_empty());

    // An unknown option key is named in the message.
    let mesh = Mesh::new(&Options::new()).unwrap();
    let g = graph();
    let err = Step::new(&mesh, &g, &step_options().int("bacth", 4)).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_OPTION, "{err}");
    assert!(err.message().contains("bacth"), "{err}");
    assert_eq!(err.to_string(), format!("invalid option: {}", err.message()));

    // Wrong value type and missing required key.
    assert_eq!(
        Step::new(&mesh, &g, &step_options().string("lr", "fast")).unwrap_err().status(),
        Status::INVALID_OPTION
    );
    assert_eq!(Step::new(&mesh, &g, &Options::new()).unwrap_err().status(), Status::INVALID_OPTION);
    let err = Graph::preset("resnet", &Options::new()).unwrap_err();
    assert!(err.message().contains("resnet"), "{err}");

    // Caught by the binding before the library: a NUL inside a key.
    let err = Mesh::new(&Options::new().int("ra\0nk", 0)).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT);

    // Order and data errors from a live step.
    let mut step = Step::new(&mesh, &g, &step_options()).unwrap();
    assert_eq!(step.run().unwrap_err().status(), Status::INVALID_STATE);
    let err = step.set_input("tokens", &[0i32; 3]).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT, "{err}");
    let mut bad = vec![0i32; BATCH * SEQ];
    bad[5] = 256;
    let err = step.set_input("tokens", &bad).unwrap_err();
    assert_eq!(err.status(), Status::DATA_ERROR, "{err}");
    assert!(err.message().contains("tokens"), "{err}");
    assert_eq!(step.set_input("nope", &bad).unwrap_err().status(), Status::NOT_FOUND);
    assert_eq!(step.feed_from_loader(BATCH).unwrap_err().status(), Status::INVALID_STATE);

    // The loader's buffers are checked by the binding (the header gives no
    // way to ask for seq), and "seq" is required by the library.
    let mut l = loader();
    let err = l.next(2, &mut [0; 10], &mut [0; 10]).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT);
    assert_eq!(Loader::builtin(&Options::new()).unwrap_err().status(), Status::INVALID_OPTION);

    // A corrupt checkpoint.
    let ckpt = dir.0.join("ckpt");
    step.save(&ckpt).unwrap();
    for entry in std::fs::read_dir(&ckpt).unwrap() {
        let path = entry.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
    }
    let err = step.load(&ckpt).unwrap_err();
    assert_eq!(err.status(), Status::CHECKPOINT_ERROR, "{err}");
}

#[test]
fn handles_drop_in_any_order_and_move_between_threads() {
    // The step keeps its mesh and graph alive after the caller's handles go.
    let mut step = {
        let mesh = Mesh::new(&Options::new()).unwrap();
        let g = graph();
        Step::new(&mesh, &g, &step_options()).unwrap()
    };
    step.attach_loader(loader()).unwrap();
    // A step may move to another thread (used by one thread at a time).
    let handle = std::thread::spawn(move || {
        step.feed_from_loader(BATCH).unwrap();
        let loss = step.run().unwrap().loss;
        (step, loss)
    });
    let (mut step, loss) = handle.join().unwrap();
    assert!(loss.is_finite());
    step.feed_from_loader(BATCH).unwrap();
    step.run().unwrap();
    assert_eq!(step.count(), 2);

    // Meshes and graphs are shared between threads.
    let g = graph();
    let mesh = Mesh::new(&Options::new()).unwrap();
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (g, mesh) = (g.clone(), mesh.clone());
            std::thread::spawn(move || Step::new(&mesh, &g, &step_options()).map(|s| s.count()))
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap().unwrap(), 0);
    }
    drop(step);
}

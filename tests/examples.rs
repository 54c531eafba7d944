//! The examples' shared code (IDX loader, step log, plot, memory count) and the example
//! binaries themselves, run with tiny settings on a small synthetic data set in the layout of
//! Fashion-MNIST (four gzip IDX files written to a temp dir), so that they finish in seconds.
//!
//! The binaries are the ones `cargo test` builds (it builds every example before running the
//! integration tests): `<target>/<profile>/examples/<name>`.
#[path = "../examples/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::data::{load_images, load_labels, read_idx, write_idx, write_synthetic, Dataset};
use common::log::{StepLog, StepRecord};
use serde_json::Value;
use tempfile::TempDir;

// ---------------------------------------------------------------------------------------
// IDX loader

fn images_bytes(n: usize, h: usize, w: usize) -> Vec<u8> {
    (0..n * h * w).map(|i| (i % 256) as u8).collect()
}

#[test]
fn idx_gzip_and_plain_files_load() {
    let dir = TempDir::new().unwrap();
    for gzip in [true, false] {
        let p = dir.path().join(if gzip { "imgs.gz" } else { "imgs" });
        write_idx(&p, &[3, 4, 5], &images_bytes(3, 4, 5), gzip).unwrap();
        let t = load_images(&p).unwrap();
        assert_eq!(t.size(), [3, 1, 4, 5]);
        assert_eq!(t.kind(), tch::Kind::Float);
        // Pixel 7 of image 0 is byte 7 → 7/255.
        let v = t.view([-1]).double_value(&[7]);
        assert!((v - 7.0 / 255.0).abs() < 1e-6, "{v}");
        let l = dir.path().join("labels");
        write_idx(&l, &[3], &[2, 0, 9], gzip).unwrap();
        let labels = load_labels(&l).unwrap();
        assert_eq!(labels.kind(), tch::Kind::Int64);
        assert_eq!(Vec::<i64>::try_from(&labels).unwrap(), vec![2, 0, 9]);
    }
}

fn problem(r: Result<impl std::fmt::Debug, common::data::DataError>) -> String {
    let e = r.expect_err("expected an error");
    e.to_string()
}

#[test]
fn idx_missing_file_names_it() {
    let dir = TempDir::new().unwrap();
    let p = dir.path().join("nope-idx3-ubyte.gz");
    let m = problem(read_idx(&p, 3));
    assert!(m.contains("nope-idx3-ubyte.gz") && m.contains("not found"), "{m}");
}

#[test]
fn idx_bad_magic_says_what_was_expected() {
    let dir = TempDir::new().unwrap();
    let p = dir.path().join("labels-as-images.gz");
    // A label file (IDX1, magic 0x801) where images (IDX3, 0x803) are expected.
    write_idx(&p, &[4], &[1, 2, 3, 4], true).unwrap();
    let m = problem(load_images(&p));
    assert!(m.contains("labels-as-images.gz"), "{m}");
    assert!(m.contains("bad magic number 0x00000801") && m.contains("0x00000803"), "{m}");
    // Not IDX at all.
    std::fs::write(&p, b"hello world, not an IDX file").unwrap();
    let m = problem(load_images(&p));
    assert!(m.contains("bad magic number"), "{m}");
}

#[test]
fn idx_truncated_files_are_errors() {
    let dir = TempDir::new().unwrap();
    let p = dir.path().join("short");
    write_idx(&p, &[10, 4, 4], &images_bytes(9, 4, 4), false).unwrap();
    let m = problem(load_images(&p));
    assert!(m.contains("truncated") && m.contains("160") && m.contains("144"), "{m}");
    // Cut inside the header.
    std::fs::write(&p, [0u8, 0, 8, 3, 0, 0]).unwrap();
    let m = problem(load_images(&p));
    assert!(m.contains("truncated header"), "{m}");
    std::fs::write(&p, [0u8, 0]).unwrap();
    let m = problem(load_images(&p));
    assert!(m.contains("truncated"), "{m}");
    // Extra bytes after the data.
    write_idx(&p, &[2, 4, 4], &images_bytes(3, 4, 4), false).unwrap();
    let m = problem(load_images(&p));
    assert!(m.contains("16 unexpected bytes"), "{m}");
    // A gzip stream cut short.
    let gz = dir.path().join("cut.gz");
    write_idx(&gz, &[50, 28, 28], &images_bytes(50, 28, 28), true).unwrap();
    let bytes = std::fs::read(&gz).unwrap();
    std::fs::write(&gz, &bytes[..bytes.len() / 2]).unwrap();
    let m = problem(load_images(&gz));
    assert!(m.contains("cut.gz") && m.contains("gzip"), "{m}");
}

#[test]
fn dataset_checks_counts_and_names_the_file() {
    let dir = TempDir::new().unwrap();
    write_synthetic(dir.path(), 64, 32, 10, 28, 1).unwrap();
    let d = Dataset::load(dir.path()).unwrap();
    assert_eq!(d.train.images.size(), [64, 1, 28, 28]);
    assert_eq!(d.test.len(), 32);
    assert_eq!(d.num_classes, 10);
    // Wrong number of training labels.
    write_idx(&dir.path().join("train-labels-idx1-ubyte.gz"), &[63], &[0; 63], true).unwrap();
    let m = problem(Dataset::load(dir.path()));
    assert!(m.contains("train-labels-idx1-ubyte.gz") && m.contains("63 labels") && m.contains("64 images"), "{m}");
}

#[test]
fn dataset_missing_says_how_to_get_it() {
    let dir = TempDir::new().unwrap();
    let m = problem(Dataset::load(&dir.path().join("empty")));
    assert!(m.contains("train-images-idx3-ubyte.gz"), "{m}");
    assert!(m.contains("make data") && m.contains("--data"), "{m}");
}

#[test]
fn subsets_are_seeded_and_standardized() {
    let dir = TempDir::new().unwrap();
    write_synthetic(dir.path(), 100, 20, 10, 28, 2).unwrap();
    let d = Dataset::load(dir.path()).unwrap().standardize();
    let mean = d.train.images.mean(tch::Kind::Float).double_value(&[]);
    assert!(mean.abs() < 1e-4, "{mean}");
    let a = d.train.subset(30, 7);
    let b = d.train.subset(30, 7);
    assert_eq!(a.len(), 30);
    assert!(a.labels.equal(&b.labels) && a.images.equal(&b.images));
    assert_eq!(d.train.subset(0, 7).len(), 100);
}

// ---------------------------------------------------------------------------------------
// Step log, plot, memory count

#[test]
fn step_log_writes_json_lines() {
    let dir = TempDir::new().unwrap();
    let p = dir.path().join("sub/log.jsonl");
    {
        let mut log = StepLog::create(Some(&p)).unwrap();
        log.write(&StepRecord::new(0, 2.5, 65536.0, false).with("level", "O2")).unwrap();
        log.write(&StepRecord::new(1, f64::INFINITY, 32768.0, true)).unwrap();
    }
    let lines = read_log(&p);
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["level"], "O2");
    assert_eq!(lines[0]["loss_scale"], 65536.0);
    assert_eq!(lines[1]["skipped"], true);
    assert!(lines[1]["loss"].is_null(), "inf is written as null");
    // No file asked for: nothing written, no error.
    StepLog::create(None).unwrap().write(&StepRecord::new(0, 1.0, 1.0, false)).unwrap();
}

#[test]
fn plot_writes_a_png_with_and_without_text() {
    let dir = TempDir::new().unwrap();
    let level = |name: &str, color: usize, scales: Vec<f64>, acc: f64, secs: f64| common::plot::LevelSummary {
        name: name.into(),
        color,
        losses: vec![2.3, 1.5, 1.0 + color as f64 * 0.01, f64::NAN],
        scales,
        test_accuracy: acc,
        seconds_per_epoch: secs,
        time_vs_o0: Some(secs / 7.0),
        state_bytes: [1000, 1000, 2000 * (color == 2) as u64, 1000],
        peak_bytes: Some(50_000 + 1000 * color as u64),
    };
    let levels = vec![
        level("O0", 0, vec![1.0; 4], 89.3, 7.0),
        level("O2", 2, vec![65536.0, 32768.0, 32768.0, 32768.0], 89.4, 6.5),
    ];
    let bare = dir.path().join("bare.png");
    assert!(!common::plot::plot_levels(&bare, "t", &levels, false).unwrap());
    let auto = dir.path().join("auto.png");
    let text = common::plot::plot_levels_auto(&auto, "t", &levels).unwrap();
    // No level's scale moves: the panel says so in text instead.
    // One level, no measured peak: the training state alone.
    let flat = dir.path().join("flat.png");
    let unmeasured = vec![common::plot::LevelSummary { peak_bytes: None, ..levels[0].clone() }];
    common::plot::plot_levels_auto(&flat, "t", &unmeasured).unwrap();
    for p in [&bare, &auto, &flat] {
        let b = std::fs::read(p).unwrap();
        assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n", "{}", p.display());
    }
    // Debian's fonts-dejavu-core (scripts/setup-data.sh) gives the plot its text.
    if Path::new(common::plot::DEFAULT_FONT).exists() && std::env::var_os("TCH_AMP_FONT").is_none() {
        assert!(text, "the font is installed but the plot was drawn without text");
    }
    let grid = dir.path().join("grid.png");
    common::plot::save_grid(&grid, &tch::Tensor::rand([5, 1, 6, 6], (tch::Kind::Float, tch::Device::Cpu)), 3).unwrap();
    assert!(std::fs::metadata(&grid).unwrap().len() > 0);
}

#[test]
fn memory_count_sees_masters_under_o2() {
    use tch::nn::{self, ModuleT};
    use tch_amp::{initialize, AmpConfig, OptLevel};
    let mut totals = Vec::new();
    for level in [OptLevel::O0, OptLevel::O2, OptLevel::O3] {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = common::model::ResNetConfig { in_channels: 1, num_classes: 10, width: 4, stages: 1, pool: 1 };
        let net = common::model::SmallResNet::new(&vs.root(), cfg);
        let (model, mut opt, mut amp) = initialize(
            &vs,
            net,
            nn::Sgd { momentum: 0.9, ..Default::default() },
            0.1,
            &AmpConfig::new(level).verbosity(0),
        )
        .unwrap();
        let x = tch::Tensor::randn([4, 1, 28, 28], (tch::Kind::Float, tch::Device::Cpu));
        let y = tch::Tensor::from_slice(&[0i64, 1, 2, 3]);
        // One step allocates the optimizer state; measure at the second step.
        for _ in 0..2 {
            opt.zero_grad().unwrap();
            let loss = model.forward_t(&x, true).cross_entropy_for_logits(&y);
            amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
            if opt.memory().optimizer_state > 0 {
                break;
            }
            opt.step().unwrap();
        }
        let m = common::memory::measure(&vs, &opt);
        assert!(m.weights > 0 && m.grads > 0 && m.optimizer_state > 0, "{level}: {m:?}");
        totals.push((level, m));
    }
    let (o0, o2, o3) = (totals[0].1, totals[1].1, totals[2].1);
    assert_eq!(o0.masters, 0);
    assert!(o2.masters > 0 && o2.weights < o0.weights, "{o2:?} vs {o0:?}");
    assert_eq!(o3.masters, 0);
    assert!(o3.total() < o0.total());
    // Between backward and step O2 holds the fp32 master gradients (scale_loss made them and
    // released the fp16 ones): per fp16 parameter 2 (weight) + 4 (master) + 4 (gradient) + 4
    // (momentum) = 14 bytes, O0's 4 + 4 + 4; batch norm and buffers are fp32 in both. So O2's
    // gradients are O0's, and its total is O0's plus the fp16 weights' 2 bytes each (what the
    // weights shrank by), while O3's gradients are fp16.
    assert_eq!(o2.grads, o0.grads, "{o2:?} vs {o0:?}");
    assert_eq!(o2.total() - o0.total(), o0.weights - o2.weights, "{o2:?} vs {o0:?}");
    assert!(o3.grads < o2.grads, "{o3:?} {o2:?}");
}

// ---------------------------------------------------------------------------------------
// The example binaries

fn example_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // <target>/<profile>/deps/examples-<hash> → <target>/<profile>/examples/<name>
    let profile_dir = exe.parent().and_then(Path::parent).expect("test binary is in <target>/<profile>/deps");
    let bin = profile_dir.join("examples").join(name);
    assert!(
        bin.exists(),
        "example binary {} is missing: run `cargo test` (which builds the examples before the tests) \
         or `cargo build --examples` first",
        bin.display()
    );
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).expect("mtime of the example binary");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sources = [
        root.join("examples").join(format!("{name}.rs")),
        root.join("examples/common"),
        root.join("src"),
        root.join("Cargo.toml"),
    ];
    if let Some(newer) = newest_source(&sources, built) {
        panic!(
            "example binary {} is older than {}: run `cargo test` (which rebuilds the examples) or \
             `cargo build --examples` first",
            bin.display(),
            newer.display()
        );
    }
    bin
}

/// A file under `paths` modified after `than`, if any.
fn newest_source(paths: &[PathBuf], than: std::time::SystemTime) -> Option<PathBuf> {
    for p in paths {
        let Ok(meta) = std::fs::metadata(p) else { continue };
        if meta.is_dir() {
            let entries: Vec<PathBuf> = std::fs::read_dir(p).ok()?.filter_map(|e| e.ok().map(|e| e.path())).collect();
            if let Some(f) = newest_source(&entries, than) {
                return Some(f);
            }
        } else if meta.modified().is_ok_and(|m| m > than) {
            return Some(p.clone());
        }
    }
    None
}

/// Runs an example with one libtorch thread (tests run side by side on 2 cores).
fn run(name: &str, args: &[&str]) -> Output {
    let out = Command::new(example_bin(name))
        .args(args)
        .env("CI", "true")
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run example {name}: {e}"));
    out
}

fn run_ok(name: &str, args: &[&str]) -> String {
    let out = run(name, args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "example {name} {args:?} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn read_log(p: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    text.lines()
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).unwrap_or_else(|e| panic!("{} line {}: {e}: {l}", p.display(), i + 1)))
        .collect()
}

/// Every line has the four common fields, steps count 0, 1, 2, ... from `first`, losses
/// are finite.
fn check_log(lines: &[Value], first: u64, expected: usize) {
    assert_eq!(lines.len(), expected, "number of logged steps");
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"].as_u64(), Some(first + i as u64), "{l}");
        let loss = l["loss"].as_f64().unwrap_or_else(|| panic!("loss is not a finite number: {l}"));
        assert!(loss.is_finite() && loss >= 0.0, "{l}");
        assert!(l["loss_scale"].as_f64().is_some_and(|s| s > 0.0), "{l}");
        assert!(l["skipped"].is_boolean(), "{l}");
    }
}

fn synthetic_data() -> TempDir {
    let dir = TempDir::new().unwrap();
    write_synthetic(dir.path(), 256, 64, 10, 28, 3).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn fashion_mnist_compares_the_levels_asked_for() {
    let data = synthetic_data();
    let out = TempDir::new().unwrap();
    let log = out.path().join("log.jsonl");
    let stdout = run_ok(
        "fashion_mnist",
        &[
            "--data",
            s(data.path()),
            "--levels",
            "O0,O2,autocast",
            "--train-size",
            "256",
            "--eval-every",
            "2",
            "--target-accuracy",
            "0",
            "--epochs",
            "1",
            "--batch-size",
            "64",
            "--width",
            "4",
            "--out",
            s(out.path()),
            "--log",
            s(&log),
        ],
    );
    let lines = read_log(&log);
    check_log(&lines, 0, 12);
    let levels: Vec<&str> = lines.iter().map(|l| l["level"].as_str().unwrap()).collect();
    let want = ["O0", "O0", "O0", "O0", "O2", "O2", "O2", "O2", "autocast", "autocast", "autocast", "autocast"];
    assert_eq!(levels, want);
    // The table has one row per level, O0 first with time and peak vs O0 1.00x, and says what
    // the GEMMs and convolutions computed in (O2: fp16, native or emulated per class as
    // CpuKernels::Auto chose); the header names Auto's choice.
    assert!(stdout.contains("time vs O0") && stdout.contains("peak/O0") && stdout.contains("max batch"), "{stdout}");
    assert!(stdout.contains("CpuKernels::Auto chooses, per operation class: fp16: gemm "), "{stdout}");
    let rows: Vec<&str> =
        stdout.lines().filter(|l| l.starts_with("O0 ") || l.starts_with("O2 ") || l.starts_with("autocast ")).collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    assert!(rows[0].contains("1.00x") && rows[0].contains("fp32"), "{stdout}");
    assert_eq!(rows[0].matches("1.00x").count(), 2, "time and peak vs O0: {stdout}");
    let how = |kind: tch::Kind, name: &str| {
        let choice = tch_amp::cast::CpuFeatures::detect().auto_choice(kind);
        let word = |m: tch_amp::CpuKernels| if m == tch_amp::CpuKernels::Native { "native" } else { "emulated" };
        let (gemm, conv) = (choice.get(tch_amp::OpClass::Gemm), choice.get(tch_amp::OpClass::Convolution));
        if gemm == conv {
            format!("{name} {}", word(gemm))
        } else {
            format!("{name} gemm {}, conv {}", word(gemm), word(conv))
        }
    };
    let fp16 = how(tch::Kind::Half, "fp16");
    assert!(rows[1].contains(&fp16), "O2: {fp16}: {stdout}");
    // Autocast makes the opt levels' choice of CPU kernels.
    let bf16 = how(tch::Kind::BFloat16, "bf16");
    assert!(rows[2].contains(&bf16), "autocast: {bf16}: {stdout}");
    let record: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("record.json")).unwrap()).unwrap();
    let results = record["results"].as_array().unwrap();
    let names: Vec<&str> = results.iter().map(|r| r["level"].as_str().unwrap()).collect();
    assert_eq!(names, ["O0", "O2", "autocast"]);
    for r in results {
        assert_eq!(r["steps"], 4);
        // Evaluated after steps 2 and 4; a target of 0% is reached at the first evaluation.
        let evals: Vec<u64> = r["evals"].as_array().unwrap().iter().map(|e| e["step"].as_u64().unwrap()).collect();
        assert_eq!(evals, [2, 4], "{r}");
        assert_eq!(r["time_to_target"]["steps"], 2, "{r}");
        // CPU: the peak of a step is measured, and it holds at least the training state; the
        // largest batch within the 2 GiB budget is far above this small network's 64.
        assert!(r["peak_step_bytes"].as_u64().unwrap() > r["memory_total"].as_u64().unwrap(), "{r}");
        assert!(r["largest_batch"].as_u64().is_some_and(|b| b > 64), "{r}");
        assert!(r["test"]["top1"].as_f64().is_some_and(|a| (0.0..=100.0).contains(&a)), "{r}");
        assert!(r["memory_total"].as_u64().unwrap() > 0);
        assert_eq!(r["losses"].as_array().unwrap().len(), 4);
        assert!(r["time_vs_o0"].as_f64().is_some_and(|x| x > 0.0), "{r}");
    }
    assert!(results[1]["memory"]["masters"].as_u64().unwrap() > 0, "O2 keeps fp32 masters");
    assert_eq!(results[0]["final_loss_scale"], 1.0, "O0: static scale 1");
    assert!(results[1]["final_loss_scale"].as_f64().is_some_and(|x| x > 1.0), "O2: dynamic scale");
    assert_eq!(results[2]["final_loss_scale"], 65536.0, "autocast: GradScaler's initial scale");
    let png = std::fs::read(out.path().join("curves.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
}

#[test]
fn fashion_mnist_reports_bad_data_and_bad_levels() {
    let empty = TempDir::new().unwrap();
    let out = run("fashion_mnist", &["--data", s(empty.path()), "--levels", "O0", "--no-plot"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("train-images-idx3-ubyte.gz") && err.contains("make data"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let out = run("fashion_mnist", &["--levels", "0O"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the letter O"), "{err}");
}

#[test]
fn fashion_mnist_device_flag_rejects_what_is_not_there() {
    let data = synthetic_data();
    let out = run("fashion_mnist", &["--data", s(data.path()), "--device", "gpu", "--no-plot"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
    // No machine has 100 GPUs: an error naming the device count, not a fallback to the CPU.
    let out = run("fashion_mnist", &["--data", s(data.path()), "--device", "cuda:99", "--levels", "O0", "--no-plot"]);
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--device cuda:99") && err.contains("CUDA device(s)"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn imagenet_resume_continues_exactly() {
    let data = synthetic_data();
    let dir = TempDir::new().unwrap();
    let go = |extra: &[&str], ck: &Path| -> String {
        let mut args = vec![
            "--data",
            s(data.path()),
            "--opt-level",
            "O2",
            "--train-size",
            "192",
            "--test-size",
            "64",
            "-b",
            "64",
            "--width",
            "4",
            "--stages",
            "2",
            "--checkpoint-dir",
            s(ck),
        ];
        args.extend_from_slice(extra);
        run_ok("imagenet", &args)
    };
    // Two epochs straight.
    let straight = dir.path().join("straight.jsonl");
    go(&["--epochs", "2", "--log", s(&straight)], &dir.path().join("a"));
    // One epoch, then --resume for the second.
    let first = dir.path().join("first.jsonl");
    let second = dir.path().join("second.jsonl");
    let out = go(&["--epochs", "1", "--log", s(&first)], &dir.path().join("b"));
    assert!(out.contains("Prec@1") && out.contains("saved checkpoint"), "{out}");
    let ck = dir.path().join("b/checkpoint.safetensors");
    assert!(ck.exists() && dir.path().join("b/checkpoint.json").exists());
    let out = go(&["--epochs", "2", "--resume", s(&ck), "--log", s(&second)], &dir.path().join("b"));
    assert!(out.contains("loaded checkpoint"), "{out}");
    let (straight, first, second) = (read_log(&straight), read_log(&first), read_log(&second));
    check_log(&straight, 0, 6);
    check_log(&first, 0, 3);
    check_log(&second, 3, 3);
    // The resumed epoch is the straight run's second epoch: same losses and loss scales.
    for (a, b) in straight[3..].iter().zip(&second) {
        assert_eq!(a["loss"], b["loss"], "resumed run diverged:\n{a}\n{b}");
        assert_eq!(a["loss_scale"], b["loss_scale"]);
    }
    // --evaluate with the checkpoint only validates.
    let out = go(&["-e", "--resume", s(&ck)], &dir.path().join("b"));
    assert!(out.contains("* Prec@1") && !out.contains("Epoch:"), "{out}");
}

/// Runs scripts/reference/torch_checkpoint_fixtures.py with the venv's python
/// ($TCH_AMP_PYTHON), at most 120 s.
fn run_fixture_script(args: &[&str]) {
    let python = std::env::var("TCH_AMP_PYTHON").expect(
        "TCH_AMP_PYTHON is not set: run `make setup` (it writes .cargo/config.toml) or point it at a python with \
         torch==2.13.0",
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/reference/torch_checkpoint_fixtures.py");
    let mut child = Command::new(python)
        .arg(script)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting the venv's python");
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("waiting for python") {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).ok();
            assert!(status.success(), "torch_checkpoint_fixtures.py {args:?} failed: {err}");
            return;
        }
        if start.elapsed() > std::time::Duration::from_secs(120) {
            child.kill().ok();
            child.wait().ok();
            panic!("torch_checkpoint_fixtures.py {args:?} ran past 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `--resume` with a checkpoint PyTorch wrote in main_amp.py's layout (legacy container,
/// `module.` prefixes, torch.optim SGD state with momentum buffers, an amp entry): the model
/// the fixture script saved predicts class 3 for every image (fc weight 0, bias 5 at class 3),
/// so `-e` must print Prec@1 = the share of class 3 in the test set and the loss
/// log(e^5 + 9) - 5 * that share, computed here from the labels; training continues at epoch
/// 1 (log steps 3..6) from the file's loss scale.
#[test]
fn imagenet_resumes_a_pytorch_main_amp_checkpoint() {
    let data = synthetic_data();
    let dir = TempDir::new().unwrap();
    let ck = dir.path().join("checkpoint.pth.tar");
    run_fixture_script(&["imagenet", s(&ck), "4", "2", "10", "3"]);
    let go = |extra: &[&str]| -> String {
        let mut args = vec!["--data", s(data.path()), "--opt-level", "O2", "--train-size", "192", "--test-size", "64"];
        args.extend_from_slice(&["-b", "64", "--width", "4", "--stages", "2", "--checkpoint-dir", s(dir.path())]);
        args.extend_from_slice(extra);
        run_ok("imagenet", &args)
    };
    let out = go(&["-e", "--resume", s(&ck)]);
    assert!(out.contains("(epoch 1, PyTorch format, arch small_resnet, amp state restored, loss scale 1024)"), "{out}");
    let labels = load_labels(&data.path().join(format!("{}.gz", common::data::TEST_LABELS))).unwrap();
    assert_eq!(labels.size(), [64]);
    let share = labels.eq(3).to_kind(tch::Kind::Double).mean(tch::Kind::Double).double_value(&[]);
    assert!(share > 0.0 && share < 0.5, "{share}");
    let line = out.lines().find(|l| l.starts_with(" * Prec@1")).unwrap_or_else(|| panic!("{out}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let prec1: f64 = words[2].parse().unwrap();
    let loss: f64 = words[6].trim_end_matches(')').parse().unwrap();
    assert!((prec1 - 100.0 * share).abs() < 1e-3, "Prec@1 {prec1}, class 3 share {share}: {line}");
    let want_loss = (5f64.exp() + 9.0).ln() - 5.0 * share;
    assert!((loss - want_loss).abs() < 2e-3, "loss {loss}, expected {want_loss}: {line}");
    // Training resumes at epoch 1: the second epoch's three steps, from the file's loss scale.
    let log = dir.path().join("resumed.jsonl");
    let out = go(&["--epochs", "2", "--resume", s(&ck), "--log", s(&log)]);
    assert!(out.contains("Epoch: [1][") && !out.contains("Epoch: [0]"), "{out}");
    let lines = read_log(&log);
    check_log(&lines, 3, 3);
    assert_eq!(lines[0]["loss_scale"].as_f64(), Some(1024.0), "{}", lines[0]);
}

#[test]
fn dcgan_three_losses_two_optimizers() {
    let data = synthetic_data();
    let dir = TempDir::new().unwrap();
    let log = dir.path().join("log.jsonl");
    run_ok(
        "dcgan",
        &[
            "--data",
            s(data.path()),
            "--opt-level",
            "O2",
            "--train-size",
            "128",
            "-b",
            "32",
            "--nz",
            "8",
            "--ngf",
            "4",
            "--ndf",
            "4",
            "--niter",
            "1",
            "--outf",
            s(dir.path()),
            "--log",
            s(&log),
        ],
    );
    let lines = read_log(&log);
    check_log(&lines, 0, 4);
    for l in &lines {
        let scales = l["loss_scales"].as_array().unwrap();
        assert_eq!(scales.len(), 3, "{l}");
        for k in ["err_d_real", "err_d_fake", "err_g"] {
            assert!(l[k].as_f64().is_some_and(f64::is_finite), "{l}");
        }
    }
    for f in ["real_samples.png", "fake_samples_epoch_000.png", "dcgan.safetensors"] {
        assert!(dir.path().join(f).exists(), "{f} missing");
    }
}

#[test]
fn grad_accumulation_steps_once_per_accumulated_batch() {
    let data = synthetic_data();
    let dir = TempDir::new().unwrap();
    let log = dir.path().join("log.jsonl");
    let out = run_ok(
        "grad_accumulation",
        &[
            "--data",
            s(data.path()),
            "--opt-level",
            "O2",
            "--train-size",
            "256",
            "--test-size",
            "64",
            "-b",
            "16",
            "--accum-steps",
            "4",
            "--width",
            "4",
            "--log",
            s(&log),
        ],
    );
    let lines = read_log(&log);
    check_log(&lines, 0, 4);
    assert!(lines.iter().all(|l| l["micro_batches"] == 4), "{lines:?}");
    assert!(out.contains("test accuracy"), "{out}");
}

#[test]
fn clip_masters_logs_the_gradient_norm() {
    let data = synthetic_data();
    let dir = TempDir::new().unwrap();
    let log = dir.path().join("log.jsonl");
    run_ok(
        "clip_masters",
        &[
            "--data",
            s(data.path()),
            "--opt-level",
            "O2",
            "--train-size",
            "256",
            "--test-size",
            "64",
            "-b",
            "64",
            "--width",
            "4",
            "--max-grad-norm",
            "0.5",
            "--log",
            s(&log),
        ],
    );
    let lines = read_log(&log);
    check_log(&lines, 0, 4);
    for l in &lines {
        let norm = l["grad_norm"].as_f64().unwrap_or(f64::INFINITY);
        assert!(norm >= 0.0, "{l}");
        assert_eq!(l["clipped"].as_bool(), Some(norm.is_finite() && norm > 0.5), "{l}");
    }
}

/// `--optimizer fused-sgd` (apex.optimizers.FusedSGD) trains as torch.optim.SGD does (Apex
/// documents it as the same update; tch-amp computes the same ops): the same loss at every
/// step of an O2 epoch.
#[test]
fn imagenet_fused_sgd_trains_as_sgd() {
    let data = synthetic_data();
    let dir = TempDir::new().unwrap();
    let go = |optimizer: &str| {
        let log = dir.path().join(format!("{optimizer}.jsonl"));
        let ck = dir.path().join(optimizer);
        let args = [
            "--data",
            s(data.path()),
            "--opt-level",
            "O2",
            "--train-size",
            "192",
            "--test-size",
            "64",
            "-b",
            "64",
            "--width",
            "4",
            "--stages",
            "2",
            "--epochs",
            "1",
            "--optimizer",
            optimizer,
            "--checkpoint-dir",
            s(&ck),
            "--log",
            s(&log),
        ];
        run_ok("imagenet", &args);
        read_log(&log)
    };
    let (sgd, fused) = (go("sgd"), go("fused-sgd"));
    check_log(&fused, 0, 3);
    assert_eq!(sgd.len(), fused.len());
    for (a, b) in sgd.iter().zip(&fused) {
        assert_eq!(a["loss"], b["loss"], "fused-sgd diverged from sgd:\n{a}\n{b}");
    }
}

/// `log_diff` finds the first step and field where two logs diverge, with the difference;
/// agreeing logs exit 0, diverging ones 1, unreadable ones 2.
#[test]
fn log_diff_names_the_first_divergence() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, lines: &[&str]| {
        let p = dir.path().join(name);
        std::fs::write(&p, lines.join("\n") + "\n").unwrap();
        p.to_string_lossy().to_string()
    };
    let a = write(
        "a.jsonl",
        &[
            r#"{"step":0,"loss":2.5,"loss_scale":65536.0,"skipped":false}"#,
            r#"{"step":1,"loss":2.25,"loss_scale":65536.0,"skipped":false}"#,
            r#"{"step":2,"loss":2.0,"loss_scale":65536.0,"skipped":false}"#,
        ],
    );
    let b = write(
        "b.jsonl",
        &[
            r#"{"step":0,"loss":2.5,"loss_scale":65536.0,"skipped":false}"#,
            r#"{"step":1,"loss":2.25,"loss_scale":32768.0,"skipped":true}"#,
            r#"{"step":2,"loss":2.0,"loss_scale":32768.0,"skipped":false}"#,
        ],
    );
    let out = run_ok("log_diff", &[&a, &a]);
    assert!(out.contains("agree on all 3 steps"), "{out}");
    let out = run("log_diff", &[&a, &b]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("first divergence at step 1, field loss_scale: 65536.0 vs 32768.0"), "{text}");
    assert!(text.contains("difference 3.2768e4"), "{text}");
    let out = run("log_diff", &[&a, &b, "--fields", "loss"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let bad = write("bad.jsonl", &["not json"]);
    let out = run("log_diff", &[&a, &bad]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad.jsonl:1: not JSON"));
}

#[test]
fn torch_amp_runs_the_typical_loop_with_a_grad_scaler() {
    let data = synthetic_data();
    let out = run_ok(
        "torch_amp",
        &[
            "--data",
            s(data.path()),
            "--precision",
            "16-mixed",
            "--train-size",
            "128",
            "--test-size",
            "64",
            "-b",
            "32",
            "--width",
            "4",
        ],
    );
    assert!(out.contains("grad_scaler: true") && out.contains("test accuracy"), "{out}");
    assert!(out.contains("4 steps"), "{out}");
}

#[test]
fn float8_trains_saves_and_resumes_with_delayed_scaling() {
    let data = synthetic_data();
    let dir = TempDir::new().unwrap();
    let ckpt = dir.path().join("fp8.safetensors");
    let common = ["--data", s(data.path()), "--train-size", "128", "--test-size", "64", "-b", "32", "--hidden", "32"];
    let first: Vec<&str> =
        common.iter().copied().chain(["--recipe", "delayed", "--autocast", "--checkpoint", s(&ckpt)]).collect();
    let out = run_ok("float8", &first);
    assert!(out.contains("float8 layers: [\"fc1\", \"fc2\"]") && out.contains("test accuracy"), "{out}");
    assert!(out.contains("4 steps") && out.contains("checkpoint written"), "{out}");
    let second: Vec<&str> = common.iter().copied().chain(["--recipe", "delayed", "--resume", s(&ckpt)]).collect();
    let out = run_ok("float8", &second);
    assert!(out.contains("resumed from") && out.contains("test accuracy"), "{out}");
    let out = run_ok("float8", &common.iter().copied().chain(["--recipe", "rowwise"]).collect::<Vec<_>>());
    assert!(out.contains("recipe rowwise"), "{out}");
    let out = run("float8", &common.iter().copied().chain(["--recipe", "blockwise"]).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("recipe_name"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn doctor_reports_a_healthy_batch_and_names_an_overflowing_layer() {
    let data = synthetic_data();
    let dir = TempDir::new().unwrap();
    let healthy = dir.path().join("healthy");
    let common = ["--data", s(data.path()), "-b", "32"];
    let args: Vec<&str> =
        common.iter().copied().chain(["--levels", "O2,autocast-bf16", "--out", s(&healthy)]).collect();
    let out = run_ok("doctor", &args);
    assert!(out.contains("verdict: O2 fp16 trains fine"), "{out}");
    assert!(out.contains("verdict: autocast bf16 trains fine"), "{out}");
    let json = std::fs::read_to_string(healthy.join("doctor.json")).unwrap();
    let reports: Vec<Value> = serde_json::from_str(&json).unwrap();
    let targets: Vec<&str> = reports.iter().filter_map(|r| r["target"].as_str()).collect();
    assert_eq!(targets, ["O2 fp16", "autocast bf16"]);
    assert!(reports
        .iter()
        .all(|r| r["first_non_finite"].is_null() && r["modules"].as_array().is_some_and(|m| !m.is_empty())));

    // Inputs 10^4 times too large: the stem's convolution overflows fp16 in the forward pass.
    let overflow = dir.path().join("overflow");
    let args: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--levels", "O2", "--input-scale", "1e4", "--no-plot", "--out", s(&overflow)])
        .collect();
    let out = run_ok("doctor", &args);
    assert!(out.contains("first inf/NaN: forward: conv2d in stem"), "{out}");
    assert!(out.contains("switch to bf16"), "{out}");
    assert!(!overflow.join("doctor.png").exists());

    let out = run("doctor", &common.iter().copied().chain(["--levels", "O7"]).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("O7"), "{}", String::from_utf8_lossy(&out.stderr));
}

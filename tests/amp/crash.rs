//! Crash-safe checkpoints, for both save functions (`save_checkpoint`'s safetensors files and
//! `save_torch_checkpoint`'s torch.save files): a child process (this test binary again) saves
//! checkpoints in a loop, each save overwriting `ckpt.<ext>` and creating `new-<k>.<ext>`, and
//! is killed with SIGKILL after a seeded random delay (60 times for safetensors, 24 for
//! torch.save files). After each kill: the checkpoint that existed before always loads, whole
//! (every tensor, the learning rate and the loss scale of one single version); each new file is
//! absent or complete; and after the next successful save in the folder no temp file is left
//! (the kill leaves the dead writer's temp file; the next save removes it, whichever function
//! wrote it and whichever makes the next save: the trials clean up with the other one).
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::RngExt;
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::torch_checkpoint::{TorchLoadOptions, TorchSaveOptions};
use tch_amp::{Amp, AmpConfig, AmpOptimizer, OptLevel};

const CHILD_ENV: &str = "TCH_AMP_CRASH_DIR";
const READY: &str = "tch-amp-crash-child-ready";

/// Which save function a trial kills.
#[derive(Debug, Clone, Copy)]
enum Format {
    /// `save_checkpoint` / `load_checkpoint`.
    Safetensors,
    /// `save_torch_checkpoint` / `load_torch_checkpoint`.
    Torch,
}

impl Format {
    /// The other save function.
    fn other(self) -> Format {
        match self {
            Format::Safetensors => Format::Torch,
            Format::Torch => Format::Safetensors,
        }
    }

    fn ext(self) -> &'static str {
        match self {
            Format::Safetensors => "safetensors",
            Format::Torch => "pt",
        }
    }

    /// The test that runs this format's trials (the child runs it again).
    fn test_name(self) -> &'static str {
        match self {
            Format::Safetensors => "crash::sigkill_during_save_keeps_checkpoints_whole",
            Format::Torch => "crash::sigkill_during_torch_save_keeps_checkpoints_whole",
        }
    }

    fn save(self, path: &Path, vs: &VarStore, amp: &Amp, opt: &AmpOptimizer) {
        match self {
            Format::Safetensors => tch_amp::save_checkpoint(path, vs, &[opt], amp).unwrap(),
            Format::Torch => tch_amp::save_torch_checkpoint(path, vs, &[opt], amp, &TorchSaveOptions::new()).unwrap(),
        }
    }

    fn load(self, path: &Path, vs: &VarStore, amp: &mut Amp, opt: &mut AmpOptimizer) {
        let result = match self {
            Format::Safetensors => tch_amp::load_checkpoint(path, vs, &mut [opt], amp).map_err(|e| e.to_string()),
            Format::Torch => tch_amp::load_torch_checkpoint(path, vs, &mut [opt], amp, &TorchLoadOptions::new())
                .map(|_| ())
                .map_err(|e| e.to_string()),
        };
        result.unwrap_or_else(|e| panic!("{} does not load: {e}", path.display()));
    }
}

/// An O2 model with about 1 MB of checkpoint (a 64k-element variable: fp32 master, Adam's two
/// moments, the model value), after one step (so the optimizer state exists).
fn setup() -> (VarStore, Amp, AmpOptimizer) {
    let vs = VarStore::new(Device::Cpu);
    let _ = vs.root().var("big", &[256, 256], nn::Init::Const(0.0));
    let _ = vs.root().var("small", &[3], nn::Init::Const(0.0));
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    amp.cast_model(&vs, ()).unwrap();
    let mut opt = amp.optimizer(&vs, nn::Adam::default(), 1e-3).unwrap();
    let loss =
        vs.variables().values().map(|v| v.to_kind(Kind::Float).sum(Kind::Float)).fold(Tensor::from(0f32), |a, b| a + b)
            * 1e-3;
    opt.zero_grad().unwrap();
    amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
    assert!(opt.step().unwrap().stepped());
    (vs, amp, opt)
}

/// Version `k`: every model value, master and optimizer buffer is `k`, the learning rate is
/// `k + 1` and the loss scale `2^(k mod 20)`.
fn set_version(vs: &VarStore, amp: &mut Amp, opt: &mut AmpOptimizer, k: u64) {
    let _g = tch::no_grad_guard();
    for v in vs.variables().values() {
        let _ = v.shallow_clone().fill_(k as f64);
    }
    for m in opt.master_params() {
        let _ = m.shallow_clone().fill_(k as f64);
    }
    for p in opt.to_record().params {
        for b in p.buffers.values() {
            let _ = b.shallow_clone().fill_(k as f64);
        }
    }
    opt.set_lr(k as f64 + 1.0).unwrap();
    let scale = 2f64.powi((k % 20) as i32);
    amp.load_state_dict(&crate::common::value(
        serde_json::json!({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}}),
    ))
    .unwrap();
}

/// Loads `path` into a fresh setup and returns its version, checking that every value belongs
/// to that one version.
fn version_of(format: Format, path: &Path) -> u64 {
    let (vs, mut amp, mut opt) = setup();
    format.load(path, &vs, &mut amp, &mut opt);
    let k = opt.lr() - 1.0;
    assert!(k >= 0.0 && k.fract() == 0.0, "lr {}", opt.lr());
    let mut tensors: Vec<Tensor> = vs.variables().into_values().collect();
    tensors.extend(opt.master_params());
    for p in opt.to_record().params {
        tensors.extend(p.buffers.into_values());
    }
    for t in tensors {
        let t = t.to_kind(Kind::Double);
        assert!(t.eq(k).all().int64_value(&[]) == 1, "{}: a tensor is not all {k}", path.display());
    }
    assert_eq!(amp.loss_scale(0).unwrap(), 2f64.powi((k as u64 % 20) as i32));
    k as u64
}

fn temp_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tch-amp-tmp"))
        .collect()
}

/// The child: saves versions 1, 2, ... until killed (it gives up after 60 s or 2000 versions, fp16-exact integers,
/// so no process outlives a failed parent).
fn child(format: Format, dir: &Path) {
    let (vs, mut amp, mut opt) = setup();
    println!("{READY}");
    let start = Instant::now();
    let ext = format.ext();
    for k in 1..2000 {
        set_version(&vs, &mut amp, &mut opt, k);
        format.save(&dir.join(format!("ckpt.{ext}")), &vs, &amp, &opt);
        format.save(&dir.join(format!("new-{k}.{ext}")), &vs, &amp, &opt);
        if start.elapsed() > Duration::from_secs(60) {
            break;
        }
    }
}

/// One trial; returns (temp files the kill left, newest version on disk).
fn trial(format: Format, seed: u64) -> (usize, u64) {
    let dir = tempfile::tempdir().unwrap();
    let (vs, mut amp, mut opt) = setup();
    set_version(&vs, &mut amp, &mut opt, 0);
    let ext = format.ext();
    let ckpt = dir.path().join(format!("ckpt.{ext}"));
    format.save(&ckpt, &vs, &amp, &opt);

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", format.test_name(), "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir.path())
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines.by_ref().map_while(|l| l.ok()).any(|l| l.contains(READY));
    assert!(ready, "the child did not start");
    let delay = crate::common::rng(seed).random_range(0..60u64);
    std::thread::sleep(Duration::from_millis(delay));
    child.kill().unwrap(); // SIGKILL on Unix
    child.wait().unwrap();

    let left = temp_files(dir.path()).len();
    let newest = version_of(format, &ckpt);
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if let Some(k) = name.strip_prefix("new-").and_then(|n| n.strip_suffix(&format!(".{ext}"))) {
            let k: u64 = k.parse().unwrap();
            assert_eq!(version_of(format, &dir.path().join(&name)), k, "trial {seed}: {name}");
            assert!(k <= newest + 1, "trial {seed}: {name} is newer than ckpt (version {newest})");
        }
    }
    // The next successful save removes what the dead writer left, whichever function makes it.
    set_version(&vs, &mut amp, &mut opt, 2047);
    let other = format.other();
    other.save(&dir.path().join(format!("other.{}", other.ext())), &vs, &amp, &opt);
    assert_eq!(temp_files(dir.path()), Vec::<String>::new(), "trial {seed}: temp files survived a later save");
    format.save(&ckpt, &vs, &amp, &opt);
    assert_eq!(version_of(format, &ckpt), 2047);
    (left, newest)
}

/// `trials` kills of a child saving in `format` (two trials at a time), or the child itself.
fn sigkill_trials(format: Format, trials: u64) {
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        child(format, Path::new(&dir));
        return;
    }
    let start = Instant::now();
    let results: Vec<(usize, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|t| s.spawn(move || (0..trials / 2).map(|i| trial(format, 100 + 2 * i + t)).collect::<Vec<_>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.len() as u64, trials);
    let killed_mid_write = results.iter().filter(|r| r.0 > 0).count();
    let advanced = results.iter().filter(|r| r.1 > 0).count();
    eprintln!(
        "crash ({format:?}): {trials} SIGKILL trials in {:.1} s: {killed_mid_write} left a temp file (killed \
         mid-write, removed by the next save), {advanced} had overwritten the previous checkpoint; every checkpoint \
         loaded whole",
        start.elapsed().as_secs_f64()
    );
    // The kills landed inside saves, and some after a completed overwrite.
    assert!(killed_mid_write > 0 && advanced > 0, "the kills did not exercise saves: {results:?}");
}

#[test]
fn sigkill_during_save_keeps_checkpoints_whole() {
    sigkill_trials(Format::Safetensors, 60);
}

#[test]
fn sigkill_during_torch_save_keeps_checkpoints_whole() {
    sigkill_trials(Format::Torch, 24);
}

/// The stale-temp cleanup leaves a live writer's temp file alone: a locked temp file (as a
/// save in progress holds it) survives another save in the same folder; once unlocked it goes.
#[test]
fn live_writers_temp_files_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (vs, amp, opt) = setup();
    let live = dir.path().join(".other.safetensors.1-0.tch-amp-tmp");
    let f = std::fs::File::create(&live).unwrap();
    fs4::FileExt::lock(&f).unwrap();
    let dead = dir.path().join(".other.safetensors.2-0.tch-amp-tmp");
    std::fs::write(&dead, b"partial").unwrap();
    let unrelated = dir.path().join(".notes.tmp");
    std::fs::write(&unrelated, b"keep").unwrap();
    tch_amp::save_checkpoint(dir.path().join("c.safetensors"), &vs, &[&opt], &amp).unwrap();
    assert!(live.exists(), "a locked (live) temp file was removed");
    assert!(!dead.exists(), "an unlocked (dead) temp file survived");
    assert!(unrelated.exists());
    drop(f);
    // A flock lives as long as any descriptor of the open file: a child that another test
    // thread is spawning at this moment holds a copy until its exec closes it (a window that
    // stretches to milliseconds on a loaded machine). So the next saves may still see the lock
    // for a moment; one of them within a few seconds must remove the file.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        tch_amp::save_checkpoint(dir.path().join("c.safetensors"), &vs, &[&opt], &amp).unwrap();
        if !live.exists() || std::time::Instant::now() > deadline {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(!live.exists(), "an unlocked temp file survived the saves after its writer closed it");
}

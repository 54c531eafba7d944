//! examples/imagenet.rs in Apex's distributed mode: two processes started with torchrun's
//! environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; what
//! `torchrun --no-python --nproc-per-node 2 target/release/examples/imagenet ...` sets) on
//! synthetic data, O2 and --sync_bn: rank 0 alone prints, logs and writes the checkpoint, both
//! ranks resume from it, and `-e` validates on the two shards.
#[path = "../../examples/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::data::write_synthetic;
use tempfile::TempDir;

fn example_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("test binary is in <target>/<profile>/deps");
    let bin = profile_dir.join("examples").join(name);
    assert!(
        bin.exists(),
        "example binary {} is missing: run `cargo test` (which builds the examples) or `cargo build --examples`",
        bin.display()
    );
    bin
}

/// Both ranks; killed and reaped when dropped.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs imagenet on two ranks; returns each rank's stdout. Fails on a non-zero exit.
fn run_two(args: &[&str]) -> Vec<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut ranks = Ranks(Vec::new());
    let dir = TempDir::new().unwrap();
    for rank in 0..2 {
        let out = std::fs::File::create(dir.path().join(format!("out{rank}"))).unwrap();
        let child = Command::new(example_bin("imagenet"))
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("OMP_NUM_THREADS", "1")
            .env("CI", "true")
            .stdin(Stdio::null())
            .stdout(out)
            .spawn()
            .expect("spawn imagenet");
        ranks.0.push(child);
    }
    let start = Instant::now();
    for (rank, c) in ranks.0.iter_mut().enumerate() {
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                let out = std::fs::read_to_string(dir.path().join(format!("out{rank}"))).unwrap();
                assert!(status.success(), "rank {rank} failed ({status}):\n{out}");
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(120), "imagenet ranks did not finish in 120 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    (0..2).map(|r| std::fs::read_to_string(dir.path().join(format!("out{r}"))).unwrap()).collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn imagenet_distributed_sync_bn_o2() {
    let data = TempDir::new().unwrap();
    write_synthetic(data.path(), 256, 64, 10, 28, 3).unwrap();
    let dir = TempDir::new().unwrap();
    let ck_dir = dir.path().join("ck");
    let log = dir.path().join("log.jsonl");
    let base = [
        "--data",
        s(data.path()),
        "--opt-level",
        "O2",
        "--sync_bn",
        "--train-size",
        "192",
        "--test-size",
        "64",
        "-b",
        "48",
        "--width",
        "4",
        "--stages",
        "2",
        "--checkpoint-dir",
        s(&ck_dir),
    ];
    let mut args = base.to_vec();
    args.extend(["--epochs", "1", "--log", s(&log)]);
    let out = run_two(&args);
    assert!(out[0].contains("distributed: world size 2, sync_bn = true"), "{}", out[0]);
    assert!(out[0].contains("* Prec@1") && out[0].contains("saved checkpoint"), "{}", out[0]);
    assert!(!out[1].contains("Epoch:") && !out[1].contains("Prec@1"), "rank 1 printed:\n{}", out[1]);
    // 192 images over 2 ranks, 48 per rank and step: 2 steps, logged once (rank 0).
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines.iter().all(|l| l["loss"].as_f64().is_some_and(f64::is_finite)));
    let ck = ck_dir.join("checkpoint.safetensors");
    assert!(ck.exists());
    // Both ranks resume from rank 0's checkpoint for the second epoch, then validate only.
    let mut args = base.to_vec();
    args.extend(["--epochs", "2", "--resume", s(&ck)]);
    let out = run_two(&args);
    assert!(out[0].contains("loaded checkpoint") && out[0].contains("Epoch: [1]"), "{}", out[0]);
    let mut args = base.to_vec();
    args.extend(["-e", "--resume", s(&ck)]);
    let out = run_two(&args);
    assert!(out[0].contains("* Prec@1") && !out[0].contains("Epoch:"), "{}", out[0]);
}

//! Distributed benchmark on this machine: allreduce bandwidth through tch-amp's process group
//! against Python's torch.distributed (same sizes, same run, both Gloo over 127.0.0.1), and
//! the time of one data-parallel training step on 1 and 2 processes, through tch-amp's
//! DistributedDataParallel (c10d::Reducer with buckets overlapping backward, with
//! `delay_allreduce`, and a plain allreduce of every gradient after backward without the
//! Reducer) and through torch's DDP. Every process uses one intra-op thread.
//!
//! ```text
//! cargo run --release --example dist_bench
//! cargo run --release --example dist_bench -- --quick
//! ```
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};
use tch_amp::distributed::{DdpOptions, DistributedDataParallel, ProcessGroup, ReduceOp};
use tch_amp::{initialize, AmpConfig, OptLevel};

const ROLE: &str = "TCH_AMP_BENCH_ROLE";
const ARGS: &str = "TCH_AMP_BENCH_ARGS";

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn python() -> String {
    // At run time, or as cargo's [env] (make setup) gave it at build time.
    std::env::var("TCH_AMP_PYTHON").unwrap_or_else(|_| option_env!("TCH_AMP_PYTHON").unwrap_or("python3").into())
}

/// Runs `world` processes (built by `cmd(rank, port)`), returns rank 0's stdout lines as JSON.
fn run_group(world: usize, cmd: impl Fn(usize, u16) -> Command) -> Result<Vec<serde_json::Value>> {
    let port = free_port()?;
    let mut children = Vec::new();
    for rank in 0..world {
        let mut c = cmd(rank, port);
        c.stdin(Stdio::null()).stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() });
        children.push(c.spawn().context("spawning a rank")?);
    }
    let out = children[0].stdout.take().context("rank 0's stdout")?;
    let lines: Vec<serde_json::Value> =
        BufReader::new(out).lines().map_while(|l| l.ok()).filter_map(|l| serde_json::from_str(&l).ok()).collect();
    for mut c in children {
        let status = c.wait()?;
        if !status.success() {
            bail!("a rank failed: {status}");
        }
    }
    Ok(lines)
}

fn rust_rank(rank: usize, world: usize, port: u16, role: &str, args: &str) -> Result<Command> {
    let mut c = Command::new(std::env::current_exe()?);
    c.env(ROLE, role)
        .env(ARGS, args)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string());
    Ok(c)
}

fn python_rank(rank: usize, world: usize, port: u16, args: &[String]) -> Command {
    let mut c = Command::new(python());
    c.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/bench_dist.py"));
    c.arg(&args[0]).arg(rank.to_string()).arg(world.to_string()).arg(port.to_string()).args(&args[1..]);
    c
}

fn numbers(args: &str) -> Vec<usize> {
    args.split_whitespace().filter_map(|a| a.parse().ok()).collect()
}

/// Worker: allreduce of each size `iters` times; rank 0 prints seconds per allreduce.
fn worker_allreduce(args: &str) -> Result<()> {
    let n = numbers(args);
    let (iters, sizes) = (n[0], &n[1..]);
    let pg = ProcessGroup::init_from_env()?;
    for &size in sizes {
        let mut t = Tensor::ones([(size / 4) as i64], (Kind::Float, Device::Cpu));
        pg.all_reduce_(&mut t, ReduceOp::Sum)?;
        pg.barrier()?;
        let start = Instant::now();
        for _ in 0..iters {
            pg.all_reduce_(&mut t, ReduceOp::Sum)?;
        }
        let secs = start.elapsed().as_secs_f64() / iters as f64;
        if pg.is_main() {
            println!("{}", serde_json::json!({"bytes": size, "seconds": secs}));
        }
    }
    Ok(())
}

fn mlp(vs: &nn::VarStore, hidden: i64) -> impl ModuleT {
    let p = vs.root();
    nn::seq_t()
        .add(nn::linear(&p / "0", 784, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "2", hidden, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "4", hidden, 10, Default::default()))
}

/// Worker: `steps` timed DDP steps; variant "reducer" (1 MiB buckets overlapping backward),
/// "delay" (delay_allreduce), "manual" (no Reducer: all_reduce of every gradient after
/// backward). Rank 0 prints ms per step.
fn worker_ddp(args: &str) -> Result<()> {
    let mut it = args.split_whitespace();
    let variant = it.next().context("variant")?.to_string();
    let n: Vec<usize> = it.filter_map(|a| a.parse().ok()).collect();
    let (steps, batch, hidden) = (n[0], n[1] as i64, n[2] as i64);
    let pg = ProcessGroup::init_from_env()?;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs, hidden);
    let sgd = nn::Sgd { momentum: 0.9, ..Default::default() };
    let (model, mut opt, mut amp) = initialize(&vs, net, sgd, 0.01, &AmpConfig::new(OptLevel::O0).verbosity(0))?;
    let x = Tensor::randn([batch, 784], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(10, [batch], (Kind::Int64, Device::Cpu));
    let options = match variant.as_str() {
        "delay" => DdpOptions::default().delay_allreduce(true),
        _ => DdpOptions::default().message_size(1 << 18),
    };
    let manual = variant == "manual";
    let (ddp, plain);
    let net: &dyn ModuleT = if manual {
        plain = model;
        &plain
    } else {
        ddp = DistributedDataParallel::new(&pg, &vs, model, &mut [&mut opt], options)?;
        &ddp
    };
    let mut step = || -> Result<()> {
        let loss = net.forward_t(&x, true).cross_entropy_for_logits(&y);
        opt.zero_grad()?;
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward())?;
        if manual {
            let mut grads: Vec<Tensor> = opt.master_params().iter().map(Tensor::grad).collect();
            pg.all_reduce_many_(&mut grads, ReduceOp::Avg)?;
        }
        opt.step()?;
        Ok(())
    };
    for _ in 0..3 {
        step()?;
    }
    pg.barrier()?;
    let start = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    let ms = start.elapsed().as_secs_f64() * 1e3 / steps as f64;
    if pg.is_main() {
        println!("{}", serde_json::json!({ "ms_per_step": ms }));
    }
    Ok(())
}

fn ms(lines: &[serde_json::Value]) -> f64 {
    lines.first().and_then(|v| v["ms_per_step"].as_f64()).unwrap_or(f64::NAN)
}

fn main() -> Result<()> {
    tch::set_num_threads(1);
    if let Ok(role) = std::env::var(ROLE) {
        let args = std::env::var(ARGS).unwrap_or_default();
        return match role.as_str() {
            "allreduce" => worker_allreduce(&args),
            "ddp" => worker_ddp(&args),
            r => bail!("unknown role {r}"),
        };
    }
    let quick = std::env::args().any(|a| a == "--quick");
    // The runs of each kind alternate over `reps` rounds and the median is printed, so that a
    // load change on a shared machine hits every kind alike.
    let reps = if quick { 1 } else { 3 };
    println!(
        "CPU: {} ({} cores visible), one intra-op thread per process, median of {reps} interleaved rounds",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };

    // Allreduce bandwidth: size / time of one allreduce (torch's "algorithm bandwidth").
    let sizes: Vec<usize> = vec![64 << 10, 1 << 20, 4 << 20, 16 << 20];
    let iters = if quick { 5 } else { 30 };
    let size_args = sizes.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ");
    let mut py_args = vec!["allreduce".to_string(), iters.to_string()];
    py_args.extend(sizes.iter().map(ToString::to_string));
    let (mut rs_secs, mut py_secs) = (vec![Vec::new(); sizes.len()], vec![Vec::new(); sizes.len()]);
    for _ in 0..reps {
        let rs = run_group(2, |r, p| rust_rank(r, 2, p, "allreduce", &format!("{iters} {size_args}")).expect("rank"))?;
        let py = run_group(2, |r, p| python_rank(r, 2, p, &py_args))?;
        for (i, (a, b)) in rs.iter().zip(&py).enumerate() {
            rs_secs[i].push(a["seconds"].as_f64().unwrap_or(f64::NAN));
            py_secs[i].push(b["seconds"].as_f64().unwrap_or(f64::NAN));
        }
    }
    println!("\nallreduce, 2 processes, Gloo on 127.0.0.1, fp32, {iters} iterations per size (GB/s = bytes / time):");
    println!("| size | tch-amp | torch.distributed (Python) |");
    println!("|---|---|---|");
    for (i, &bytes) in sizes.iter().enumerate() {
        let gbs = |secs: &Vec<f64>| bytes as f64 / median(secs.clone()) / 1e9;
        println!("| {} KiB | {:.2} GB/s | {:.2} GB/s |", bytes >> 10, gbs(&rs_secs[i]), gbs(&py_secs[i]));
    }

    // DDP step time.
    let (steps, batch, hidden) = (if quick { 5 } else { 20 }, 64, 1024);
    let kinds = [
        ("tch-amp DDP (Reducer, 1 MiB buckets)", Some("reducer")),
        ("tch-amp DDP, delay_allreduce", Some("delay")),
        ("tch-amp, allreduce after backward (no Reducer)", Some("manual")),
        ("torch DDP (Python)", None),
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); kinds.len() * 2];
    for _ in 0..reps {
        for (k, (_, variant)) in kinds.iter().enumerate() {
            for (w, world) in [1usize, 2].into_iter().enumerate() {
                let lines = match variant {
                    Some(v) => {
                        let args = format!("{v} {steps} {batch} {hidden}");
                        run_group(world, |r, p| rust_rank(r, world, p, "ddp", &args).expect("rank"))?
                    }
                    None => {
                        let args: Vec<String> =
                            vec!["ddp".into(), steps.to_string(), batch.to_string(), hidden.to_string()];
                        run_group(world, |r, p| python_rank(r, world, p, &args))?
                    }
                };
                times[2 * k + w].push(ms(&lines));
            }
        }
    }
    println!("\nDDP step (MLP 784-{hidden}-{hidden}-10, fp32/O0, SGD, batch {batch} per process, {steps} steps):");
    println!("| run | processes | ms/step | samples/s |");
    println!("|---|---|---|---|");
    for (k, (name, _)) in kinds.iter().enumerate() {
        for (w, world) in [1usize, 2].into_iter().enumerate() {
            let m = median(times[2 * k + w].clone());
            println!("| {name} | {world} | {m:.1} | {:.0} |", (batch as usize * world) as f64 / m * 1e3);
        }
    }
    Ok(())
}

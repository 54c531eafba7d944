//! O2's slice-wise step, in its own process (it changes process-wide settings and counts every
//! CPU allocation): the fp32 master gradients are made from the fp16 ones a slice at a time
//! inside `step`, which must give exactly what making them full-size at `scale_loss` exit gives
//! (every update rule is elementwise), and holds at most 16 bytes per parameter with Adam
//! (2 fp16 weight + 4 fp32 master + 2 fp16 gradient + 8 Adam state), measured with a counting
//! CPU allocator, where the full-size path holds 18.
use std::sync::Mutex;

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::diagnostics::{cpu_memory, reset_cpu_memory_peak, set_master_grad_slice, track_cpu_memory};
use tch_amp::{initialize, AmpConfig, OptLevel, OptimizerConfig};

/// The tests change a process-wide setting and count process-wide allocations: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn net(vs: &VarStore, width: i64) -> nn::Sequential {
    let r = vs.root();
    nn::seq()
        .add(nn::linear(&r / "a", 64, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "b", width, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "c", width, 8, Default::default()))
}

/// Bits of every variable and master and of the optimizer state after `steps` O2 steps.
fn train(opt_cfg: OptimizerConfig, slice: i64, steps: usize) -> Vec<(String, Vec<i32>)> {
    let previous = set_master_grad_slice(slice);
    tch::manual_seed(7);
    let vs = VarStore::new(Device::Cpu);
    let model = net(&vs, 96);
    let amp_cfg = AmpConfig::new(OptLevel::O2).loss_scale(128.0);
    let (model, mut opt, mut amp) = initialize(&vs, model, opt_cfg, 1e-2, &amp_cfg).unwrap();
    let x = Tensor::randn([16, 64], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
    for _ in 0..steps {
        opt.zero_grad().unwrap();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        assert!(opt.step().unwrap().stepped());
    }
    set_master_grad_slice(previous);
    let bits = |t: &Tensor| -> Vec<i32> {
        let t = t.to_kind(Kind::Float).flatten(0, -1);
        Vec::<f32>::try_from(&t).unwrap().iter().map(|v| v.to_bits() as i32).collect()
    };
    let mut out: Vec<(String, Vec<i32>)> = Vec::new();
    let mut names: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, v) in names {
        assert_eq!(v.kind(), Kind::Half, "{name}: O2 casts the model");
        out.push((name, bits(&v)));
    }
    let record = opt.to_record();
    for p in record.params {
        out.push((format!("{} master", p.name), bits(p.master.as_ref().unwrap())));
        for (k, b) in p.buffers {
            out.push((format!("{} {k}", p.name), bits(&b)));
        }
    }
    out
}

/// Slices of 100 elements (many per parameter: 96x96 = 9216), of the default 64 Ki (one per
/// parameter here) and no slicing (master gradients made full-size at scale_loss exit) give
/// the same bits for every rule, including the first update that creates the state.
#[test]
fn slice_wise_step_equals_full_size_step_bit_for_bit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let configs: Vec<(&str, OptimizerConfig)> = vec![
        ("adam", nn::Adam { wd: 1e-3, ..Default::default() }.into()),
        ("adamw amsgrad", nn::AdamW { amsgrad: true, ..Default::default() }.into()),
        ("sgd nesterov", nn::Sgd { momentum: 0.9, nesterov: true, wd: 1e-4, ..Default::default() }.into()),
        ("sgd dampening", nn::Sgd { momentum: 0.9, dampening: 0.3, ..Default::default() }.into()),
        ("rmsprop centered", nn::RmsProp { centered: true, momentum: 0.5, ..Default::default() }.into()),
    ];
    for (name, cfg) in configs {
        let full = train(cfg, 0, 3);
        for slice in [100, 1 << 16] {
            let sliced = train(cfg, slice, 3);
            assert_eq!(full.len(), sliced.len());
            for ((a_name, a), (b_name, b)) in full.iter().zip(&sliced) {
                assert_eq!(a_name, b_name);
                let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
                assert_eq!(differ, 0, "{name}, slices of {slice}: {a_name} differs in {differ} of {} values", a.len());
            }
        }
    }
}

/// Peak bytes per parameter from the end of backward to the end of `step` (the unscale, the
/// master gradients, Adam, the copy into the model), measured with the counting allocator: the
/// peak minus what is alive then and is not training state (the batch, the loss, ...).
fn measured_peak(slice: i64) -> (f64, f64) {
    let previous = set_master_grad_slice(slice);
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let model = net(&vs, 1024);
    let (model, mut opt, mut amp) =
        initialize(&vs, model, nn::Adam::default(), 1e-3, &AmpConfig::new(OptLevel::O2).loss_scale(128.0)).unwrap();
    let x = Tensor::randn([4, 64], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    let mut step = |measure: bool| -> (f64, f64) {
        opt.zero_grad().unwrap();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| {
            s.backward();
            reset_cpu_memory_peak().unwrap();
        })
        .unwrap();
        let before = cpu_memory().unwrap();
        let state = opt.memory();
        assert!(opt.step().unwrap().stepped());
        let after = cpu_memory().unwrap();
        let other = before.current - state.total() as i64;
        let params = state.params as f64;
        if measure {
            ((after.peak - other) as f64 / params, state.bytes_per_param())
        } else {
            (0.0, 0.0)
        }
    };
    step(false);
    step(false);
    let out = step(true);
    set_master_grad_slice(previous);
    out
}

#[test]
fn o2_adam_peaks_at_16_bytes_per_param_measured() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    track_cpu_memory().unwrap();
    let params = (64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 8 + 8) as f64;
    // 16 B/param of state, plus the one fresh slice buffer the smallest parameters may take.
    let (peak, counted) = measured_peak(1 << 16);
    println!("slice-wise: {peak:.4} B/param measured at the peak, {counted} counted at step");
    assert_eq!(counted, 16.0, "fp16 weight 2 + master 4 + fp16 grad 2 + Adam 8, counted at step");
    assert!(peak <= 16.0 + 16384.0 / params, "slice-wise: measured peak {peak:.4} B/param");
    assert!(peak >= 15.99, "the counter sees the training state: {peak:.4}");
    // The full-size path (the fp32 master gradients made at scale_loss exit) holds 18.
    let (peak_full, counted_full) = measured_peak(0);
    println!("full-size: {peak_full:.4} B/param measured at the peak, {counted_full} counted at step");
    assert_eq!(counted_full, 18.0, "fp16 weight 2 + master 4 + fp32 master grad 4 + Adam 8");
    assert!(peak_full >= 17.99, "full-size: measured peak {peak_full:.4} B/param");
}

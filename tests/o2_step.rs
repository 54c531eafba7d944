//! O2's step, in its own process (it counts every CPU allocation): `scale_loss` makes the fp32
//! master gradients and releases the fp16 ones, so the step holds 18 bytes per parameter with
//! Adam (2 fp16 weight + 4 fp32 master + 4 fp32 master gradient + 8 Adam state), measured with
//! a counting CPU allocator, plus the update rule's own temporaries.
use std::sync::Mutex;

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::cast::clear_cast_cache;
use tch_amp::diagnostics::{cpu_memory, reset_cpu_memory_peak, track_cpu_memory};
use tch_amp::{initialize, AmpConfig, OptLevel, OptimizerConfig};

/// The tests count process-wide allocations: one at a time.
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

fn adam(fused: bool) -> OptimizerConfig {
    OptimizerConfig::from(nn::Adam::default()).fused(fused)
}

/// Peak bytes per parameter from the end of backward to the end of `step` (the unscale, the
/// master gradients, Adam, the copy into the model), measured with the counting allocator:
/// everything the process holds then except the batch (what the caller holds: the input and
/// target tensors; the loss and the 4x8 output are a few hundred bytes). Anything tch-amp keeps
/// (a cast cache, say) counts.
fn measured_peak(fused: bool) -> (f64, f64) {
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let model = net(&vs, 1024);
    let (model, mut opt, mut amp) =
        initialize(&vs, model, adam(fused), 1e-3, &AmpConfig::new(OptLevel::O2).loss_scale(128.0)).unwrap();
    let x = Tensor::randn([4, 64], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    // Allocated after the counter was installed: the counter sees them (and the batch is
    // subtracted as the caller's).
    let mut step = |measure: bool| -> (f64, f64) {
        opt.zero_grad().unwrap();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| {
            s.backward();
            // What scale_loss does right after backward (under CPU emulation the cache holds
            // the forward's fp32 copies of the fp16 weights); the peak starts after it.
            clear_cast_cache().unwrap();
            reset_cpu_memory_peak().unwrap();
        })
        .unwrap();
        let state = opt.memory();
        assert!(opt.step().unwrap().stepped());
        let after = cpu_memory().unwrap();
        let other = ((x.numel() + y.numel()) * 4) as i64;
        let params = state.params as f64;
        if measure {
            ((after.peak - other) as f64 / params, state.bytes_per_param())
        } else {
            (0.0, 0.0)
        }
    };
    step(false);
    step(false);
    step(true)
}

#[test]
fn o2_adam_peaks_at_18_bytes_per_param_measured() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    track_cpu_memory().unwrap();
    let params = (64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 8 + 8) as f64;
    // Fused Adam has no temporaries: 18 B/param, plus at scale_loss's exit the fp16 gradient
    // of the parameter being copied to fp32 (each is released once copied; the largest has
    // 1 Mi elements), and a few hundred bytes of scalars.
    let largest = (1 << 20) as f64;
    let (peak, counted) = measured_peak(true);
    println!("fused Adam: {peak:.4} B/param measured at the peak, {counted} counted at step");
    assert_eq!(counted, 18.0, "fp16 weight 2 + master 4 + fp32 master grad 4 + Adam 8, counted at step");
    assert!(peak <= 18.0 + (2.0 * largest + 2048.0) / params, "measured peak {peak:.5} B/param");
    assert!(peak >= 17.99, "the counter sees the training state: {peak:.4}");
    // torch.optim's single-tensor Adam (the default) makes two fp32 temporaries per update
    // (sqrt, then the division by the bias correction), of the largest parameter (1 Mi elements).
    let (peak_single, _) = measured_peak(false);
    println!("single-tensor Adam: {peak_single:.4} B/param measured at the peak");
    assert!(peak_single <= 18.0 + (2048.0 + 2.0 * 4.0 * largest) / params, "{peak_single:.4} B/param");
}

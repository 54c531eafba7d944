//! The main job's CNN (examples/fashion_mnist.rs) on a real Fashion-MNIST batch trains fine at
//! O1, O2 and autocast bf16: the doctor must say so (no false positives).
#[path = "../../examples/common/mod.rs"]
mod example_common;

use std::path::Path;

use tch::nn::VarStore;
use tch::{Device, Kind};
use tch_amp::doctor::Doctor;
use tch_amp::{AmpConfig, Autocast, CpuKernels, OptLevel};

use example_common::{data, model};

#[test]
fn main_job_trains_fine_at_o1_o2_and_bf16() {
    tch::set_num_threads(1);
    tch::manual_seed(0);
    let data = data::Dataset::load(Path::new(data::DEFAULT_DATA_DIR)).expect("Fashion-MNIST").standardize();
    let vs = VarStore::new(Device::Cpu);
    let cfg = model::ResNetConfig { in_channels: 1, num_classes: data.num_classes, width: 16, stages: 2, pool: 7 };
    let net = model::SmallResNet::new(&vs.root(), cfg);
    let idx: Vec<i64> = (0..128).collect();
    let (x, y) = data.train.batch(&idx);
    for doctor in [
        Doctor::apex(AmpConfig::new(OptLevel::O1).cpu_kernels(CpuKernels::Emulate)),
        Doctor::apex(AmpConfig::new(OptLevel::O2).cpu_kernels(CpuKernels::Emulate)),
        Doctor::autocast(Autocast::new(Device::Cpu).dtype(Kind::BFloat16)),
    ] {
        let r = doctor.run(&vs, |p| p.forward_t(&net, &x, true).cross_entropy_for_logits(&y)).unwrap();
        assert!(r.trains_fine(), "{}: {:#?}", r.summary(), r.findings);
        assert_eq!(r.first_non_finite, None);
        for m in ["stem", "block0.conv1", "block1.conv2", "fc"] {
            assert!(r.module(m).is_some_and(|m| m.forward.is_some() && m.backward.is_some()), "{m}");
        }
        assert!((r.loss.target - r.loss.fp32).abs() < 0.05 * r.loss.fp32, "{:?}", r.loss);
    }
}

//! The constructed models of the doctor's tests, with deterministic weights (no RNG) and
//! batches, so that every number is known in advance.
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

/// Deterministic values `sin(0.37 i + offset) * amplitude` in `shape`.
pub fn wave(shape: &[i64], offset: f64, amplitude: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + offset).sin() * amplitude).reshape(shape)
}

/// Sets a variable of `vs` to `values` (same shape).
pub fn set(vs: &VarStore, name: &str, values: &Tensor) {
    let _g = tch::no_grad_guard();
    let v = &vs.variables()[name];
    v.shallow_clone().copy_(&values.to_kind(v.kind()).to_device(v.device()));
}

/// fc1 (8→16) → relu → `big` (16→16) → relu → head (16→4). `big`'s weights are
/// `big_gain` times larger than the others, so its activations reach `big_gain` times the
/// input scale.
#[derive(Debug)]
pub struct ThreeLayers {
    pub fc1: nn::Linear,
    pub big: nn::Linear,
    pub head: nn::Linear,
}

impl ThreeLayers {
    pub fn new(vs: &VarStore, big_gain: f64) -> Self {
        let root = vs.root();
        let net = Self {
            fc1: nn::linear(&root / "fc1", 8, 16, Default::default()),
            big: nn::linear(&root / "big", 16, 16, Default::default()),
            head: nn::linear(&root / "head", 16, 4, Default::default()),
        };
        set(vs, "fc1.weight", &wave(&[16, 8], 0.1, 0.3));
        set(vs, "fc1.bias", &wave(&[16], 0.2, 0.1));
        set(vs, "big.weight", &wave(&[16, 16], 0.3, 0.3 * big_gain));
        set(vs, "big.bias", &wave(&[16], 0.4, 0.1));
        set(vs, "head.weight", &wave(&[4, 16], 0.5, 0.3));
        set(vs, "head.bias", &wave(&[4], 0.6, 0.1));
        net
    }
}

impl Module for ThreeLayers {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.head.forward(&self.big.forward(&self.fc1.forward(xs).relu()).relu())
    }
}

/// A batch of 32: inputs [32, 8] at `scale`, targets [32, 4].
pub fn batch(scale: f64) -> (Tensor, Tensor) {
    (wave(&[32, 8], 1.0, scale), wave(&[32, 4], 2.0, 1.0))
}

/// fc1 (8→16) → relu → `cancel` (16→4), whose output is a sum of large terms that cancel:
/// fc1's rows come in equal pairs (so its outputs do), and `cancel`'s weights are
/// `+1000 + d` and `-1000 + d'` on each pair, with |d|, |d'| <= 0.01 and no bias. In fp32 the
/// output is the small sum of `(d + d') h`; in fp16 or bf16, `±1000 + d` rounds to `±1000`
/// (fp16's spacing at 1000 is 0.5, bf16's 4), the pairs cancel exactly and the output is 0:
/// a relative error of 1 with every value in range.
#[derive(Debug)]
pub struct Cancelling {
    pub fc1: nn::Linear,
    pub cancel: nn::Linear,
}

impl Cancelling {
    pub fn new(vs: &VarStore) -> Self {
        let root = vs.root();
        let net = Self {
            fc1: nn::linear(&root / "fc1", 8, 16, Default::default()),
            cancel: nn::linear(&root / "cancel", 16, 4, nn::LinearConfig { bias: false, ..Default::default() }),
        };
        // Rows 2k and 2k+1 of fc1 equal.
        let half = wave(&[8, 8], 0.1, 0.3);
        set(vs, "fc1.weight", &Tensor::stack(&[&half, &half], 1).reshape([16, 8]));
        let hb = wave(&[8], 0.2, 0.1).abs() + 0.05;
        set(vs, "fc1.bias", &Tensor::stack(&[&hb, &hb], 1).reshape([16]));
        let sign = Tensor::from_slice(&[1f32, -1.0]).repeat([4, 8]);
        set(vs, "cancel.weight", &(sign * 1000.0 + wave(&[4, 16], 0.5, 0.01)));
        net
    }
}

impl Module for Cancelling {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.cancel.forward(&self.fc1.forward(xs).relu())
    }
}

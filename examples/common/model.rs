//! A small ResNet-style CNN with batch norm for 28x28 single-channel images: a 3x3 stem
//! convolution, then `stages` basic residual blocks (two 3x3 convolutions with batch norm,
//! a 1x1 projection shortcut when the shape changes), each halving the resolution and
//! doubling the channels, average pooling to `pool`x`pool` and a linear classifier.
//!
//! Variable names (`stem.weight`, `stem_bn.running_mean`, `block0.conv1.weight`,
//! `block0.shortcut_bn.weight`, `fc.bias`, ...) are what checkpoints and `--log` refer to.
use tch::nn::{self, ConvConfig, Module, ModuleT};
use tch::Tensor;

/// Width and depth of [`SmallResNet`].
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ResNetConfig {
    /// Input channels (1 for Fashion-MNIST).
    pub in_channels: i64,
    /// Output classes.
    pub num_classes: i64,
    /// Channels after the stem; each stage doubles them.
    pub width: i64,
    /// Residual stages, each of one basic block with stride 2.
    pub stages: usize,
    /// Side of the average-pooled feature map the classifier sees (1 = global average
    /// pooling; larger keeps some spatial layout, which a shallow net needs to learn fast).
    pub pool: i64,
}

fn conv(p: nn::Path, cin: i64, cout: i64, k: i64, stride: i64) -> nn::Conv2D {
    let cfg = ConvConfig { stride, padding: k / 2, bias: false, ..Default::default() };
    nn::conv2d(p, cin, cout, k, cfg)
}

fn bn(p: nn::Path, c: i64) -> Norm {
    Box::new(nn::batch_norm2d(p, c, Default::default()))
}

/// A batch-norm layer: tch's `nn::BatchNorm`, or (`--sync_bn`) a `SyncBatchNorm`.
pub type Norm = Box<dyn ModuleT>;

/// Makes the batch norm of `c` channels at a path (the variables must be those of
/// `nn::batch_norm2d`, as `tch_amp::distributed::sync_batch_norm` creates them).
pub type MakeNorm<'a> = &'a dyn Fn(nn::Path, i64) -> Norm;

#[derive(Debug)]
struct BasicBlock {
    conv1: nn::Conv2D,
    bn1: Norm,
    conv2: nn::Conv2D,
    bn2: Norm,
    shortcut: Option<(nn::Conv2D, Norm)>,
}

impl BasicBlock {
    fn new(p: &nn::Path, cin: i64, cout: i64, stride: i64, bn: MakeNorm) -> Self {
        let shortcut = (stride != 1 || cin != cout)
            .then(|| (conv(p / "shortcut", cin, cout, 1, stride), bn(p / "shortcut_bn", cout)));
        Self {
            conv1: conv(p / "conv1", cin, cout, 3, stride),
            bn1: bn(p / "bn1", cout),
            conv2: conv(p / "conv2", cout, cout, 3, 1),
            bn2: bn(p / "bn2", cout),
            shortcut,
        }
    }
}

impl ModuleT for BasicBlock {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let y = self.bn1.forward_t(&self.conv1.forward(xs), train).relu();
        let y = self.bn2.forward_t(&self.conv2.forward(&y), train);
        let s = match &self.shortcut {
            Some((c, b)) => b.forward_t(&c.forward(xs), train),
            None => xs.shallow_clone(),
        };
        (y + s).relu()
    }
}

/// The network; see the module doc.
#[derive(Debug)]
pub struct SmallResNet {
    stem: nn::Conv2D,
    stem_bn: Norm,
    blocks: Vec<BasicBlock>,
    fc: nn::Linear,
    pool: i64,
}

impl SmallResNet {
    /// Creates the variables under `p`.
    pub fn new(p: &nn::Path, cfg: ResNetConfig) -> Self {
        Self::with_norm(p, cfg, &bn)
    }

    /// [`Self::new`] with batch norms made by `bn` (e.g. SyncBatchNorm).
    pub fn with_norm(p: &nn::Path, cfg: ResNetConfig, bn: MakeNorm) -> Self {
        let mut c = cfg.width;
        let stem = conv(p / "stem", cfg.in_channels, c, 3, 1);
        let stem_bn = bn(p / "stem_bn", c);
        let mut blocks = Vec::new();
        for i in 0..cfg.stages {
            let cout = if i == 0 { c } else { 2 * c };
            blocks.push(BasicBlock::new(&(p / format!("block{i}")), c, cout, 2, bn));
            c = cout;
        }
        let pool = cfg.pool.max(1);
        let fc = nn::linear(p / "fc", c * pool * pool, cfg.num_classes, Default::default());
        Self { stem, stem_bn, blocks, fc, pool }
    }
}

impl ModuleT for SmallResNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut x = self.stem_bn.forward_t(&self.stem.forward(xs), train).relu();
        for b in &self.blocks {
            x = b.forward_t(&x, train);
        }
        let x = if self.pool == 1 {
            x.mean_dim(&[2i64, 3][..], false, None)
        } else {
            x.adaptive_avg_pool2d([self.pool, self.pool]).flatten(1, -1)
        };
        self.fc.forward(&x)
    }
}

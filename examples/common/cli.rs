//! Command-line flags shared by the examples (clap, flattened into each example's own).
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use tch::Device;
use tch_amp::AmpConfig;

use super::data::{Dataset, DEFAULT_DATA_DIR};

/// Which data, and how much of it.
#[derive(Args, Debug, Clone, serde::Serialize)]
pub struct DataArgs {
    /// Folder with the four IDX files (gzip or plain) of Fashion-MNIST or an MNIST-like set.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    pub data: PathBuf,
    /// Training examples used (a seeded random subset; 0 = all).
    #[arg(long, default_value_t = 0)]
    pub train_size: usize,
    /// Test examples used (the first N; 0 = all).
    #[arg(long, default_value_t = 0)]
    pub test_size: usize,
    /// Seed of the weights, the training subset and the batch order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl DataArgs {
    /// Loads, standardises (training mean and std) and subsets the data set.
    ///
    /// # Errors
    /// A missing or malformed file, named in the message.
    pub fn load(&self) -> Result<Dataset> {
        self.load_with(true)
    }

    /// As [`Self::load`]; `standardize` false keeps pixel values in [0, 1].
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_with(&self, standardize: bool) -> Result<Dataset> {
        let data =
            Dataset::load(&self.data).with_context(|| format!("loading the data set in {}", self.data.display()))?;
        let data = if standardize { data.standardize() } else { data };
        Ok(Dataset {
            train: data.train.subset(self.train_size, self.seed),
            test: data.test.head(self.test_size),
            num_classes: data.num_classes,
        })
    }
}

/// Apex's three `initialize` flags as its examples take them: strings, parsed as Apex parses
/// them (`--keep-batchnorm-fp32 True`, `--loss-scale dynamic` or `--loss-scale 128.0`).
#[derive(Args, Debug, Clone, serde::Serialize)]
pub struct AmpArgs {
    /// Opt level: O0, O1, O2 or O3 (the letter O, then a digit).
    #[arg(long, default_value = "O1")]
    pub opt_level: String,
    /// Override the level's keep_batchnorm_fp32: True, False or None.
    #[arg(long)]
    pub keep_batchnorm_fp32: Option<String>,
    /// Override the level's loss scale: "dynamic" or a number.
    #[arg(long)]
    pub loss_scale: Option<String>,
}

impl AmpArgs {
    /// The `AmpConfig` these flags describe.
    ///
    /// # Errors
    /// What Apex would reject (unknown level, a value that does not parse).
    pub fn config(&self) -> Result<AmpConfig> {
        let mut overrides = Vec::new();
        if let Some(v) = &self.keep_batchnorm_fp32 {
            overrides.push(("keep_batchnorm_fp32", v.as_str()));
        }
        if let Some(v) = &self.loss_scale {
            overrides.push(("loss_scale", v.as_str()));
        }
        Ok(AmpConfig::from_apex(&self.opt_level, &overrides)?)
    }
}

/// `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device, String> {
    let bad = || format!("{s:?}: expected cpu, cuda or cuda:N (N = 0, 1, ...)");
    match s.trim() {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => other.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()).map(Device::Cuda).ok_or_else(bad),
    }
}

/// The device of `--device`, checked to be there.
pub fn device(name: &str) -> Result<Device> {
    let device = parse_device(name).map_err(|e| anyhow::anyhow!("--device {e}"))?;
    if let Device::Cuda(i) = device {
        let count = tch::Cuda::device_count();
        if i as i64 >= count {
            bail!(
                "--device {name}: libtorch sees {count} CUDA device(s) here; use --device cpu, or run on a \
                 machine with a GPU, its driver and a CUDA build of libtorch"
            );
        }
    }
    Ok(device)
}

//! RNNs under the Apex policy on CPU: Apex's tests/L0/run_amp/test_rnn.py. RNN cells over 10
//! steps and whole RNNs give fp16 outputs for fp32 and fp16 inputs, and each input's grad has
//! the input's dtype. The fp32 weights are cast once (cached) and reused at every step.

use crate::common::*;
use tch::nn::{self, RNN};
use tch::{Device, Kind, Tensor};
use tch_amp::cast::CastSettings;
use tch_amp::diagnostics::cast_cache_len;
use tch_amp::CpuKernels;

const H: i64 = 64;
const B: i64 = 16;
const T: usize = 10;

enum Cell {
    Rnn,
    Gru,
    Lstm,
}

fn run_cell_test(cell: Cell) {
    for mode in [CpuKernels::Emulate, CpuKernels::Native] {
        run_cell_test_with(&cell, mode);
    }
}

fn run_cell_test_with(cell: &Cell, mode: CpuKernels) {
    let handle = apex_with(CastSettings::default().cpu_kernels(mode));

    let gates = match cell {
        Cell::Rnn => 1,
        Cell::Gru => 3,
        Cell::Lstm => 4,
    };
    let vs = nn::VarStore::new(Device::Cpu);
    let init = nn::Init::Uniform { lo: -0.125, up: 0.125 };
    let w_ih = vs.root().var("w_ih", &[gates * H, H], init);
    let w_hh = vs.root().var("w_hh", &[gates * H, H], init);
    let b_ih = vs.root().var("b_ih", &[gates * H], init);
    let b_hh = vs.root().var("b_hh", &[gates * H], init);
    for kind in [Kind::Float, Kind::Half] {
        let xs: Vec<Tensor> = (0..T).map(|_| leaf(&[B, H], kind)).collect();
        let zeros = || Tensor::zeros([B, H], (kind, Device::Cpu));
        let mut outputs = Vec::new();
        {
            let _active = on_cpu(&handle);
            let (mut h, mut c) = (zeros(), zeros());
            for x in &xs {
                match cell {
                    Cell::Rnn => h = x.rnn_tanh_cell(&h, &w_ih, &w_hh, Some(&b_ih), Some(&b_hh)),
                    Cell::Gru => h = x.gru_cell(&h, &w_ih, &w_hh, Some(&b_ih), Some(&b_hh)),
                    Cell::Lstm => (h, c) = x.lstm_cell(&[&h, &c], &w_ih, &w_hh, Some(&b_ih), Some(&b_hh)),
                }
                outputs.push(h.shallow_clone());
            }
            // fp32 input leaves are cast to fp16 through the cache; fp16 ones are cast to fp32
            // when the cell's GEMMs are emulated.
            let inputs = if kind == Kind::Float || mode == CpuKernels::Emulate { T } else { 0 };
            assert_eq!(cast_cache_len().unwrap(), 4 + inputs, "4 weights cast once, {inputs} input leaves ({mode:?})");
        }
        for y in &outputs {
            assert_eq!(y.kind(), Kind::Half);
        }
        outputs.last().unwrap().to_kind(Kind::Float).sum(None::<Kind>).backward();
        for x in &xs {
            assert_eq!(x.grad().kind(), kind);
        }
        assert_eq!(w_ih.grad().kind(), Kind::Float);
        assert!(f64::try_from(w_ih.grad().abs().sum(None::<Kind>)).unwrap() > 0.0);
        for v in [&w_ih, &w_hh, &b_ih, &b_hh] {
            let _ = v.grad().zero_();
        }
    }
}

#[test]
fn rnn_cell_is_half() {
    run_cell_test(Cell::Rnn);
}

#[test]
fn gru_cell_is_half() {
    run_cell_test(Cell::Gru);
}

#[test]
fn lstm_cell_is_half() {
    run_cell_test(Cell::Lstm);
}

/// Apex's TestRnns for LSTM and GRU through tch's nn::lstm / nn::gru (aten::lstm / aten::gru),
/// 1 layer, 2 layers, 2 bidirectional layers. Under plain CPU autocast libtorch 2.13 runs
/// nn::lstm through oneDNN in bf16 and fails on CPUs without bf16 support; under the Apex
/// policy the whole LSTM is cast to fp16 and runs on libtorch's own kernels.
#[test]
fn lstm_and_gru_are_half() {
    let handle = apex();
    for (layers, bidirectional) in [(1, false), (2, false), (2, true)] {
        let vs = nn::VarStore::new(Device::Cpu);
        let config = nn::RNNConfig { num_layers: layers, bidirectional, ..Default::default() }; // batch first
        let lstm = nn::lstm(vs.root() / "lstm", H, H, config);
        let gru = nn::gru(vs.root() / "gru", H, H, config);
        for kind in [Kind::Float, Kind::Half] {
            let x = leaf(&[B, T as i64, H], kind);
            let (lstm_out, gru_out) = {
                let _active = on_cpu(&handle);
                (lstm.seq(&x).0, gru.seq(&x).0)
            };
            assert_eq!(lstm_out.kind(), Kind::Half);
            assert_eq!(gru_out.kind(), Kind::Half);
            (lstm_out.select(1, -1).to_kind(Kind::Float).sum(None::<Kind>)
                + gru_out.select(1, -1).to_kind(Kind::Float).sum(None::<Kind>))
            .backward();
            assert_eq!(x.grad().kind(), kind);
        }
    }
}

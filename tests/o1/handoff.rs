//! O1's output handoff (src/shim/round_through.cpp): an emulated op's fp32 result, rounded in
//! place while its fp16 tensor is written, serves the next conversion of that tensor to fp32,
//! and in backward the conversion's fp32 gradient, rounded in place, serves the output's
//! conversion back. Everything must keep the bits of the conversions written out by hand,
//! whichever path each tensor took; the per-thread counters show which paths were taken.
use super::weight_copies::{det, same_bits};
use crate::common::*;
use tch::{Device, Kind, Tensor};
use tch_amp::diagnostics::{o1_output_handoffs, set_o1_output_handoff, O1OutputHandoffs};
use tch_amp::{CastSettings, CpuKernels};

/// The leaves of the network below: an input, two fp32 side inputs, four linear layers.
struct Leaves {
    x: Tensor,
    r: Tensor,
    s: Tensor,
    layers: Vec<(Tensor, Tensor)>,
}

impl Leaves {
    fn new() -> Self {
        let leaf = |shape: &[i64], salt: f64, scale: f64| (det(shape, salt) * scale).set_requires_grad(true);
        let layers = [(24, 16), (24, 24), (24, 24), (24, 24)]
            .iter()
            .enumerate()
            .map(|(i, &(o, n))| (leaf(&[o, n], 1.1 + i as f64, 0.3), leaf(&[o], 2.0 + i as f64, 0.1)))
            .collect();
        Self { x: leaf(&[9, 16], 0.3, 1.0), r: leaf(&[9, 24], 0.5, 1.0), s: leaf(&[9, 24], 0.7, 1.0), layers }
    }

    fn all(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.x, &self.r, &self.s];
        for (w, b) in &self.layers {
            v.extend([w, b]);
        }
        v
    }

    /// The network. Under O1 (`by_hand` false) the policy makes the casts; `by_hand` writes
    /// them out: a linear layer in fp32 from fp16-rounded inputs with its output rounded to
    /// fp16, an fp32 op or an add with an fp32 tensor converting the fp16 tensor first.
    fn forward(&self, by_hand: bool) -> Tensor {
        let round = |t: &Tensor| t.to_kind(Kind::Half).to_kind(Kind::Float);
        let lin = |t: &Tensor, (w, b): &(Tensor, Tensor)| {
            if by_hand {
                round(t).linear(&round(w), Some(round(b))).to_kind(Kind::Half)
            } else {
                t.linear(w, Some(b))
            }
        };
        let fp32 = |t: &Tensor| if by_hand { t.to_kind(Kind::Float) } else { t.shallow_clone() };
        let h1 = lin(&self.x, &self.layers[0]);
        let a = fp32(&h1).gelu("none"); // GELU's input: handed over, forward and backward
        let h2 = lin(&a, &self.layers[1]);
        let y = &self.r + fp32(&h2); // handed over; add's gradient is shared, so not in backward
        let h3 = lin(&y, &self.layers[2]);
        // Two conversions of h3: the first is handed over, the second converts; in backward
        // their gradients add up before h3's, so nothing is handed on there.
        let g3 = fp32(&h3).gelu("none") + (&self.s + fp32(&h3));
        let mut h4 = lin(&y, &self.layers[3]);
        let _ = h4.g_mul_scalar_(2.0); // changed in place since: converted, not handed over
        g3 + fp32(&h4).gelu("none") + y
    }
}

/// The gradient fed to the output.
fn upstream() -> Tensor {
    det(&[9, 24], 0.9) * 4.0
}

/// Forward and backward under O1 (emulated fp16): the output, every leaf's gradient, and the
/// handoffs counted on this thread meanwhile.
fn run_o1(leaves: &Leaves) -> (Tensor, Vec<Tensor>, (u64, u64)) {
    let handle = apex_with(CastSettings::default().cpu_kernels(CpuKernels::Emulate));
    let before: O1OutputHandoffs = o1_output_handoffs().unwrap();
    let out = handle.run(Device::Cpu, || leaves.forward(false)).unwrap();
    let grads = Tensor::run_backward(&[(&out * upstream()).sum(Kind::Float)], &leaves.all(), false, false);
    let now = o1_output_handoffs().unwrap();
    (out, grads, (now.forward - before.forward, now.backward - before.backward))
}

#[test]
fn emulated_outputs_hand_their_rounded_values_to_the_next_conversion_with_the_conversions_bits() {
    let leaves = Leaves::new();
    let expected_out = leaves.forward(true);
    assert_eq!(expected_out.kind(), Kind::Float);
    let expected = Tensor::run_backward(&[(&expected_out * upstream()).sum(Kind::Float)], &leaves.all(), false, false);
    // Finite everywhere (an overflow would make every path's NaNs alike), and h1's gradient is
    // one that fp16 rounds: handing on its fp32 gradient unrounded fails this test.
    for e in &expected {
        assert_eq!(e.isfinite().all().int64_value(&[]), 1);
    }
    let (out, grads, handed) = run_o1(&leaves);
    assert_eq!(handed, (3, 1), "(forward, backward) handoffs");
    assert!(same_bits(&out, &expected_out), "the output");
    for (i, (g, e)) in grads.iter().zip(&expected).enumerate() {
        assert!(same_bits(g, e), "gradient {i}");
    }
    // Off: the plain conversions, the same bits.
    let was = set_o1_output_handoff(false).unwrap();
    let (out_off, grads_off, handed_off) = run_o1(&leaves);
    set_o1_output_handoff(was).unwrap();
    assert_eq!(handed_off, (0, 0));
    assert!(same_bits(&out_off, &expected_out));
    for (g, e) in grads_off.iter().zip(&expected) {
        assert!(same_bits(g, e));
    }
    // Without a graph (evaluation) the forward hands over as well, with the same values.
    let handle = apex_with(CastSettings::default().cpu_kernels(CpuKernels::Emulate));
    let before = o1_output_handoffs().unwrap().forward;
    let eval = tch::no_grad(|| handle.run(Device::Cpu, || leaves.forward(false)).unwrap());
    assert_eq!(o1_output_handoffs().unwrap().forward - before, 3);
    assert!(same_bits(&eval, &expected_out));
}

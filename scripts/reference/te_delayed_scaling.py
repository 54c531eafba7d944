"""Transformer Engine's delayed scaling (DelayedScaling recipe) on CPU, written from TE's
documentation and source (NVIDIA/TransformerEngine: transformer_engine/common/recipe/__init__.py,
common/recipe/delayed_scaling.cu `amax_and_scale_update` / `kernel_bulk`,
pytorch/quantization.py `autocast_enter`/`autocast_exit`, `reduce_and_update_fp8_tensors`,
pytorch/module/linear.py), for tests/float8.rs. TE itself needs CUDA; the algorithm is
reproduced here with plain Python floats (numpy.float32 for TE's fp32 arithmetic) so that it is
independent of tch-amp's tensor formulation.

Per tensor (input, weight: TE's `scaling_fwd`; grad_output: `scaling_bwd`) TE keeps an amax
history of `amax_history_len` fp32 values (slot 0 is the current step) and a scale (1 at first):
- a cast to fp8 uses the scale as it is, `saturate(x * scale)`, and adds the tensor's amax to
  slot 0 (atomicMax in the cast kernel; the amax reduction uses fmaxf, which skips NaN);
- after the forward (autocast exit, only with grad enabled) the input and weight states are
  updated, after the backward the grad_output state: if slot 0 is not 0, the history rolls
  (new = [0, h[2], ..., h[L-1], h[0]]) and amax = max of the old history (`max`) or h[0]
  (`most_recent`); if slot 0 is 0 nothing moves and amax = 0. Then
  scale = (fp8_max * 2^-margin) / amax when amax is finite and > 0, else the old scale; an
  infinite scale becomes fp32's max.
The GEMMs use the fp8 tensors of the forward (TE saves them) with inverse scales; on CPU they
run through torch._scaled_mm with the flags of torchao's Float8LinearConfig (fast accumulation
for the output GEMM), row-major first operand and column-major second, as tch-amp does; the
bias is added after the GEMM in the output dtype (TE fuses it into the GEMM epilogue; tch-amp
follows torchao's Float8Linear there).
"""

import math

import numpy as np
import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
F32_MAX = np.float32(np.finfo(np.float32).max)


class Recipe:
    def __init__(self, margin=0, fp8_format="HYBRID", amax_history_len=1024, amax_compute_algo="max"):
        assert fp8_format in ("HYBRID", "E4M3") and amax_compute_algo in ("max", "most_recent")
        self.margin = margin
        self.fwd = E4M3
        self.bwd = E5M2 if fp8_format == "HYBRID" else E4M3
        self.len = amax_history_len
        self.algo = amax_compute_algo


class TensorState:
    """One tensor's amax history and scale, as Python floats held in numpy.float32."""

    def __init__(self, length, device):
        self.device = device
        self.history = [np.float32(0.0)] * length
        self.scale = np.float32(1.0)

    def record(self, x):
        a = x.detach().abs().float()
        a = torch.where(torch.isnan(a), torch.zeros_like(a), a)  # fmaxf skips NaN
        amax = np.float32(a.max().item())
        self.history[0] = max(self.history[0], amax)

    def update(self, dtype, recipe):
        h = self.history
        n = len(h)
        last = h[0]
        amax = np.float32(0.0)
        if last != 0.0:
            rolled = []
            for i in range(n):
                a = h[i + 1] if i < n - 1 else last
                amax = np.float32(max(amax, a))
                rolled.append(a if i > 0 else np.float32(0.0))
            self.history = rolled
            if recipe.algo == "most_recent":
                amax = last
        scaled_max = np.float32(FP8_MAX[dtype] * math.pow(2.0, -recipe.margin))
        with np.errstate(over="ignore", divide="ignore"):
            scale = scaled_max / amax if (np.isfinite(amax) and amax > 0) else self.scale
        if np.isinf(scale):
            scale = F32_MAX
        self.scale = np.float32(scale)

    def scale_tensor(self):
        return torch.tensor(float(self.scale), dtype=torch.float32, device=self.device)

    def history_tensor(self):
        return torch.tensor([float(v) for v in self.history], dtype=torch.float32, device=self.device)


def quantize(x, scale, dtype):
    m = FP8_MAX[dtype]
    return (x.to(torch.float32) * scale).clamp(-m, m).to(dtype)


def scaled_mm(a, a_scale, b, b_scale, out_dtype, fast_accum):
    """a @ b with tensorwise scales (the factors that took them to fp8)."""
    if not (a.stride(0) > a.stride(1) and a.stride(1) == 1):
        a = a.contiguous()
    if b.stride(0) > b.stride(1) and b.stride(1) == 1:
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class _DelayedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, layer, grad_enabled):
        recipe = layer.recipe
        si, sw = layer.state["input"].scale_tensor(), layer.state["weight"].scale_tensor()
        xq, wq = quantize(x2, si, recipe.fwd), quantize(w, sw, recipe.fwd)
        layer.state["input"].record(x2)
        layer.state["weight"].record(w)
        dev = x2.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x2.dtype
        y = scaled_mm(xq, si, wq.t(), sw, out_dtype, True)
        if grad_enabled:  # autocast_exit updates the forward states (with grad enabled only)
            layer.state["input"].update(recipe.fwd, recipe)
            layer.state["weight"].update(recipe.fwd, recipe)
        ctx.save_for_backward(xq, si, wq, sw)
        ctx.layer = layer
        layer.last.update(input=si, weight=sw)
        return y

    @staticmethod
    def backward(ctx, go):
        layer = ctx.layer
        recipe = layer.recipe
        xq, si, wq, sw = ctx.saved_tensors
        st = layer.state["grad_output"]
        sg = st.scale_tensor()
        gq = quantize(go, sg, recipe.bwd)
        st.record(go)
        gi = scaled_mm(gq, sg, wq, sw, go.dtype, False)
        gw = scaled_mm(gq.t(), sg, xq, si, go.dtype, False)
        st.update(recipe.bwd, recipe)  # the backward's reduce_and_update_fp8_tensors
        layer.last.update(grad_output=sg)
        return gi, gw, None, None


class DelayedLinear(torch.nn.Linear):
    """nn.Linear with TE's delayed scaling for its three GEMMs."""

    def __init__(self, linear, recipe):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight = linear.weight
        self.bias = linear.bias
        self.recipe = recipe
        self.state = {r: TensorState(recipe.len, linear.weight.device) for r in ("input", "weight", "grad_output")}
        self.last = {}

    def forward(self, x):
        if x.is_cuda and torch.is_autocast_enabled("cuda"):  # TE's activation dtype
            x = x.to(torch.get_autocast_dtype("cuda"))
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        y = _DelayedMatmul.apply(x2, self.weight, self, torch.is_grad_enabled()).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

"""The precision doctor's statistics of one layer, computed with torch hooks (tests/doctor/
reference.rs compares them with `tch_amp::doctor` on the same weights and batch).

    $TCH_AMP_PYTHON scripts/reference/doctor_stats.py IN.pt OUT.json LAYER LOSS_SCALE

IN.pt (written by the test with tch_amp::torch_io): the variables of tests/doctor/models.rs's
ThreeLayers (`fc1.weight`, ..., `head.bias`, fp32), the batch `x`, `y`. The model is
fc1 -> relu -> big -> relu -> head, loss = mse(out.float(), y).

Two runs, one thread, as the doctor runs them:
- fp32: everything in fp32, backward of the loss;
- O1 fp16 with tch-amp's CPU emulation (its documented contract: each linear computes in fp32 on
  the fp16-rounded input, weight and bias, and rounds its output once to fp16; the backward goes
  through the same casts), relu in fp16, the loss in fp32, backward of loss * LOSS_SCALE.
A forward hook takes LAYER's output, a tensor hook the gradient of that output. OUT.json gets,
for forward and backward, the doctor's TensorStats fields (tch_amp::doctor::TensorStats and
Fp32Comparison; fp16 thresholds from the rounding rules: overflow at >= 65520, zero at <= 2^-25,
subnormal below 2^-14 - 2^-25).
"""
import json
import sys

import torch
import torch.nn.functional as F

torch.set_num_threads(1)

MAX_NORMAL_BELOW = 65504.0
OVERFLOW_AT = 65520.0
ZERO_AT = 2.0 ** -25
MIN_NORMAL = 2.0 ** -14
SUBNORMAL_BELOW = MIN_NORMAL - 2.0 ** -25


def stats(target, ref, scale):
    """The doctor's statistics of `target` (as held, gradients at `scale`) against the fp32 run's
    `ref` (unscaled)."""
    x = target.float()
    a = x.abs()
    finite = a.isfinite()
    a0 = a.masked_fill(~finite, 0.0)
    nz = a0[a0 > 0]
    out = {
        "dtype": "fp16" if target.dtype == torch.float16 else "fp32",
        "numel": target.numel(),
        "max_abs": a0.max().item(),
        "min_nonzero_abs": nz.min().item() if nz.numel() else None,
        "non_finite": int((~finite).sum()),
        "zeros": int((x == 0).sum()),
        "subnormal": int(((a0 > 0) & (a0 < MIN_NORMAL)).sum()) if target.dtype == torch.float16 else 0,
    }
    ra = ref.float().abs()
    ra0 = ra.masked_fill(~ra.isfinite(), 0.0)
    nonzero = ra0 > 0
    v = ra0 * scale
    rnz = ra0[nonzero]
    xd = x.double() / scale
    rd = ref.double()
    err = ((xd - rd) ** 2).sum().item()
    norm = (rd ** 2).sum().item()
    out["fp32"] = {
        "max_abs": ra0.max().item() * scale,
        "min_nonzero_abs": rnz.min().item() * scale if rnz.numel() else None,
        "nonzero": int(nonzero.sum()),
        "non_finite": int((~ra.isfinite()).sum()),
        "overflow": int((v >= OVERFLOW_AT).sum()),
        "underflow": int((nonzero & (v <= ZERO_AT)).sum()),
        "subnormal": int(((v > ZERO_AT) & (v < SUBNORMAL_BELOW)).sum()),
        "flushed": int(((x == 0) & nonzero & (v < MIN_NORMAL)).sum()),
        "relative_error": (err / norm) ** 0.5 if norm > 0 else None,
    }
    return out


def lin16(x16, w, b):
    """tch-amp's emulated fp16 linear: fp32 compute of the rounded operands, output rounded once."""
    return F.linear(x16.float(), w.half().float(), b.half().float()).half()


def run(params, x, y, layer, fp16, scale):
    seen = {}

    def keep(name, out):
        if name == layer:
            seen["out"] = out.detach().clone()
            out.register_hook(lambda g: seen.__setitem__("grad", g.detach().clone()))
        return out

    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    if fp16:
        h = keep("fc1", lin16(x.half(), p["fc1.weight"], p["fc1.bias"])).relu()
        h = keep("big", lin16(h, p["big.weight"], p["big.bias"])).relu()
        out = keep("head", lin16(h, p["head.weight"], p["head.bias"]))
    else:
        h = keep("fc1", F.linear(x, p["fc1.weight"], p["fc1.bias"])).relu()
        h = keep("big", F.linear(h, p["big.weight"], p["big.bias"])).relu()
        out = keep("head", F.linear(h, p["head.weight"], p["head.bias"]))
    loss = F.mse_loss(out.float(), y)
    (loss.float() * scale).backward()
    return seen


def main():
    src, dst, layer, scale = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    data = torch.load(src, weights_only=True)
    params = {k: v for k, v in data.items() if k not in ("x", "y")}
    ref = run(params, data["x"], data["y"], layer, False, 1.0)
    tgt = run(params, data["x"], data["y"], layer, True, scale)
    result = {
        "forward": stats(tgt["out"], ref["out"], 1.0),
        "backward": stats(tgt["grad"], ref["grad"], scale),
    }
    with open(dst, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

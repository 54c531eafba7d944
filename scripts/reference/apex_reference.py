"""A step-by-step reference of Apex amp's algorithm (NVIDIA/apex at e13873de, apex/amp), written
with plain torch (PyTorch 2.13, CPU) for tests/apex_reference.rs. It is not Apex: it does by
hand, op by op, what Apex's documented algorithm does, so that tch-amp can be compared with it
bit for bit.

Opt levels (see /work/shared/REFERENCE.md and apex/amp/{frontend,_initialize,handle,scaler}.py):
- O0: fp32 model, plain optimizer, loss scale 1.0 (the loss goes to backward unscaled).
- O1: fp32 model; Apex's function casts: linear/conv/matmul inputs and weights to fp16 (FP16
  list), softmax/gelu/layer_norm/cross_entropy inputs to fp32 (FP32 list), `a + b` with mixed
  types promoted to the widest (CASTS list), everything else (batch_norm, relu, max_pool2d,
  mean, reshape, `/ number`) runs in its inputs' dtypes: batch norm gets the fp16 activation
  and the module's fp32 weight, bias and running stats (CPU batch_norm accepts that mix and
  returns fp16). Dynamic loss scale; fp32 grads unscaled in place; the model output stays fp16.
- O2: model.half() except affine batch norms (keep_batchnorm_fp32=True), inputs cast to fp16
  and outputs to fp32 by the patched forward; fp32 master copies of the fp16 parameters (fp32
  batch-norm parameters are their own masters) are what the optimizer steps. Backward of
  loss.float() * scale; each fp16 model grad is copied into an fp32 master grad and multiplied
  by 1/scale (fp32 grads in place); an inf/NaN in any grad skips the step and halves the scale;
  2000 clean steps double it (not reached here); after a step the masters are copied into the
  model.
- O2 with keep_batchnorm_fp32=False: batch norm parameters and running stats fp16 as well.
- O2 with a static loss scale of 128: never checked, never skipped.
- O3: model.half() including batch norm, loss scale 1.0 (no unscale, no check), the user's
  optimizer on the fp16 parameters with fp16 state ("O3"); "O3_fp32_state" is tch-amp's current
  O3 update instead (each step: an fp32 copy of every fp16 parameter and its grad is updated
  with fp32 optimizer state, then rounded into the parameter; issue 10 item 2).

Scenarios:
- mlp: Linear(16,32)-BatchNorm1d(32)-ReLU-Linear(32,10), cross entropy, SGD(lr=0.1,
  momentum=0.9), batch 32, 32 steps.
- cnn: Conv2d(3,8,3,pad 1)-BatchNorm2d(8)-ReLU-MaxPool2d(2)-Conv2d(8,16,3,pad 1)-ReLU-global
  average pool (mean over H, W)-Linear(16,10), cross entropy, Adam(lr=1e-3), batch 8 of 3x8x8,
  16 steps.
- transformer: one pre-LN encoder block, d=16, 2 heads, MLP 64 with GELU, residuals, then mean
  over the sequence and Linear(16,10), cross entropy, SGD(lr=0.05, momentum=0.9), batch 4 of
  sequence 8, 16 steps.
In runs with a dynamic loss scale, the loss given to scale_loss is multiplied by 2^15 at two
steps per scenario (INJECT): the scaled fp16 gradients overflow to inf, so those steps are
skipped and the scale halves.

Gradient accumulation (train_accum), two scenarios of the MLP above with SGD(lr=0.1,
momentum=0.9) and two losses with a scaler each (num_losses=2); each step both losses go backward
on each of two micro-batches, the first micro-batch's passes with delay_unscale=True, then one
step. "accum": 12 steps, micro-batches of 16, one forward per loss and micro-batch, both losses
cross entropy. "accum_shared": 16 steps, micro-batches of 32, fc2 32->4, one forward per
micro-batch and both losses from it (loss 0 = cross entropy, backward with retain_graph; loss 1 =
0.1 * (out ** 2).mean()), then clip_grad_norm_(amp.master_params(optimizer), 1.0) before the step.
Apex's path as it runs without amp_C: a delayed exit touches no scaler; the first non-delayed
entry sets nothing aside (params_have_scaled_gradients: the gradients are still scaled), so loss
0's backward accumulates on top of micro-batch 0's gradients (under O2 in the fp16 model
gradients) and its exit unscales the whole buffer, loss 1's delayed gradient included, by 1/S0;
loss 1's entry sets the gradients aside (under O2 the fp32 master gradients hold them) and its exit
makes `a * new + b * stashed` with a = 1/S1, b = 1 (two rounded fp32 products, then a rounded add);
an overflow hidden in a delayed pass is caught by scaler 0. "accum" runs at O1 and O2, without and
with overflows injected into delayed passes (the loss times 2^15), and with max_loss_scale=3000
(both scales start at 3000, so 1/scale is inexact). "accum_shared" runs at O1 and O2, without and
with loss 1 of step 5 multiplied by 1e6 in the last micro-batch (scaler 1 finds the overflow in the
stash path) or in the delayed one (scaler 0 finds it). Each run also "+emulated". Checked bit for
bit against Apex e13873de's own amp on this script's data (its Python paths on CPU, with Apex's
CUDA type checks answered for CPU tensors, libtorch's native fp16 kernels on both sides): every
run without "+emulated".

Every run except O0 is also made a second time, "<run>+emulated", with tch-amp's CPU emulation
contract for the GEMMs and convolutions (linear, conv2d, matmul: fp32 compute of the rounded
fp16 inputs, output rounded once) in place of libtorch's native fp16 CPU kernels.

Output: one safetensors file (to stdout with `--out -`): `<scenario>/init/<var>` (fp32 initial
variables, tch VarStore names), `<scenario>/x` [steps, ...], `<scenario>/y` [steps, batch], and
per run `<scenario>/<run>/loss` [steps] fp32, `/scale` [steps] fp64 (the scale of that step's
scale_loss), `/skipped` [steps] uint8, `/final/<var>` (every model variable at the end, in its
model dtype) and `/master/<var>` (fp32 masters of fp16 parameters). Metadata "scenarios": JSON
with each scenario's steps, injection steps, optimizer and runs. The accumulation scenarios write
the same under `accum/` and `accum_shared/` with `loss` and `scale` of shape [steps,
micro-batches, losses] (one per scale_loss call), x and y with a loss axis after the micro-batch
one where each loss has its own forward, and, where the scenario clips, `norm` [steps] fp32 (the
norm clip_grad_norm_ returned; NaN at skipped steps, whose gradients the skip discards); metadata
"accumulation" has per scenario its losses, shared_forward, clip, inject_factor and runs (level,
max_loss_scale, injections as [step, micro-batch, loss id]).

    $TCH_AMP_PYTHON scripts/reference/apex_reference.py --threads 1 --out ref.safetensors
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save

GROWTH_INTERVAL = 2000
INITIAL_SCALE = 2.0**16
MAX_SCALE = 2.0**24
INJECT_FACTOR = 2.0**15

RUNS = {
    # name: (level, cast_model_type, keep_batchnorm_fp32, master_weights, loss_scale, fp32 optimizer state)
    "O0": ("O0", None, None, False, 1.0, False),
    "O1": ("O1", None, None, False, "dynamic", False),
    "O2": ("O2", torch.float16, True, True, "dynamic", False),
    "O2_keep_bn_fp16": ("O2", torch.float16, False, True, "dynamic", False),
    "O2_static128": ("O2", torch.float16, True, True, 128.0, False),
    "O3": ("O3", torch.float16, False, False, 1.0, False),
    "O3_fp32_state": ("O3", torch.float16, False, False, 1.0, True),
}


# ---- Apex's O1 function casts, applied by hand -------------------------------------------------
def to_half(t):
    return t.half() if t is not None and t.is_floating_point() and t.dtype != torch.float16 else t


def to_float(t):
    return t.float() if t is not None and t.is_floating_point() and t.dtype == torch.float16 else t


def emulated(f, *args):
    """tch-amp's CPU emulation contract (opt_levels/emulate_cpu.toml): when every floating input
    is the same 16-bit type D, the op runs in fp32 on exact fp32 copies of the inputs and its
    output is rounded once to D; autograd records the casts, so backward has the same rounding
    points. Otherwise the op runs as it is."""
    floats = [t for t in args if t is not None and t.is_floating_point()]
    low = floats[0].dtype if floats else None
    if low not in (torch.float16, torch.bfloat16) or any(t.dtype != low for t in floats):
        return f(*args)
    return f(*[t.float() if t is not None else None for t in args]).to(low)


class Ops:
    """The ops the models use; under O1 each applies Apex's cast for its list. With `emulate`,
    the GEMMs and convolutions follow tch-amp's CPU emulation contract instead of running
    libtorch's native fp16 kernels."""

    def __init__(self, o1, emulate=False):
        self.o1 = o1
        self.emulate = emulate

    def _gemm(self, f, *args):
        return emulated(f, *args) if self.emulate else f(*args)

    def linear(self, x, w, b):  # FP16_FUNCS
        if self.o1:
            x, w, b = to_half(x), to_half(w), to_half(b)
        return self._gemm(F.linear, x, w, b)

    def conv2d(self, x, w, b, padding):  # FP16_FUNCS
        if self.o1:
            x, w, b = to_half(x), to_half(w), to_half(b)
        return self._gemm(lambda x_, w_, b_: F.conv2d(x_, w_, b_, 1, padding), x, w, b)

    def matmul(self, a, b):  # FP16_FUNCS
        if self.o1:
            a, b = to_half(a), to_half(b)
        return self._gemm(torch.matmul, a, b)

    def softmax(self, x):  # FP32_FUNCS
        return F.softmax(to_float(x) if self.o1 else x, dim=-1)

    def gelu(self, x):  # FP32_FUNCS
        return F.gelu(to_float(x) if self.o1 else x)

    def layer_norm(self, x, w, b):  # FP32_FUNCS
        if self.o1:
            x, w, b = to_float(x), to_float(w), to_float(b)
        return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)

    def add(self, a, b):  # CASTS: promote to the widest type
        if self.o1 and a.dtype != b.dtype:
            a, b = to_float(a), to_float(b)
        return a + b

    def cross_entropy(self, logits, y):  # FP32_FUNCS
        return F.cross_entropy(to_float(logits) if self.o1 else logits, y)

    def pow(self, x, e):  # FP32_FUNCS (Tensor.__pow__)
        return (to_float(x) if self.o1 else x) ** e


def batch_norm(P, name, x):
    # In no list: the input's dtype with the module's parameters as they are.
    return F.batch_norm(x, P[name + ".running_mean"], P[name + ".running_var"], P[name + ".weight"],
                        P[name + ".bias"], True, 0.1, 1e-5)


# ---- Models -----------------------------------------------------------------------------------
def mlp_init(g, classes=10):
    return {
        "fc1.weight": torch.randn(32, 16, generator=g) / 4.0,
        "fc1.bias": torch.randn(32, generator=g) * 0.1,
        "bn1.weight": 1.0 + 0.1 * torch.randn(32, generator=g),
        "bn1.bias": 0.1 * torch.randn(32, generator=g),
        "bn1.running_mean": torch.zeros(32),
        "bn1.running_var": torch.ones(32),
        "fc2.weight": torch.randn(classes, 32, generator=g) / math.sqrt(32),
        "fc2.bias": torch.randn(classes, generator=g) * 0.1,
    }


def mlp_forward(P, x, ops):
    h = ops.linear(x, P["fc1.weight"], P["fc1.bias"])
    h = F.relu(batch_norm(P, "bn1", h))
    return ops.linear(h, P["fc2.weight"], P["fc2.bias"])


def cnn_init(g):
    return {
        "conv1.weight": torch.randn(8, 3, 3, 3, generator=g) / math.sqrt(27),
        "conv1.bias": torch.randn(8, generator=g) * 0.1,
        "bn1.weight": 1.0 + 0.1 * torch.randn(8, generator=g),
        "bn1.bias": 0.1 * torch.randn(8, generator=g),
        "bn1.running_mean": torch.zeros(8),
        "bn1.running_var": torch.ones(8),
        "conv2.weight": torch.randn(16, 8, 3, 3, generator=g) / math.sqrt(72),
        "conv2.bias": torch.randn(16, generator=g) * 0.1,
        "fc.weight": torch.randn(10, 16, generator=g) / 4.0,
        "fc.bias": torch.randn(10, generator=g) * 0.1,
    }


def cnn_forward(P, x, ops):
    h = ops.conv2d(x, P["conv1.weight"], P["conv1.bias"], 1)
    h = F.relu(batch_norm(P, "bn1", h))
    h = F.max_pool2d(h, [2, 2], [2, 2], [0, 0], [1, 1], False)
    h = F.relu(ops.conv2d(h, P["conv2.weight"], P["conv2.bias"], 1))
    h = h.mean(dim=(2, 3))
    return ops.linear(h, P["fc.weight"], P["fc.bias"])


D, HEADS, SEQ, BATCH_T, HIDDEN = 16, 2, 8, 4, 64


def transformer_init(g):
    P = {}
    for ln in ("ln1", "ln2"):
        P[ln + ".weight"] = 1.0 + 0.1 * torch.randn(D, generator=g)
        P[ln + ".bias"] = 0.1 * torch.randn(D, generator=g)
    for name, (o, i) in {"q": (D, D), "k": (D, D), "v": (D, D), "proj": (D, D), "fc1": (HIDDEN, D),
                         "fc2": (D, HIDDEN), "head": (10, D)}.items():
        P[name + ".weight"] = torch.randn(o, i, generator=g) / math.sqrt(i)
        P[name + ".bias"] = torch.randn(o, generator=g) * 0.1
    return P


def transformer_forward(P, x, ops):
    b, t, d = x.shape
    dh = d // HEADS
    h = ops.layer_norm(x, P["ln1.weight"], P["ln1.bias"])

    def heads(name):
        return ops.linear(h, P[name + ".weight"], P[name + ".bias"]).reshape(b, t, HEADS, dh).transpose(1, 2)

    q, k, v = heads("q"), heads("k"), heads("v")
    scores = ops.matmul(q, k.transpose(-2, -1)) / math.sqrt(dh)
    attn = ops.softmax(scores)
    o = ops.matmul(attn, v).transpose(1, 2).reshape(b, t, d)
    x = ops.add(x, ops.linear(o, P["proj.weight"], P["proj.bias"]))
    h = ops.layer_norm(x, P["ln2.weight"], P["ln2.bias"])
    h = ops.linear(ops.gelu(ops.linear(h, P["fc1.weight"], P["fc1.bias"])), P["fc2.weight"], P["fc2.bias"])
    x = ops.add(x, h)
    return ops.linear(x.mean(1), P["head.weight"], P["head.bias"])


SCENARIOS = {
    "mlp": dict(init=mlp_init, forward=mlp_forward, steps=32, inject=[5, 17], x=[32, 16], classes=10,
                optimizer=("SGD", dict(lr=0.1, momentum=0.9))),
    "cnn": dict(init=cnn_init, forward=cnn_forward, steps=16, inject=[4, 11], x=[8, 3, 8, 8], classes=10,
                optimizer=("Adam", dict(lr=1e-3))),
    "transformer": dict(init=transformer_init, forward=transformer_forward, steps=16, inject=[3, 9],
                        x=[BATCH_T, SEQ, D], classes=10, optimizer=("SGD", dict(lr=0.05, momentum=0.9))),
}


def is_bn(name):
    return name.startswith("bn")


def is_param(name):
    return not name.endswith(("running_mean", "running_var"))


# ---- One training run, Apex's algorithm -------------------------------------------------------
def train(sc, init, xs, ys, run, emulate=False):
    level, cast_type, keep_bn, masters_on, loss_scale, fp32_state = RUNS[run]
    # Model variables: O2/O3 cast (every module except affine batch norm under keep_bn).
    P = {}
    for n, t in init.items():
        t = t.clone()
        if cast_type is not None and not (keep_bn and is_bn(n)):
            t = t.to(cast_type)
        P[n] = t.requires_grad_(is_param(n))
    params = [n for n in P if is_param(n)]
    # Masters: fp32 clones of the fp16 parameters; fp32 parameters are their own masters.
    if masters_on:
        stepped = {n: (P[n].detach().clone().float().requires_grad_(True) if P[n].dtype == torch.float16 else P[n])
                   for n in params}
    elif fp32_state:
        stepped = {n: torch.zeros(P[n].shape, dtype=torch.float32, requires_grad=True) for n in params}
    else:
        stepped = {n: P[n] for n in params}
    kind, kw = sc["optimizer"]
    opt = getattr(torch.optim, kind)([stepped[n] for n in params], **kw)
    ops = Ops(level == "O1", emulate)
    dynamic = loss_scale == "dynamic"
    scale = INITIAL_SCALE if dynamic else float(loss_scale)
    unskipped = 0
    losses, scales, skipped = [], [], []
    for step in range(sc["steps"]):
        for n in params:
            P[n].grad = None
            stepped[n].grad = None
        x = xs[step]
        if cast_type is not None:
            x = x.to(cast_type)  # patched forward: floating inputs to the model's type
        out = sc["forward"](P, x, ops)
        if cast_type is not None:
            out = out.float()  # ... and outputs to fp32
        loss = ops.cross_entropy(out, ys[step])
        losses.append(loss.detach().float().clone())
        scales.append(scale)
        user_loss = loss * INJECT_FACTOR if dynamic and step in sc["inject"] else loss
        if not masters_on and not dynamic and scale == 1.0:
            # scale_loss yields loss.float(): no unscale, no check.
            user_loss.float().backward()
            overflow = False
        else:
            (user_loss.float() * scale).backward()
            overflow = False
            with torch.no_grad():
                for n in params:
                    g = P[n].grad
                    if g is None:
                        continue
                    if not bool(torch.isfinite(g).all()):
                        overflow = True
                    if stepped[n] is P[n]:
                        g.mul_(1.0 / scale)  # in place
                    else:
                        mg = torch.empty_like(stepped[n])
                        mg.copy_(g)  # fp16 model grad into the fp32 master grad
                        mg.mul_(1.0 / scale)
                        stepped[n].grad = mg
            if dynamic:
                if overflow:
                    scale = scale / 2.0
                    unskipped = 0
                else:
                    unskipped += 1
                    if unskipped == GROWTH_INTERVAL:
                        scale = min(MAX_SCALE, scale * 2.0)
                        unskipped = 0
            else:
                overflow = False
        skipped.append(1 if overflow else 0)
        if overflow:
            continue
        if fp32_state:
            with torch.no_grad():
                for n in params:
                    stepped[n].copy_(P[n].float())
                    stepped[n].grad = P[n].grad.float()
        opt.step()
        if masters_on or fp32_state:
            with torch.no_grad():
                for n in params:
                    if stepped[n] is not P[n]:
                        P[n].copy_(stepped[n])
    result = {
        "loss": torch.stack(losses),
        "scale": torch.tensor(scales, dtype=torch.float64),
        "skipped": torch.tensor(skipped, dtype=torch.uint8),
    }
    for n, t in P.items():
        result["final/" + n] = t.detach().clone()
    if masters_on:
        for n in params:
            if stepped[n] is not P[n]:
                result["master/" + n] = stepped[n].detach().clone()
    return result


# ---- Gradient accumulation over two losses and two micro-batches --------------------------------
# Apex's accumulation path (apex/amp/{handle,scaler,_process_optimizer}.py at e13873de) as it runs
# on CPU without amp_C (the Python fallbacks): two losses, each with its own scaler (num_losses=2),
# both backward on each of two micro-batches; the first micro-batch's passes use
# delay_unscale=True, then one optimizer step. Injections are (step, micro-batch, loss id): that
# scale_loss gets the loss multiplied by the scenario's inject_factor.
ACCUM_INJECT = [(2, 0, 1), (6, 0, 0)]
ACCUM_RUNS = {
    # name: (level, max_loss_scale, injections). A max_loss_scale of 3000 starts both scalers at
    # 3000, so that 1/scale is inexact and the order and rounding of the unscale arithmetic shows.
    "O1": ("O1", MAX_SCALE, []),
    "O2": ("O2", MAX_SCALE, []),
    "O1_inject": ("O1", MAX_SCALE, ACCUM_INJECT),
    "O2_inject": ("O2", MAX_SCALE, ACCUM_INJECT),
    "O1_max3000_inject": ("O1", 3000.0, ACCUM_INJECT),
    "O2_max3000_inject": ("O2", 3000.0, ACCUM_INJECT),
}
# One forward per micro-batch and both losses from its output (loss 0 backward with
# retain_graph), loss 1 = 0.1 * (out ** 2).mean(), the master gradients clipped before the step.
# The injection hits loss 1 of step 5 in the last (non-delayed) micro-batch, where scaler 1's exit
# adds the new gradient to the stashed one and finds the overflow, or in the delayed one, where
# scaler 0's exit finds it in the accumulated buffer.
ACCUM_SHARED_RUNS = {
    "O1": ("O1", MAX_SCALE, []),
    "O2": ("O2", MAX_SCALE, []),
    "O1_inject": ("O1", MAX_SCALE, [(5, 1, 1)]),
    "O2_inject": ("O2", MAX_SCALE, [(5, 1, 1)]),
    "O1_inject_delayed": ("O1", MAX_SCALE, [(5, 0, 1)]),
    "O2_inject_delayed": ("O2", MAX_SCALE, [(5, 0, 1)]),
}
ACCUM_SCENARIOS = {
    # losses: one kind per loss id; shared_forward: both losses from one forward per micro-batch
    # (else each loss has its own forward and inputs); clip: clip_grad_norm_(amp.master_params(opt),
    # clip) before each step (None: no clipping).
    "accum": dict(init=mlp_init, forward=mlp_forward, steps=12, micro_batches=2,
                  losses=["cross_entropy", "cross_entropy"], shared_forward=False, clip=None, x=[16, 16],
                  classes=10, seed=2025, inject_factor=INJECT_FACTOR, runs=ACCUM_RUNS,
                  optimizer=("SGD", dict(lr=0.1, momentum=0.9))),
    "accum_shared": dict(init=mlp_init, forward=mlp_forward, steps=16, micro_batches=2,
                         losses=["cross_entropy", "square_mean"], shared_forward=True, clip=1.0, x=[32, 16],
                         classes=4, seed=2026, inject_factor=1e6, runs=ACCUM_SHARED_RUNS,
                         optimizer=("SGD", dict(lr=0.1, momentum=0.9))),
}


def accum_loss(kind, out, y, ops):
    if kind == "cross_entropy":
        return ops.cross_entropy(out, y)
    if kind == "square_mean":
        # 0.1 * (out ** 2).mean(): `**` is on Apex's O1 FP32 list, mean and `0.1 *` on none.
        return 0.1 * ops.pow(out, 2).mean()
    raise ValueError(kind)


class Scaler:
    """One of Apex's dynamic loss scalers (LossScaler) on its Python path. An overflow found by
    one unscale call stops that call (the remaining gradients stay as they are) and every later
    unscale call of this scaler until the next non-delayed exit clears the flag."""

    def __init__(self, max_scale):
        self.scale = min(max_scale, INITIAL_SCALE)
        self.max_scale = max_scale
        self.unskipped = 0
        self.overflow = False

    @staticmethod
    def has_inf_or_nan(g):
        # Apex reads one float: the fp32 sum of the incoming (model) gradient.
        s = float(g.float().sum())
        return s in (math.inf, -math.inf) or s != s

    def unscale(self, model_grads, out_grads):
        """out = model * (1/scale), into a separate fp32 gradient or in place."""
        if self.overflow:
            return
        for g, out in zip(model_grads, out_grads):
            if self.has_inf_or_nan(g):
                self.overflow = True
                return
            if out is not g:
                out.copy_(g)
            if self.scale != 1.0:
                out.mul_(1.0 / self.scale)

    def unscale_with_stashed(self, model_grads, stashed_grads, holders):
        """holder.grad = a * model (converted to fp32) + b * stashed: a = 1/scale, b = 1 (the
        stashed gradients are unscaled already); two rounded products, then a rounded add."""
        if self.overflow:
            return
        a, b = 1.0 / self.scale, 1.0
        for g, stashed, holder in zip(model_grads, stashed_grads, holders):
            if self.has_inf_or_nan(g):
                self.overflow = True
                return
            holder.grad = a * g.to(stashed.dtype) + b * stashed

    def update(self):
        """After the unscale of a non-delayed exit: True when the step must be skipped."""
        skip = self.overflow
        if skip:
            self.scale = self.scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
            if self.unskipped == GROWTH_INTERVAL:
                self.scale = min(self.max_scale, self.scale * 2.0)
                self.unskipped = 0
        return skip


def unscale_self_mastered(scaler, params, stash):
    """Parameters that are their own masters (O1's fp32 parameters, O2's fp32 batch norm): a new
    gradient alone is unscaled in place; a new gradient with a stashed one becomes
    new * (1/scale) + stashed; a stashed gradient alone goes back. Empties `stash`."""
    alone, with_stash, stashed = [], [], []
    for i, (p, s) in enumerate(zip(params, stash)):
        stash[i] = None
        if p.grad is None and s is not None:
            p.grad = s
        elif p.grad is not None and s is None:
            alone.append(p)
        elif p.grad is not None:
            with_stash.append(p)
            stashed.append(s)
    scaler.unscale([p.grad for p in alone], [p.grad for p in alone])
    scaler.unscale_with_stashed([p.grad for p in with_stash], stashed, with_stash)


def train_accum(sc, init, xs, ys, run, emulate=False):
    level, max_scale, injections = sc["runs"][run]
    masters_on = level == "O2"
    n_losses = len(sc["losses"])
    P = {}
    for n, t in init.items():
        t = t.clone()
        if masters_on and not is_bn(n):
            t = t.half()
        P[n] = t.requires_grad_(is_param(n))
    params = [n for n in P if is_param(n)]
    stepped = {n: (P[n].detach().clone().float().requires_grad_(True) if P[n].dtype == torch.float16 else P[n])
               for n in params}
    half = [n for n in params if stepped[n] is not P[n]]  # fp16 parameters with fp32 masters
    own = [P[n] for n in params if stepped[n] is P[n]]  # their own masters
    kind, kw = sc["optimizer"]
    opt = getattr(torch.optim, kind)([stepped[n] for n in params], **kw)
    ops = Ops(level == "O1", emulate)
    scalers = [Scaler(max_scale) for _ in range(n_losses)]
    stash = [None for _ in own]  # gradients of `own` set aside at a non-delayed entry
    losses, scales, skipped, norms = [], [], [], []

    def forward(x):
        if masters_on:
            x = x.half()  # patched forward: floating inputs to fp16 ...
        out = sc["forward"](P, x, ops)
        return out.float() if masters_on else out  # ... and outputs to fp32

    for step in range(sc["steps"]):
        # zero_grad: under O2 Apex's patched zero_grad zeroes the model gradients in place and
        # drops the master gradients; under O1 torch.optim's drops every gradient.
        with torch.no_grad():
            for n in params:
                if not masters_on:
                    P[n].grad = None
                elif P[n].grad is not None:
                    P[n].grad.zero_()
        scaled_grads = False  # Apex's params_have_scaled_gradients
        skip = False
        for mb in range(sc["micro_batches"]):
            delay = mb + 1 < sc["micro_batches"]
            if sc["shared_forward"]:
                out = forward(xs[step, mb])
                batch_losses = [accum_loss(k, out, ys[step, mb], ops) for k in sc["losses"]]
            for loss_id, scaler in enumerate(scalers):
                if sc["shared_forward"]:
                    loss = batch_losses[loss_id]
                else:
                    out = forward(xs[step, mb, loss_id])
                    loss = accum_loss(sc["losses"][loss_id], out, ys[step, mb, loss_id], ops)
                if not delay and not scaled_grads:
                    # Entry: set the existing gradients aside.
                    for n in half:
                        P[n].grad = None  # the fp32 master gradients hold them
                    for i, p in enumerate(own):
                        stash[i], p.grad = p.grad, None
                losses.append(loss.detach().float().clone())
                scales.append(scaler.scale)
                user_loss = loss * sc["inject_factor"] if (step, mb, loss_id) in injections else loss
                retain = sc["shared_forward"] and loss_id + 1 < n_losses
                (user_loss.float() * scaler.scale).backward(retain_graph=retain)
                if delay:
                    scaled_grads = True
                    continue
                # Non-delayed exit: unscale with this loss's scaler.
                scaler.overflow = False
                with torch.no_grad():
                    fresh, fresh_out, with_stash, holders = [], [], [], []
                    for n in half:
                        g, m = P[n].grad, stepped[n]
                        if g is not None and m.grad is None:
                            m.grad = torch.empty_like(m)
                            fresh.append(g)
                            fresh_out.append(m.grad)
                        elif g is not None:
                            with_stash.append(g)
                            holders.append(m)
                    scaler.unscale(fresh, fresh_out)
                    scaler.unscale_with_stashed(with_stash, [m.grad for m in holders], holders)
                    unscale_self_mastered(scaler, own, stash)
                scaled_grads = False
                skip = scaler.update() or skip
        if sc["clip"] is not None:
            # The user's clip_grad_norm_(amp.master_params(optimizer), clip): the optimizer's
            # parameters in its order (the model's). At a skipped step it reads gradients the
            # skip discards (under O2 partly uninitialised memory), so its norm is not kept.
            norm = torch.nn.utils.clip_grad_norm_([stepped[n] for n in params], sc["clip"])
            norms.append(math.nan if skip else float(norm))
        skipped.append(1 if skip else 0)
        if not skip:
            opt.step()
            with torch.no_grad():
                for n in half:
                    P[n].copy_(stepped[n])
        for n in half:
            stepped[n].grad = None  # Apex's step and skipped step both drop the master gradients
    result = {
        "loss": torch.stack(losses).reshape(sc["steps"], sc["micro_batches"], n_losses),
        "scale": torch.tensor(scales, dtype=torch.float64).reshape(sc["steps"], sc["micro_batches"], n_losses),
        "skipped": torch.tensor(skipped, dtype=torch.uint8),
    }
    if sc["clip"] is not None:
        result["norm"] = torch.tensor(norms, dtype=torch.float32)
    for n, t in P.items():
        result["final/" + n] = t.detach().clone()
    for n in half:
        result["master/" + n] = stepped[n].detach().clone()
    return result


def accum_data(sc):
    """The initial variables, inputs and targets of an accumulation scenario: x [steps,
    micro-batches, (losses,) batch, 16], y [steps, micro-batches, (losses,) batch] (a loss axis
    when each loss has its own forward)."""
    g = torch.Generator().manual_seed(sc["seed"])
    init = sc["init"](g, sc["classes"])
    shape = [sc["steps"], sc["micro_batches"]] + ([] if sc["shared_forward"] else [len(sc["losses"])])
    xs = torch.randn(shape + sc["x"], generator=g)
    ys = torch.randint(0, sc["classes"], shape + sc["x"][:1], generator=g)
    return init, xs, ys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="-", help="output file, '-' for stdout")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--accum-runs", default=",".join(f"{n}/{r}" for n, sc in ACCUM_SCENARIOS.items() for r in sc["runs"]),
                    help="accumulation runs as scenario/run")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out, meta = {}, {}
    for name in a.scenarios.split(","):
        sc = SCENARIOS[name]
        g = torch.Generator().manual_seed(2024)
        init = sc["init"](g)
        xs = torch.randn([sc["steps"]] + sc["x"], generator=g)
        ys = torch.randint(0, sc["classes"], (sc["steps"], sc["x"][0]), generator=g)
        for n, t in init.items():
            out[f"{name}/init/{n}"] = t
        out[f"{name}/x"] = xs
        out[f"{name}/y"] = ys
        runs = a.runs.split(",")
        for run in runs:
            for k, t in train(sc, init, xs, ys, run).items():
                out[f"{name}/{run}/{k}"] = t.contiguous()
            if RUNS[run][0] != "O0":
                for k, t in train(sc, init, xs, ys, run, emulate=True).items():
                    out[f"{name}/{run}+emulated/{k}"] = t.contiguous()
        kind, kw = sc["optimizer"]
        meta[name] = {"steps": sc["steps"], "inject": sc["inject"], "optimizer": kind, **kw, "runs": runs,
                      "inject_factor": INJECT_FACTOR}
    accum_meta = {}
    for entry in [r for r in a.accum_runs.split(",") if r]:
        name, run = entry.split("/")
        sc = ACCUM_SCENARIOS[name]
        if name not in accum_meta:
            init, xs, ys = accum_data(sc)
            for n, t in init.items():
                out[f"{name}/init/{n}"] = t
            out[f"{name}/x"] = xs
            out[f"{name}/y"] = ys
            kind, kw = sc["optimizer"]
            accum_meta[name] = {"steps": sc["steps"], "micro_batches": sc["micro_batches"], "losses": sc["losses"],
                                "shared_forward": sc["shared_forward"], "clip": sc["clip"], "optimizer": kind, **kw,
                                "inject_factor": sc["inject_factor"], "runs": {}}
        level, max_scale, inject = sc["runs"][run]
        accum_meta[name]["runs"][run] = {"level": level, "max_loss_scale": max_scale, "inject": inject}
        for k, t in train_accum(sc, init, xs, ys, run).items():
            out[f"{name}/{run}/{k}"] = t.contiguous()
        for k, t in train_accum(sc, init, xs, ys, run, emulate=True).items():
            out[f"{name}/{run}+emulated/{k}"] = t.contiguous()
    data = save(out, metadata={"scenarios": json.dumps(meta), "accumulation": json.dumps(accum_meta),
                               "torch": torch.__version__, "threads": str(a.threads)})
    if a.out == "-":
        sys.stdout.buffer.write(data)
    else:
        with open(a.out, "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()

"""Expected values for tests/amp/fp16_utils.rs: Apex's legacy FP16_Optimizer (apex.fp16_utils at
e13873de) re-implemented from its documented algorithm, on CPU with the venv's torch 2.13.0.

Run from the repository root with the venv's python (its path is TCH_AMP_PYTHON in
.cargo/config.toml):

    $TCH_AMP_PYTHON scripts/reference/fp16_optimizer_reference.py OUT.safetensors

The Rust tests run it themselves at test time (tests/common/reference.rs, Fixture::generated):
libtorch's element-wise CPU kernels differ in the last bit between vector ISAs (AVX2, AVX512),
so the expected values are made on the CPU that runs the tests.

FP16_Optimizer, as read in Apex (this is our own code, written from that reading):
- construction: every fp16 parameter of each group gets an fp32 master (a detached fp32 copy),
  which replaces it in the wrapped optimizer; fp32 parameters stay as they are. The loss
  scaler is Apex's amp LossScaler: dynamic starts at min(max_loss_scale=2**24, init_scale),
  halves on overflow (floored at min_loss_scale when given), doubles (capped at
  max_loss_scale) after scale_window clean passes in a row; static never checks.
- backward(loss, update_master_grads=True): (loss.float() * scale).backward(), then
  update_master_grads() unless told not to.
- update_master_grads(): for each fp16 parameter with a gradient (model order), the master
  gradient becomes the fp16 gradient copied to fp32 times 1/scale; fp32 gradients are
  multiplied by 1/scale in place; with dynamic scaling any inf/NaN among the model gradients is
  an overflow. The scaler is then updated (one pass) and `overflow` remembered.
- clip_master_grads(max_norm): -1 after an overflow, otherwise
  torch.nn.utils.clip_grad_norm_ over every parameter the optimizer holds (masters and fp32
  parameters, in group order).
- step(): nothing after an overflow; otherwise the wrapped optimizer steps and every master is
  copied (rounded) into its fp16 parameter.
- zero_grad(): every existing gradient (masters, fp32 and fp16 parameters) is zeroed.

The model (small enough that every kernel runs single-threaded, so the values do not depend on
the machine): fc.weight fp16 [4, 8], fc.bias fp16 [4], gain fp32 [4] (created in that order);
out = ((x.half()[:, None, :] * w).sum(-1) + b).float() * gain; loss = mse(out, y).
Steps follow a plan (see PLAN): a normal step, an injected overflow (the targets multiplied by
1e4, so that the scaled fp16 gradients overflow), two losses per step with
update_master_grads=False followed by one update_master_grads(), and a step whose forward
leaves the bias out.

The fixture holds, per case: the initial parameters, every step's inputs, and after every step
the loss scale before and after, the overflow flag, the clip norm (-1 on overflow), whether
the step ran, the fp32 masters / fp32 parameters (`p32`, creation order, flattened) and the
fp16 parameters (`p16`). The metadata "cases" lists the cases (optimizer, hyper-parameters,
scaler options, plan).
"""
import json
import sys

import torch
from safetensors.torch import save

torch.set_num_threads(1)
STEPS = 12
N = 6
# per step: "one" (one loss), "overflow" (one loss, targets * 1e4), "two" (two half-batch
# losses with update_master_grads=False, then update_master_grads()), "nobias" (the bias left
# out of the forward: its zeroed fp16 gradient still reaches its master, so momentum and weight
# decay move it, as in Apex)
PLAN = ["one", "one", "one", "overflow", "one", "two", "one", "nobias", "overflow", "one", "two", "one"]
CASES = [
    dict(name="sgd_dynamic", optimizer="SGD", lr=0.05, momentum=0.9, weight_decay=1e-3,
         dynamic=True, init_scale=2.0**14, scale_window=3, max_loss_scale=2.0**24, min_loss_scale=None,
         static_loss_scale=1.0, max_norm=0.5),
    dict(name="adam_dynamic", optimizer="Adam", lr=1e-2, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0,
         dynamic=True, init_scale=2.0**32, scale_window=4, max_loss_scale=2.0**16, min_loss_scale=2.0**10,
         static_loss_scale=1.0, max_norm=1.0),
    dict(name="sgd_static", optimizer="SGD", lr=0.05, momentum=0.0, weight_decay=0.0,
         dynamic=False, init_scale=2.0**16, scale_window=2000, max_loss_scale=2.0**24, min_loss_scale=None,
         static_loss_scale=128.0, max_norm=10.0),
]
# A static scale never checks: an injected overflow would turn every later value into NaN (as
# in Apex), so the static case runs the plan without them.
STATIC_PLAN = [("one" if p == "overflow" else p) for p in PLAN]


class Scaler:
    """Apex's amp LossScaler as FP16_Optimizer uses it."""

    def __init__(self, c):
        self.dynamic = c["dynamic"]
        self.scale = min(c["max_loss_scale"], c["init_scale"]) if self.dynamic else c["static_loss_scale"]
        self.max, self.min, self.window, self.unskipped = c["max_loss_scale"], c["min_loss_scale"], c["scale_window"], 0

    def update(self, overflow):
        skip = overflow and self.dynamic
        if skip:
            self.scale = max(self.min, self.scale / 2.0) if self.min else self.scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.dynamic and self.unskipped == self.window:
            self.scale = min(self.max, self.scale * 2.0)
            self.unskipped = 0
        return skip


class RefFP16Optimizer:
    def __init__(self, opt, c):
        self.opt = opt
        self.pairs, self.fp32 = [], []
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                if p.dtype == torch.float16:
                    m = p.detach().clone().float().requires_grad_(True)
                    group["params"][i] = m
                    self.pairs.append((p, m))
                else:
                    self.fp32.append(p)
        self.scaler = Scaler(c)
        self.overflow = False

    def backward(self, loss, update_master_grads=True):
        (loss.float() * self.scaler.scale).backward()
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        inv = 1.0 / self.scaler.scale
        overflow = False
        for model, master in self.pairs:
            if model.grad is None:
                continue
            if self.scaler.dynamic and not bool(torch.isfinite(model.grad).all()):
                overflow = True
                break
            g = model.grad.float()
            g.mul_(inv)
            master.grad = g
        if not overflow:
            for p in self.fp32:
                if p.grad is None:
                    continue
                if self.scaler.dynamic and not bool(torch.isfinite(p.grad).all()):
                    overflow = True
                    break
                p.grad.mul_(inv)
        self.overflow = self.scaler.update(overflow)

    def clip_master_grads(self, max_norm):
        if self.overflow:
            return -1.0
        params = [p for g in self.opt.param_groups for p in g["params"]]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def step(self):
        if self.overflow:
            return False
        self.opt.step()
        with torch.no_grad():
            for model, master in self.pairs:
                model.copy_(master)
        return True

    def zero_grad(self):
        for g in self.opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()
        for model, _ in self.pairs:
            if model.grad is not None:
                model.grad.detach_()
                model.grad.zero_()


def initial(numel, phase):
    return (torch.arange(numel, dtype=torch.float32) * 0.37 + phase).sin() * 0.3


def run(c, out):
    w = torch.nn.Parameter(initial(32, 0.0).reshape(4, 8).half())
    b = torch.nn.Parameter(initial(4, 1.0).half())
    gain = torch.nn.Parameter(1.0 + initial(4, 2.0))
    name = c["name"]
    out[f"{name}/init/fc.weight"] = w.detach().clone()
    out[f"{name}/init/fc.bias"] = b.detach().clone()
    out[f"{name}/init/gain"] = gain.detach().clone()
    params = [w, b, gain]
    if c["optimizer"] == "SGD":
        opt = torch.optim.SGD(params, lr=c["lr"], momentum=c["momentum"], weight_decay=c["weight_decay"])
    else:
        opt = torch.optim.Adam(params, lr=c["lr"], betas=tuple(c["betas"]), eps=c["eps"],
                               weight_decay=c["weight_decay"])
    fo = RefFP16Optimizer(opt, c)

    def forward(x, y, bias=True):
        h = (x.half()[:, None, :] * w[None]).sum(-1)
        if bias:
            h = h + b
        return torch.nn.functional.mse_loss(h.float() * gain, y)

    plan = PLAN if c["dynamic"] else STATIC_PLAN
    rows = {k: [] for k in ["scale_before", "scale_after", "overflow", "norm", "stepped", "p32", "p16", "x", "y"]}
    for s in range(STEPS):
        x = (torch.arange(N * 8, dtype=torch.float32) * 0.731 + s).sin().reshape(N, 8) * 2.0
        y = (torch.arange(N * 4, dtype=torch.float32) * 1.37 + s).cos().reshape(N, 4)
        if plan[s] == "overflow":
            y = y * 1e4
        rows["x"].append(x)
        rows["y"].append(y)
        rows["scale_before"].append(fo.scaler.scale)
        fo.zero_grad()
        if plan[s] == "two":
            fo.backward(forward(x[: N // 2], y[: N // 2]), update_master_grads=False)
            fo.backward(forward(x[N // 2:], y[N // 2:]), update_master_grads=False)
            fo.update_master_grads()
        else:
            fo.backward(forward(x, y, bias=plan[s] != "nobias"))
        norm = fo.clip_master_grads(c["max_norm"])
        stepped = fo.step()
        rows["scale_after"].append(fo.scaler.scale)
        rows["overflow"].append(float(fo.overflow))
        rows["norm"].append(norm)
        rows["stepped"].append(float(stepped))
        masters = {id(model): master for model, master in fo.pairs}
        rows["p32"].append(torch.cat([masters[id(w)].detach().flatten(), masters[id(b)].detach().flatten(),
                                      gain.detach().flatten()]))
        rows["p16"].append(torch.cat([w.detach().flatten(), b.detach().flatten()]))
    for k in ["scale_before", "scale_after", "overflow", "norm", "stepped"]:
        out[f"{name}/{k}"] = torch.tensor(rows[k], dtype=torch.float64)
    for k in ["p32", "p16", "x", "y"]:
        out[f"{name}/{k}"] = torch.stack(rows[k]).contiguous()
    print(name, "scales", rows["scale_before"], "overflow", rows["overflow"], "norms",
          [round(n, 4) for n in rows["norm"]])


def main():
    path = sys.argv[1]
    out = {}
    for c in CASES:
        run(c, out)
    meta = {"cases": json.dumps(CASES), "plan": json.dumps(PLAN), "static_plan": json.dumps(STATIC_PLAN), "torch": torch.__version__}
    with open(path, "wb") as f:
        f.write(save(out, metadata=meta))


if __name__ == "__main__":
    main()

"""Expected values for tests/float8.rs: torchao 0.18's float8 training (Float8Linear through
convert_to_float8_training, recipes "tensorwise", "rowwise" and "rowwise_with_gw_hp") and
Transformer Engine's delayed scaling (te_delayed_scaling.py, beside this file) on CPU with
PyTorch 2.13, one thread.

    $TCH_AMP_PYTHON scripts/reference/float8_reference.py OUT.safetensors

torchao is installed into the venv by scripts/setup-libtorch.sh (requirements-test.txt); the
Rust tests run this script themselves at test time (tests/common/reference.rs,
Fixture::generated), so the values come from the machine that runs the tests.

Two models, built from the same initial values on both sides:
- "mlp": fc1 32->64, relu, fc2 64->48, relu, fc3 48->10 (fc3's 10 features are no multiple of
  16: skipped, as torchao's recipe filters skip it); input [20, 32] ([32, 32] on CUDA, whose
  `_scaled_mm` needs multiples of 16).
- "block": a pre-norm transformer block, D=32, 2 heads: ln1, q, k, v, o (32->32), ln2, fc1
  32->64, gelu, fc2 64->32, then head 32->10 (skipped); input [2, 8, 32].
Modes: "fp32" (3 steps of SGD lr 0.05 momentum 0.9 on mse loss), "autocast" (fp32 weights,
the forward under torch.autocast("cpu", bfloat16), 3 SGD steps), "bf16" (bf16 weights and
input, 2 forward/backward passes, no optimizer), "o2" (Apex's O2 as tch-amp runs it: an fp16
model fed `x.half()`, its output `.float()`, the loss times a static scale of 128, the fp16
gradients copied to fp32 and unscaled by libtorch's `_amp_foreach_non_finite_check_and_unscale_`
into fp32 masters, SGD on the masters, the model their fp16 copy). torchao's rowwise_with_gw_hp fails under
autocast (its high-precision grad_weight GEMM gets a bf16 and an fp32 operand): not a case.
"nonfinite": the tensorwise mlp with an inf in the input of step 0 and the delayed mlp with an
inf in step 1's input.

Per case `<case>/`: `init/<param>`; per step s `step<s>/`: `x`, `target`, `y` (the output),
`loss`, `x_grad`, `grad/<param>` (the fp32 master's under "o2"), `param/<param>` (after the
optimizer step), `master/<param>` under "o2", for torchao the
scale of every cast `scale/<layer>/<role>` (role: input, weight, grad_output,
weight_for_grad_input, grad_output_for_grad_weight, input_for_grad_weight), for delayed
scaling the state after the step `state/<layer>/<role>/{amax_history,scale}` and the scales
used `scale/<layer>/{input,weight,grad_output}`. The metadata "cases" lists the cases.
"""

import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_delayed_scaling as te  # noqa: E402

import torchao.float8.float8_linear as f8l  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: E402

torch.set_num_threads(1)
DEVICE = "cpu"  # float8_reference_cuda.py sets "cuda"
HEADS = 2
LR, MOMENTUM = 0.05, 0.9


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 48), nn.Linear(48, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        d = 32
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2, self.head = nn.Linear(d, 64), nn.Linear(64, d), nn.Linear(d, 10)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)

        def heads(y):
            return y.view(b, t, HEADS, d // HEADS).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(d // HEADS)).softmax(-1)
        a = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


def data(model_name, step, dtype):
    g = torch.Generator().manual_seed(1000 + step)
    rows = 20 if DEVICE == "cpu" else 32  # CUDA's _scaled_mm needs multiples of 16
    shape = (rows, 32) if model_name == "mlp" else (2, 8, 32)
    out = (rows, 10) if model_name == "mlp" else (2, 8, 10)
    x = torch.randn(shape, generator=g) * 2.0
    return x.to(dtype).to(DEVICE), torch.randn(out, generator=g).to(DEVICE)


def dims_filter(module, fqn):
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


# Every scale torchao computes, by layer and role: the forward hook names the layer, the
# patched autograd function carries the name into the backward.
CURRENT = {"layer": None, "phase": "forward", "count": {}}
SCALES = {}
_orig_cast = f8l.hp_tensor_to_float8_dynamic
_orig_fwd, _orig_bwd = f8l.matmul_with_hp_or_float8_args.forward, f8l.matmul_with_hp_or_float8_args.backward
BACKWARD_ROLES = {GemmInputRole.GRAD_OUTPUT: ["grad_output", "grad_output_for_grad_weight"],
                  GemmInputRole.WEIGHT: ["weight_for_grad_input"], GemmInputRole.INPUT: ["input_for_grad_weight"]}


def recording_cast(hp, dtype, mm_config, *args, **kwargs):
    out = _orig_cast(hp, dtype, mm_config, *args, **kwargs)
    role = kwargs["gemm_input_role"]
    layer = CURRENT["layer"]
    if CURRENT["phase"] == "forward":
        name = "input" if role == GemmInputRole.INPUT else "weight"
    else:
        n = CURRENT["count"].get(role, 0)
        CURRENT["count"][role] = n + 1
        name = BACKWARD_ROLES[role][n]
    SCALES[(layer, name)] = out._scale.detach().clone()
    return out


def recording_fwd(ctx, *args):
    ctx.layer_name = CURRENT["layer"]
    CURRENT["phase"] = "forward"
    return _orig_fwd(ctx, *args)


def recording_bwd(ctx, grad):
    CURRENT.update(layer=ctx.layer_name, phase="backward", count={})
    try:
        return _orig_bwd(ctx, grad)
    finally:
        CURRENT["phase"] = "forward"


f8l.hp_tensor_to_float8_dynamic = recording_cast
f8l.matmul_with_hp_or_float8_args.forward = staticmethod(recording_fwd)
f8l.matmul_with_hp_or_float8_args.backward = staticmethod(recording_bwd)


def build(model_name, dtype):
    torch.manual_seed(7)
    m = Mlp() if model_name == "mlp" else Block()
    return m.to(dtype).to(DEVICE)


def convert(model, kind, spec):
    if kind == "torchao":
        convert_to_float8_training(model, module_filter_fn=dims_filter,
                                   config=Float8LinearConfig.from_recipe_name(spec["recipe"]))
        for name, mod in model.named_modules():
            if isinstance(mod, f8l.Float8Linear):
                mod.register_forward_pre_hook(lambda m, a, name=name: CURRENT.update(layer=name))
        return model
    recipe = te.Recipe(margin=spec["margin"], fp8_format=spec["fp8_format"],
                       amax_history_len=spec["amax_history_len"], amax_compute_algo=spec["amax_compute_algo"])
    for name, mod in list(model.named_children()):
        if isinstance(mod, nn.Linear) and dims_filter(mod, name):
            setattr(model, name, te.DelayedLinear(mod, recipe))
    return model


LOSS_SCALE = 128.0


def run_case(out, case):
    name, model_name, mode = case["name"], case["model"], case["mode"]
    dtype = {"bf16": torch.bfloat16, "o2": torch.float16}.get(mode, torch.float32)
    model = convert(build(model_name, dtype), case["kind"], case)
    for p, t in model.named_parameters():
        out[f"{name}/init/{p}"] = t.detach().clone()
    params = dict(model.named_parameters())
    # O2 (Apex, as tch-amp runs it): fp32 masters stepped by the optimizer, the fp16 model a copy.
    masters = {p: t.detach().clone().float() for p, t in params.items()} if mode == "o2" else None
    stepped = list(masters.values()) if masters else model.parameters()
    opt = torch.optim.SGD(stepped, lr=LR, momentum=MOMENTUM, foreach=False) if case["optimizer"] else None
    for s in range(case["steps"]):
        pre = f"{name}/step{s}/"
        x, target = data(model_name, s, torch.float32 if mode == "o2" else dtype)
        if s == case.get("inf_step", -1):
            x.view(-1)[5] = float("inf")
        SCALES.clear()
        x.requires_grad_(True)
        if opt:
            opt.zero_grad()
            model.zero_grad(set_to_none=True)
        if mode == "autocast":
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                y = model(x)
        elif mode == "o2":
            y = model(x.half()).float()
        else:
            y = model(x)
        loss = F.mse_loss(y.float(), target)
        if mode == "o2":
            (loss * LOSS_SCALE).backward()
            for p, t in params.items():
                masters[p].grad = t.grad.float()
            found_inf = torch.zeros(1, device=x.device)
            inv = torch.full((1,), 1.0 / LOSS_SCALE, device=x.device)
            torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in masters.values()], found_inf, inv)
        else:
            loss.backward()
        out[pre + "x"], out[pre + "target"] = x.detach().clone(), target
        out[pre + "y"], out[pre + "loss"] = y.detach().clone(), loss.detach().reshape(1).clone()
        out[pre + "x_grad"] = x.grad.clone()
        for p, t in params.items():
            out[pre + f"grad/{p}"] = (masters[p].grad if masters else t.grad).clone()
        if opt:
            opt.step()
        if masters:
            with torch.no_grad():
                for p, t in params.items():
                    t.copy_(masters[p])
                    out[pre + f"master/{p}"] = masters[p].detach().clone()
        for p, t in params.items():
            out[pre + f"param/{p}"] = t.detach().clone()
        if case["kind"] == "torchao":
            for (layer, role), sc in SCALES.items():
                out[pre + f"scale/{layer}/{role}"] = sc
        else:
            for lname, mod in model.named_children():
                if isinstance(mod, te.DelayedLinear):
                    for role, st in mod.state.items():
                        out[pre + f"state/{lname}/{role}/amax_history"] = st.history_tensor()
                        out[pre + f"state/{lname}/{role}/scale"] = st.scale_tensor()
                    for role, sc in mod.last.items():
                        out[pre + f"scale/{lname}/{role}"] = sc.clone()


def cases(device="cpu"):
    out = []
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        for model_name in ("mlp", "block"):
            for mode in ("fp32", "autocast", "bf16"):
                if recipe == "rowwise_with_gw_hp" and mode == "autocast":
                    continue
                out.append(dict(name=f"{recipe}-{model_name}-{mode}", kind="torchao", recipe=recipe,
                                model=model_name, mode=mode, steps=2 if mode == "bf16" else 3,
                                optimizer=mode != "bf16"))
    delayed = [
        dict(margin=0, fp8_format="HYBRID", amax_history_len=4, amax_compute_algo="max"),
        dict(margin=1, fp8_format="HYBRID", amax_history_len=3, amax_compute_algo="most_recent"),
        dict(margin=0, fp8_format="E4M3", amax_history_len=1, amax_compute_algo="max"),
    ]
    for i, d in enumerate(delayed):
        for model_name in ("mlp", "block"):
            out.append(dict(name=f"delayed{i}-{model_name}-fp32", kind="delayed", model=model_name, mode="fp32",
                            steps=5, optimizer=True, **d))
    out.append(dict(name="delayed0-block-autocast", kind="delayed", model="block", mode="autocast", steps=4,
                    optimizer=True, **delayed[0]))
    if device != "cpu":
        keep = ("tensorwise-mlp-fp32", "tensorwise-block-autocast", "rowwise-mlp-fp32", "rowwise-block-autocast",
                "delayed0-mlp-fp32", "delayed0-block-autocast")
        return [c for c in out if c["name"] in keep]
    for recipe, model_name in (("tensorwise", "mlp"), ("tensorwise", "block"), ("rowwise", "mlp")):
        out.append(dict(name=f"{recipe}-{model_name}-o2", kind="torchao", recipe=recipe, model=model_name, mode="o2",
                        steps=3, optimizer=True))
    out.append(dict(name="delayed0-block-o2", kind="delayed", model="block", mode="o2", steps=4, optimizer=True,
                    **delayed[0]))
    out.append(dict(name="tensorwise-mlp-nonfinite", kind="torchao", recipe="tensorwise", model="mlp",
                    mode="fp32", steps=1, optimizer=True, inf_step=0))
    out.append(dict(name="delayed0-mlp-nonfinite", kind="delayed", model="mlp", mode="fp32", steps=4,
                    optimizer=True, inf_step=1, **dict(delayed[0], amax_history_len=2)))
    return out


def main(device="cpu"):
    global DEVICE
    DEVICE = device
    out = {}
    all_cases = cases(device)
    for case in all_cases:
        run_case(out, case)
    tensors = {k: v.detach().cpu().contiguous() for k, v in out.items()}
    save_file(tensors, sys.argv[1], metadata={"cases": json.dumps(all_cases)})


if __name__ == "__main__":
    main()

"""Checkpoints and continuations for tests/torch_checkpoint.rs (tch_amp::torch_checkpoint), with
the venv's torch 2.13 on CPU, one intra-op thread. No Apex is needed: the optimizers are
torch.optim's, the amp state is a dict in Apex's format, and O2 is done by hand the way Apex does
it (as in apex_reference.py).

    python torch_checkpoint_fixtures.py write DIR
        # DIR/<scenario>.zip.pt and DIR/<scenario>.legacy.pt (the same checkpoint, zip and
        # legacy container), DIR/expected.safetensors (the continuations), and a few special
        # files (see `write`).
    python torch_checkpoint_fixtures.py resume SCENARIO CKPT OUT START
        # torch.load(CKPT, weights_only=True) of a checkpoint tch-amp wrote, resumed as a Python
        # script resumes (model.load_state_dict(strict=True), optimizer.load_state_dict, the amp
        # state), N steps from data step START; the continuation goes to OUT (safetensors, tag
        # "resume").
    python torch_checkpoint_fixtures.py imagenet OUT WIDTH STAGES CLASSES LABEL
        # A checkpoint of examples/imagenet.rs's model in main_amp.py's layout (see `imagenet`).

The model: Linear(16, 32) "fc1", BatchNorm1d(32) "bn1", ReLU, Linear(32, 10) "fc2", cross
entropy, batch 32. Scenarios (level, optimizer, parameter groups):
- sgd_o0 / sgd_o2: SGD(momentum=0.9, weight_decay=1e-4), groups [fc1, bn1] lr 0.1 and [fc2]
  lr 0.05 (in model order);
- adam_o0 / adam_o2: Adam(lr=1e-3), one group;
- adamw_named_o0: AdamW(lr=1e-3, weight_decay=0.01), groups [fc1.weight, fc2.weight] lr 1e-3
  and [fc1.bias, bn1.weight, bn1.bias, fc2.bias] lr 2e-3 (NOT in model order), made from named
  parameters, so the state dict carries torch 2.x's `param_names`.

O0: fp32 model, loss scale 1 (the loss goes to backward as it is). O2: fc1 and fc2 in fp16,
bn1 in fp32 (keep_batchnorm_fp32), inputs to fp16 and the output to fp32, fp32 master copies of
the fp16 parameters stepped by the optimizer (bn1's fp32 parameters are their own masters),
backward of loss * scale, fp16 grads copied into fp32 master grads and multiplied by 1/scale,
dynamic scale: an inf/NaN skips the step and halves the scale, 2000 clean passes double it.
The scaler starts at 32768 with 1995 clean passes counted (as if resumed from a long run), so
that it doubles during the compared steps; at data step INJECT the loss is multiplied by 2^15 so
that the gradients overflow and that step is skipped.

Checkpoints: after K steps, {'model', 'optimizer', 'amp', 'epoch'} as Apex's README saves
them; under O2 the model state dict is what Apex's O2 state-dict hook returns (the fp16
parameters cast to fp32, not the masters). Continuations: N steps from the checkpoint file,
resumed the way tch-amp resumes ("tch" rule: the masters are the file's fp32 values, the
optimizer state is loaded straight into fp32), and under O2 also as Apex resumes ("apex" rule:
optimizer.load_state_dict runs on the fp16 model parameters, so the fp32 state is cast to fp16,
then Apex builds the masters from the fp16 parameters and casts the state back to fp32).

expected.safetensors, per tag (<scenario>, <scenario>/apex, or resume): loss [N] fp32,
scale [N] fp64 (the scale each step's backward used), skipped [N] uint8, final/<name> (every
model variable, in its dtype), master/<name> (fp32 masters of fp16 parameters), state/<name>/<buf>
(optimizer state by parameter name), step/<name> (Adam's step). Data: x [K+M+N, 32, 16],
y [K+M+N, 32]. <scenario>/apex_state_error: max |state after Apex's load - state in the file|.
"""
import argparse
import json
import sys
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

K, M, N = 3, 2, 4  # Python steps before its checkpoint, Rust steps before its own, steps compared
STEPS = K + M + N
BATCH, IN, HID, OUT = 32, 16, 32, 10
SCALE0, UNSKIPPED0, GROWTH_INTERVAL = 32768.0, 1995, 2000
INJECT, INJECT_FACTOR = K + 2, 2.0**15

SCENARIOS = {
    "sgd_o0": dict(level="O0", opt="SGD", kw=dict(lr=0.1, momentum=0.9, weight_decay=1e-4),
                   groups=[(["fc1.weight", "fc1.bias", "bn1.weight", "bn1.bias"], {}),
                           (["fc2.weight", "fc2.bias"], dict(lr=0.05))]),
    "sgd_o2": dict(level="O2", opt="SGD", kw=dict(lr=0.1, momentum=0.9, weight_decay=1e-4),
                   groups=[(["fc1.weight", "fc1.bias", "bn1.weight", "bn1.bias"], {}),
                           (["fc2.weight", "fc2.bias"], dict(lr=0.05))]),
    "adam_o0": dict(level="O0", opt="Adam", kw=dict(lr=1e-3), groups=None),
    "adam_o2": dict(level="O2", opt="Adam", kw=dict(lr=1e-3), groups=None),
    "adamw_named_o0": dict(level="O0", opt="AdamW", kw=dict(lr=1e-3, weight_decay=0.01), named=True,
                           groups=[(["fc1.weight", "fc2.weight"], {}),
                                   (["fc1.bias", "bn1.weight", "bn1.bias", "fc2.bias"], dict(lr=2e-3))]),
}


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.bn1 = nn.BatchNorm1d(HID)
        self.fc2 = nn.Linear(HID, OUT)

    def forward(self, x):
        return self.fc2(F.relu(self.bn1(self.fc1(x))))


def data():
    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(STEPS, BATCH, IN, generator=g)
    ys = torch.randint(0, OUT, (STEPS, BATCH), generator=g)
    return xs, ys


def fresh_model(level):
    torch.manual_seed(7)
    model = Mlp()
    with torch.no_grad():  # a non-trivial batch norm
        model.bn1.weight.uniform_(0.5, 1.5)
        model.bn1.bias.uniform_(-0.2, 0.2)
    if level == "O2":
        model.fc1.half()  # Apex O2: every module but batch norm to fp16
        model.fc2.half()
    return model


class Run:
    """A model, the tensors the optimizer steps (fp32 masters under O2), the optimizer and the
    loss scaler, set up fresh or from a checkpoint as `rule` says."""

    def __init__(self, name, ckpt=None, rule="tch"):
        sc = SCENARIOS[name]
        self.level = sc["level"]
        self.model = fresh_model(self.level)
        named = OrderedDict(self.model.named_parameters())
        if ckpt is not None:
            self.model.load_state_dict(ckpt["model"])  # strict=True
        o2 = self.level == "O2"
        if o2 and rule == "tch":
            # The masters are the file's fp32 values (a fresh run: fp32 copies of the model).
            src = ckpt["model"] if ckpt is not None else {n: p.detach() for n, p in named.items()}
            self.stepped = OrderedDict(
                (n, src[n].detach().clone().float().requires_grad_(True) if p.dtype == torch.float16 else p)
                for n, p in named.items())
        else:
            self.stepped = OrderedDict(named)
        cls = getattr(torch.optim, sc["opt"])
        groups = sc["groups"] or [(list(named), {})]
        if sc.get("named"):
            param_groups = [dict(params=[(n, self.stepped[n]) for n in names], **kw) for names, kw in groups]
        else:
            param_groups = [dict(params=[self.stepped[n] for n in names], **kw) for names, kw in groups]
        self.opt = cls(param_groups, **sc["kw"])
        self.state_error = 0.0
        if ckpt is not None:
            self.opt.load_state_dict(ckpt["optimizer"])
            if o2 and rule == "apex":
                self._apex_lazy_init(ckpt["optimizer"])
        if ckpt is not None and "amp" in ckpt:
            s = ckpt["amp"]["loss_scaler0"]
            self.scale, self.unskipped = float(s["loss_scale"]), int(s["unskipped"])
        elif o2:
            self.scale, self.unskipped = SCALE0, UNSKIPPED0
        else:
            self.scale, self.unskipped = 1.0, 0

    def _apex_lazy_init(self, saved):
        """Apex's lazy_init_with_master_weights after optimizer.load_state_dict ran on the fp16
        parameters: fp32 masters from the fp16 parameters replace them in place, their state
        moves along, and the state dict trick recasts the (fp16) state to fp32."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        for group in self.opt.param_groups:
            for i, p in enumerate(group["params"]):
                if p.dtype == torch.float16:
                    m = p.detach().clone().float().requires_grad_(True)
                    group["params"][i] = m
                    if p in self.opt.state:
                        self.opt.state[m] = self.opt.state.pop(p)
                    self.stepped[names[id(p)]] = m
        self.opt.load_state_dict(self.opt.state_dict())
        # How far the fp16 round trip moved the state.
        now = self.opt.state_dict()["state"]
        err = 0.0
        for idx, st in saved["state"].items():
            for k, v in st.items():
                if k != "step" and torch.is_tensor(v):
                    err = max(err, (now[idx][k].double() - v.double()).abs().max().item())
        self.state_error = err

    def step(self, x, y, inject):
        """One training step; returns (loss, scale used, skipped)."""
        for p in self.model.parameters():
            p.grad = None
        for p in self.stepped.values():
            p.grad = None
        o2 = self.level == "O2"
        out = self.model(x.half() if o2 else x)
        if o2:
            out = out.float()
        loss = F.cross_entropy(out, y)
        scale = self.scale
        user = loss * INJECT_FACTOR if (o2 and inject) else loss
        overflow = False
        if not o2:
            user.float().backward()  # O0: static scale 1.0, scale_loss yields loss.float()
        else:
            (user.float() * scale).backward()
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    g = p.grad
                    if g is None:
                        continue
                    if not bool(torch.isfinite(g).all()):
                        overflow = True
                    m = self.stepped[n]
                    if m is p:
                        g.mul_(1.0 / scale)
                    else:
                        mg = torch.empty_like(m)
                        mg.copy_(g)
                        mg.mul_(1.0 / scale)
                        m.grad = mg
            if overflow:
                self.scale = scale / 2.0
                self.unskipped = 0
            else:
                self.unskipped += 1
                if self.unskipped == GROWTH_INTERVAL:
                    self.scale = min(2.0**24, scale * 2.0)
                    self.unskipped = 0
        if not overflow:
            self.opt.step()
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if self.stepped[n] is not p:
                        p.copy_(self.stepped[n])
        return loss.detach().float().clone(), scale, overflow

    def checkpoint(self, epoch):
        sd = self.model.state_dict()
        if self.level == "O2":
            for k in sd:  # Apex's O2StateDictHook: fp16 entries as fp32
                if sd[k].dtype == torch.float16:
                    sd[k] = sd[k].float()
        amp = OrderedDict(loss_scaler0={"loss_scale": self.scale, "unskipped": self.unskipped})
        return {"epoch": epoch, "model": sd, "optimizer": self.opt.state_dict(), "amp": amp}

    def results(self, tag, losses, scales, skipped):
        out = {f"{tag}/loss": torch.stack(losses), f"{tag}/scale": torch.tensor(scales, dtype=torch.float64),
               f"{tag}/skipped": torch.tensor(skipped, dtype=torch.uint8)}
        for n, t in self.model.state_dict().items():
            if not n.endswith("num_batches_tracked"):
                out[f"{tag}/final/{n}"] = t.detach().clone()
        for n, p in self.model.named_parameters():
            if self.stepped[n] is not p:
                out[f"{tag}/master/{n}"] = self.stepped[n].detach().clone()
        for n, p in self.stepped.items():
            for k, v in self.opt.state.get(p, {}).items():
                key = f"{tag}/step/{n}" if k == "step" else f"{tag}/state/{n}/{k}"
                out[key] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))
        return out


def continue_run(run, xs, ys, start, steps, tag):
    losses, scales, skipped = [], [], []
    for s in range(start, start + steps):
        loss, scale, sk = run.step(xs[s], ys[s], s == INJECT)
        losses.append(loss)
        scales.append(scale)
        skipped.append(1 if sk else 0)
    return run.results(tag, losses, scales, skipped)


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def write(out_dir):
    xs, ys = data()
    expected = {"x": xs, "y": ys}
    meta = {}
    for name, sc in SCENARIOS.items():
        run = Run(name)
        for s in range(K):
            run.step(xs[s], ys[s], s == INJECT)
        ckpt = run.checkpoint(epoch=1)
        zip_path, legacy_path = f"{out_dir}/{name}.zip.pt", f"{out_dir}/{name}.legacy.pt"
        torch.save(ckpt, zip_path)
        torch.save(ckpt, legacy_path, _use_new_zipfile_serialization=False)
        # The continuation, from each file as a Python script resumes it: the two must agree.
        conts = [continue_run(Run(name, torch.load(p, weights_only=True)), xs, ys, K, N, name)
                 for p in (zip_path, legacy_path)]
        assert same_tensors(conts[0], conts[1]), f"{name}: zip and legacy continuations differ"
        expected.update(conts[0])
        if sc["level"] == "O2":
            apex = Run(name, torch.load(zip_path, weights_only=True), rule="apex")
            expected[f"{name}/apex_state_error"] = torch.tensor(apex.state_error, dtype=torch.float64)
            expected.update(continue_run(apex, xs, ys, K, N, f"{name}/apex"))
        meta[name] = dict(level=sc["level"], opt=sc["opt"], kw=sc["kw"],
                          groups=[[names, kw] for names, kw in (sc["groups"] or [])])
        if name == "sgd_o0":
            # imagenet's main_amp.py layout from a DistributedDataParallel model ("module."
            # prefixes), without an amp entry.
            sd = OrderedDict((f"module.{k}", v) for k, v in ckpt["model"].items())
            torch.save({"epoch": 1, "arch": "mlp", "state_dict": sd, "best_prec1": 12.5,
                        "optimizer": ckpt["optimizer"]}, f"{out_dir}/{name}.main_amp.pth")
            # A checkpoint that also pickles the script's argparse.Namespace (a global
            # torch.load(weights_only=True) refuses, and so does tch-amp).
            torch.save(dict(ckpt, args=argparse.Namespace(lr=0.1, arch="mlp")), f"{out_dir}/with_args.pt")
            # A model state dict in fp16 (model.half().state_dict(), no Apex hook).
            half = dict(ckpt, model=OrderedDict((k, v.half() if v.is_floating_point() else v)
                                                for k, v in ckpt["model"].items()))
            torch.save(half, f"{out_dir}/{name}.half_model.pt")
    save_file(expected, f"{out_dir}/expected.safetensors",
              metadata={"scenarios": json.dumps(meta), "torch": torch.__version__,
                        "steps": json.dumps(dict(K=K, M=M, N=N, inject=INJECT, inject_factor=INJECT_FACTOR))})


def resume(name, ckpt_path, out, start):
    ckpt = torch.load(ckpt_path, weights_only=True)
    sc = SCENARIOS[name]
    # The layout a Python script reads: the optimizer's groups hold the keys torch.optim's own
    # state_dict has (plus param_names), the amp entry Apex's keys.
    fresh = Run(name).opt.state_dict()["param_groups"]
    for g, f in zip(ckpt["optimizer"]["param_groups"], fresh, strict=True):
        assert set(g) - {"param_names"} == set(f) - {"param_names"}, (sorted(g), sorted(f))
    assert set(ckpt["amp"]["loss_scaler0"]) >= {"loss_scale", "unskipped"}, ckpt["amp"]
    run = Run(name, ckpt)
    xs, ys = data()
    save_file(continue_run(run, xs, ys, start, N, "resume"), out)


class Block(nn.Module):
    """examples/common/model.rs's BasicBlock (conv-bn-relu-conv-bn plus a 1x1 conv-bn shortcut)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, 0, bias=False) if stride != 1 or cin != cout else None
        self.shortcut_bn = nn.BatchNorm2d(cout) if self.shortcut is not None else None

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        s = x if self.shortcut is None else self.shortcut_bn(self.shortcut(x))
        return F.relu(y + s)


class SmallResNet(nn.Module):
    """examples/common/model.rs's SmallResNet (pool 1), the parameter names of the Rust model."""

    def __init__(self, width, stages, classes):
        super().__init__()
        c = width
        self.stem = nn.Conv2d(1, c, 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(c)
        for i in range(stages):
            cout = c if i == 0 else 2 * c
            setattr(self, f"block{i}", Block(c, cout, 2))
            c = cout
        self.stages = stages
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        for i in range(self.stages):
            x = getattr(self, f"block{i}")(x)
        return self.fc(x.mean((2, 3)))


def imagenet(out, width, stages, classes, label):
    """A checkpoint in Apex's examples/imagenet/main_amp.py layout, for examples/imagenet.rs's
    --resume (tests/examples.rs): {'epoch': 1, 'arch', 'state_dict' (of the DDP-wrapped model:
    'module.' prefixes), 'best_prec1', 'optimizer' (SGD, momentum 0.9, weight decay 1e-4, as
    main_amp.py), 'amp' (loss scale 1024, 7 unskipped)}, in the legacy container (torch < 1.6,
    what most main_amp.py runs wrote). Two SGD steps on random 28x28 images give the optimizer
    momentum buffers; then fc's weight is zeroed and its bias set to 5 at class LABEL, so the
    resumed model predicts LABEL for every image (Prec@1 = the share of LABEL in the test set,
    mean loss = log(e^5 + classes - 1) - 5 * that share)."""
    torch.manual_seed(0)
    model = SmallResNet(width, stages, classes)
    opt = torch.optim.SGD(model.parameters(), 0.025, momentum=0.9, weight_decay=1e-4)
    for _ in range(2):
        x, y = torch.rand(8, 1, 28, 28), torch.randint(0, classes, (8,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.zero_()
        model.fc.bias[label] = 5.0
    sd = OrderedDict((f"module.{k}", v) for k, v in model.state_dict().items())
    amp = OrderedDict(loss_scaler0={"loss_scale": 1024.0, "unskipped": 7})
    torch.save({"epoch": 1, "arch": "small_resnet", "state_dict": sd, "best_prec1": 10.0,
                "optimizer": opt.state_dict(), "amp": amp}, out, _use_new_zipfile_serialization=False)


def main():
    torch.set_num_threads(1)
    cmd = sys.argv[1]
    if cmd == "write":
        write(sys.argv[2])
    elif cmd == "resume":
        resume(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif cmd == "imagenet":
        imagenet(sys.argv[2], *map(int, sys.argv[3:7]))
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()

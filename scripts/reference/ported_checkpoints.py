"""The checkpoint logic of two real training scripts, for the tests that move their checkpoints
between Python and the Rust ports (tests/torch_checkpoint.rs `nanogpt_*`, tests/amp/bert_lamb.rs
`bert_*`). torch 2.13 on CPU, one intra-op thread.

    python ported_checkpoints.py nanogpt write DIR
    python ported_checkpoints.py nanogpt resume CKPT OUT
    python ported_checkpoints.py bert write DIR
    python ported_checkpoints.py bert resume CKPT OUT

`write` runs the script uninterrupted from a fresh model for K + N iterations, saving its
checkpoint at iteration K the way the script saves it (DIR/nanogpt.pt, DIR/ckpt_<K>.pt for BERT), and records iterations
K .. K+N and the state after them in DIR/<script>.expected.safetensors ("run/..."). `resume`
resumes CKPT (written by the Rust port at some iteration) with the script's own resume code and
records N iterations from there in OUT ("resume/..."). The Rust tests compare the other side's
records with their own run bit for bit.

nanoGPT (karpathy/nanoGPT, train.py + model.py): a small GPT (vocab 64, block 16, 2 layers, 2
heads, 32 channels, biases, no dropout) built as model.py builds it (the token embedding tied to
lm_head), AdamW over its two groups (`configure_optimizers`: weight decay 0.1 for every parameter
of dim >= 2, 0.0 for the others; betas (0.9, 0.95)), torch.amp autocast in fp16 with a GradScaler
(train.py's `dtype='float16'` path, on CPU), 2 micro-batches of gradient accumulation, gradient
clipping at 1.0 after `scaler.unscale_`, the cosine LR schedule with warmup. The checkpoint is
train.py's `{'model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss', 'config'}` with the
model state dict of the `torch.compile`d model (keys behind `_orig_mod.`, as OptimizedModule's
state_dict writes them; compiling itself needs a C++ toolchain and is not what is tested) plus
`'scaler': scaler.state_dict()`, the line torch's AMP examples add. The resume is train.py's
(`unwanted_prefix` stripped, strict `model.load_state_dict`, `optimizer.load_state_dict`) plus
`scaler.load_state_dict`. The loss of iterations 3 and 14 is multiplied by 2^16 before scaling,
so their gradients overflow: the step is skipped and the scale halves (the checkpoint carries a
halved scale).

BERT (NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/run_pretraining.py, the last
version with Apex): the BERT-like block of tests/amp/bert_lamb.rs, FusedLAMB over run_pretraining's
two groups (`no_decay = ['bias', 'gamma', 'beta', 'LayerNorm']`: weight decay 0.01 and 0.0), Apex
O2 done by hand as Apex does it (an fp16 model, fp32 masters stepped by the optimizer, floating
inputs to fp16 and the output to fp32, dynamic loss scaling starting at `init_loss_scale` =
1024, which run_pretraining.py sets with `amp._amp_state.loss_scalers[0]._loss_scale`), the
PolyWarmUpScheduler of its schedulers.py (its LR reads the optimizer's group step, Apex's
`group['step']`). FusedLAMB is Apex's class (its constructor's defaults and group keys, the
group step, `max_grad_norm` read from the optimizer's defaults) whose arithmetic is the
reference of apex_optim_fixtures.py (Apex's kernels need a GPU). The checkpoint is
run_pretraining.py's `{'model', 'optimizer', 'master params': list(amp.master_params(optimizer)),
'files', 'epoch', 'data_loader'}` (the model state dict as Apex's O2 hook returns it: fp32 copies
of the fp16 model); the resume is its own (the optimizer state loaded onto the masters, then
`zip(amp.master_params(optimizer), checkpoint['master params'])` copied into them). The loss of
iteration 13 is multiplied by 2^20: that step overflows and is skipped.
"""
import math
import os
import sys
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from apex_optim_fixtures import fused_lamb  # noqa: E402

K, N = 6, 20  # iterations before Python's checkpoint, iterations compared
LAST = 34  # data for iterations 0 .. LAST (the Rust port saves its own checkpoint after K + 4)

# ---------------------------------------------------------------------------------------------
# nanoGPT

GPT_ARGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, bias=True, vocab_size=64, dropout=0.0)
BATCH, ACCUM = 4, 2
LEARNING_RATE, MIN_LR, WARMUP_ITERS, LR_DECAY_ITERS = 1e-3, 1e-4, 4, 60
WEIGHT_DECAY, BETAS, GRAD_CLIP = 0.1, (0.9, 0.95), 1.0
GPT_OVERFLOW = (3, 14)


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.ln_1 = LayerNorm(a["n_embd"], a["bias"])
        self.attn = CausalSelfAttention(a["n_embd"], a["n_head"], a["bias"])
        self.ln_2 = LayerNorm(a["n_embd"], a["bias"])
        self.mlp = Mlp(a["n_embd"], a["bias"])

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(a["vocab_size"], a["n_embd"]),
            wpe=nn.Embedding(a["block_size"], a["n_embd"]),
            drop=nn.Dropout(a["dropout"]),
            h=nn.ModuleList([Block(a) for _ in range(a["n_layer"])]),
            ln_f=LayerNorm(a["n_embd"], a["bias"]),
        ))
        self.lm_head = nn.Linear(a["n_embd"], a["vocab_size"], bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * a["n_layer"]))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)  # fused only on CUDA


def get_lr(it):
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    if it > LR_DECAY_ITERS:
        return MIN_LR
    decay_ratio = (it - WARMUP_ITERS) / (LR_DECAY_ITERS - WARMUP_ITERS)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return MIN_LR + coeff * (LEARNING_RATE - MIN_LR)


def gpt_data():
    g = torch.Generator().manual_seed(1337)
    shape = (LAST, ACCUM, BATCH, GPT_ARGS["block_size"])
    return torch.randint(0, GPT_ARGS["vocab_size"], shape, generator=g), \
        torch.randint(0, GPT_ARGS["vocab_size"], shape, generator=g)


class GptRun:
    """train.py's objects and its loop body."""

    def __init__(self, model):
        self.model = model
        self.optimizer = model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS)
        self.scaler = torch.amp.GradScaler("cpu", enabled=True)
        self.ctx = torch.amp.autocast(device_type="cpu", dtype=torch.float16)
        self.rec = {"loss": [], "lr": [], "norm": [], "scale": [], "tracker": []}

    def iteration(self, it, xs, ys):
        lr = get_lr(it)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        losses = []
        for micro_step in range(ACCUM):
            with self.ctx:
                _, loss = self.model(xs[it, micro_step], ys[it, micro_step])
                loss = loss / ACCUM
            losses.append(loss.detach().clone())
            if it in GPT_OVERFLOW and micro_step == 0:
                loss = loss * 2.0**16
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.rec["loss"].append(torch.stack(losses))
        self.rec["lr"].append(torch.tensor(lr, dtype=torch.float64))
        self.rec["norm"].append(norm.detach().clone().float())
        self.rec["scale"].append(self.scaler._scale.detach().clone())
        self.rec["tracker"].append(self.scaler._growth_tracker.detach().clone())

    def results(self, tag):
        out = {f"{tag}/{k}": torch.stack(v) for k, v in self.rec.items()}
        for n, p in self.model.named_parameters():
            out[f"{tag}/final/{n}"] = p.detach().clone()
            for k, v in self.optimizer.state[p].items():
                out[f"{tag}/state/{n}/{k}"] = v.detach().clone()
        return out


def nanogpt_write(out_dir):
    torch.manual_seed(1337)
    xs, ys = gpt_data()
    run = GptRun(GPT(GPT_ARGS))
    best_val_loss = 1e9
    for it in range(K + N):
        if it == K:
            sd = OrderedDict(("_orig_mod." + k, v) for k, v in run.model.state_dict().items())
            checkpoint = {
                "model": sd,
                "optimizer": run.optimizer.state_dict(),
                "model_args": dict(GPT_ARGS),
                "iter_num": it,
                "best_val_loss": best_val_loss,
                "config": {"learning_rate": LEARNING_RATE, "weight_decay": WEIGHT_DECAY, "dtype": "float16",
                           "grad_clip": GRAD_CLIP, "gradient_accumulation_steps": ACCUM},
                "scaler": run.scaler.state_dict(),
            }
            torch.save(checkpoint, f"{out_dir}/nanogpt.pt")
            run.rec = {k: [] for k in run.rec}
        run.iteration(it, xs, ys)
    out = run.results("run")
    out["data/x"], out["data/y"] = xs, ys
    save_file(out, f"{out_dir}/nanogpt.expected.safetensors")


def nanogpt_resume(ckpt_path, out):
    checkpoint = torch.load(ckpt_path, map_location="cpu")  # weights_only=True, torch's default
    model_args = dict(GPT_ARGS)
    for k in ["n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"]:
        model_args[k] = checkpoint["model_args"][k]
    torch.manual_seed(0)  # a fresh model: every value comes from the checkpoint
    model = GPT(model_args)
    state_dict = checkpoint["model"]
    unwanted_prefix = "_orig_mod."
    for k, v in list(state_dict.items()):
        if k.startswith(unwanted_prefix):
            state_dict[k[len(unwanted_prefix):]] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    iter_num = checkpoint["iter_num"]
    run = GptRun(model)
    run.optimizer.load_state_dict(checkpoint["optimizer"])
    run.scaler.load_state_dict(checkpoint["scaler"])
    assert [g["weight_decay"] for g in run.optimizer.param_groups] == [WEIGHT_DECAY, 0.0]
    xs, ys = gpt_data()
    for it in range(iter_num, iter_num + N):
        run.iteration(it, xs, ys)
    save_file(run.results("resume"), out)


# ---------------------------------------------------------------------------------------------
# BERT (run_pretraining.py, Apex O2, FusedLAMB)

VOCAB, HIDDEN, HEADS, SEQ, BERT_BATCH = 24, 16, 2, 8, 8
BASE_LR, WARMUP, TOTAL_STEPS = 2e-2, 0.2, 100
INIT_LOSS_SCALE, BERT_OVERFLOW = 1024.0, 13


class SelfAttention(nn.Module):
    def __init__(s):
        super().__init__()
        s.query = nn.Linear(HIDDEN, HIDDEN)
        s.key = nn.Linear(HIDDEN, HIDDEN)
        s.value = nn.Linear(HIDDEN, HIDDEN)


class DenseNorm(nn.Module):
    def __init__(s, din):
        super().__init__()
        s.dense = nn.Linear(din, HIDDEN)
        s.LayerNorm = nn.LayerNorm(HIDDEN)


class Attention(nn.Module):
    def __init__(s):
        super().__init__()
        s.self = SelfAttention()
        s.output = DenseNorm(HIDDEN)


class Embeddings(nn.Module):
    def __init__(s):
        super().__init__()
        s.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        s.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        s.LayerNorm = nn.LayerNorm(HIDDEN)


class Intermediate(nn.Module):
    def __init__(s):
        super().__init__()
        s.dense = nn.Linear(HIDDEN, 4 * HIDDEN)


class BertBlock(nn.Module):
    """tests/amp/bert_lamb.rs's model, module for module."""

    def __init__(s):
        super().__init__()
        s.embeddings = Embeddings()
        s.attention = Attention()
        s.intermediate = Intermediate()
        s.output = DenseNorm(4 * HIDDEN)
        s.cls = nn.Linear(HIDDEN, VOCAB)

    def forward(s, ids, mask):
        b, t = ids.shape
        pos = torch.arange(t)
        e = s.embeddings
        x = e.LayerNorm(e.word_embeddings(ids) + e.position_embeddings(pos))
        a = s.attention

        def heads(y):
            return y.view(b, t, HEADS, HIDDEN // HEADS).transpose(1, 2)

        q, k, v = heads(a.self.query(x)), heads(a.self.key(x)), heads(a.self.value(x))
        scores = q.matmul(k.transpose(-1, -2)) / math.sqrt(HIDDEN // HEADS) + mask
        ctx = torch.softmax(scores, -1, dtype=scores.dtype).matmul(v).transpose(1, 2).contiguous().view(b, t, HIDDEN)
        x = a.output.LayerNorm(a.output.dense(ctx) + x)
        h = s.output.dense(F.gelu(s.intermediate.dense(x)))
        x = s.output.LayerNorm(h + x)
        return s.cls(x)


class FusedLAMB(torch.optim.Optimizer):
    """apex.optimizers.FusedLAMB's Python side (constructor, defaults, group keys, group step,
    `max_grad_norm` from the defaults) with apex_optim_fixtures.py's arithmetic."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb

    # The reference's interface.
    @property
    def groups(self):
        return self.param_groups

    @property
    def options(self):
        return dict(adam_w_mode=self.adam_w_mode, use_nvlamb=self.use_nvlamb,
                    max_grad_norm=self.defaults["max_grad_norm"])

    def params_with_grad(self, g):
        return [p for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = 1
        fused_lamb(self)


def poly_warmup_lr(optimizer):
    """schedulers.py's PolyWarmUpScheduler.step(): the optimizer's group step + 1."""
    group = optimizer.param_groups[0]
    last_epoch = group["step"] + 1 if "step" in group else 1
    progress = last_epoch / TOTAL_STEPS
    if progress < WARMUP:
        return BASE_LR * progress / WARMUP
    return BASE_LR * ((1.0 - progress) ** 0.5)


def bert_batch(step):
    ids = ((torch.arange(BERT_BATCH * SEQ) * 7 + step * 5) % VOCAB).view(BERT_BATCH, SEQ)
    target = (ids + 1) % VOCAB
    mask = torch.zeros(BERT_BATCH, 1, 1, SEQ)
    mask[..., SEQ - 1] = -10000.0
    return ids, mask, target


class BertRun:
    """run_pretraining.py's objects after amp.initialize(opt_level="O2"), by hand."""

    def __init__(self, model):
        self.model = model.half()  # O2: every module in fp16 (no batch norm here)
        param_optimizer = list(self.model.named_parameters())
        no_decay = ["bias", "gamma", "beta", "LayerNorm"]
        # Apex's lazy init: fp32 masters replace the fp16 parameters in the optimizer.
        self.master = OrderedDict((n, p.detach().clone().float().requires_grad_(True)) for n, p in param_optimizer)
        groups = [
            {"params": [self.master[n] for n, _ in param_optimizer if not any(nd in n for nd in no_decay)],
             "weight_decay": 0.01},
            {"params": [self.master[n] for n, _ in param_optimizer if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        self.optimizer = FusedLAMB(groups, lr=BASE_LR)
        self.scale, self.unskipped = INIT_LOSS_SCALE, 0  # loss_scalers[0]._loss_scale = init_loss_scale
        self.rec = {"loss": [], "lr": [], "scale": [], "skipped": []}

    def master_params(self):
        """amp.master_params(optimizer)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def iteration(self, step):
        ids, mask, target = bert_batch(step)
        logits = self.model(ids, mask.half()).float()  # O2's patched forward
        loss = F.nll_loss(torch.log_softmax(logits.view(-1, VOCAB), -1, dtype=torch.float32), target.view(-1))
        user = loss * 2.0**20 if step == BERT_OVERFLOW else loss
        scale = self.scale
        (user.float() * scale).backward()  # with amp.scale_loss(loss, optimizer) as s: s.backward()
        overflow = False
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if not bool(torch.isfinite(p.grad).all()):
                    overflow = True
                mg = torch.empty_like(self.master[n])
                mg.copy_(p.grad)
                mg.mul_(1.0 / scale)
                self.master[n].grad = mg
        if overflow:
            self.scale, self.unskipped = scale / 2.0, 0
        else:
            self.unskipped += 1
        lr = poly_warmup_lr(self.optimizer)  # scheduler.step()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if not overflow:  # Amp skips the step after an overflow
            self.optimizer.step()
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    p.copy_(self.master[n])
        for p in self.model.parameters():
            p.grad = None
        for p in self.master.values():
            p.grad = None
        self.rec["loss"].append(loss.detach().clone())
        self.rec["lr"].append(torch.tensor(lr, dtype=torch.float64))
        self.rec["scale"].append(torch.tensor(scale, dtype=torch.float64))
        self.rec["skipped"].append(torch.tensor(int(overflow), dtype=torch.uint8))

    def results(self, tag):
        out = {f"{tag}/{k}": torch.stack(v) for k, v in self.rec.items()}
        for n, p in self.model.named_parameters():
            out[f"{tag}/final/{n}"] = p.detach().clone()
            out[f"{tag}/master/{n}"] = self.master[n].detach().clone()
            for k, v in self.optimizer.state[self.master[n]].items():
                out[f"{tag}/state/{n}/{k}"] = v.detach().clone()
        out[f"{tag}/group_step"] = torch.tensor([g["step"] for g in self.optimizer.param_groups])
        return out

    def checkpoint(self, epoch):
        sd = self.model.state_dict()
        for k in sd:  # Apex's O2StateDictHook: fp16 entries as fp32
            if sd[k].dtype == torch.float16:
                sd[k] = sd[k].float()
        return {"model": sd, "optimizer": self.optimizer.state_dict(),
                "master params": list(self.master_params()), "files": [epoch, "shard_0.hdf5"], "epoch": epoch,
                "data_loader": None}


def bert_write(out_dir):
    torch.manual_seed(42)
    run = BertRun(BertBlock())
    for step in range(K + N):
        if step == K:
            torch.save(run.checkpoint(0), f"{out_dir}/ckpt_{step}.pt")
            run.rec = {k: [] for k in run.rec}
        run.iteration(step)
    save_file(run.results("run"), f"{out_dir}/bert.expected.safetensors")


def bert_resume(ckpt_path, out):
    checkpoint = torch.load(ckpt_path, map_location="cpu")
    torch.manual_seed(0)
    model = BertBlock()
    model.load_state_dict(checkpoint["model"], strict=False)
    run = BertRun(model)  # amp.initialize: the model to fp16, masters from it
    # The optimizer state onto the masters, then the masters from 'master params'.
    run.optimizer.load_state_dict(checkpoint["optimizer"])
    assert [g["weight_decay"] for g in run.optimizer.param_groups] == [0.01, 0.0]
    with torch.no_grad():
        for param, saved_param in zip(run.master_params(), checkpoint["master params"], strict=True):
            param.data.copy_(saved_param.data)
    # run_pretraining.py takes the global step from the file's name, ckpt_<global_step>.pt.
    global_step = int(os.path.basename(ckpt_path).split(".pt")[0].split("_")[1].strip())
    for step in range(global_step, global_step + N):
        run.iteration(step)
    save_file(run.results("resume"), out)


def main():
    torch.set_num_threads(1)
    script, cmd = sys.argv[1], sys.argv[2]
    if (script, cmd) == ("nanogpt", "write"):
        nanogpt_write(sys.argv[3])
    elif (script, cmd) == ("nanogpt", "resume"):
        nanogpt_resume(sys.argv[3], sys.argv[4])
    elif (script, cmd) == ("bert", "write"):
        bert_write(sys.argv[3])
    elif (script, cmd) == ("bert", "resume"):
        bert_resume(sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(f"unknown command {script} {cmd}")


if __name__ == "__main__":
    main()

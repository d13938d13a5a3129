"""Real-world LightningModules for ``tests/realworld_cases.py``: one small case per pattern of user code that reaches
parameters or gradients between optimizer steps.

Each case is a builder decorated with :func:`case`; it returns a :class:`Spec` (model, data, trainer kwargs,
callbacks, extra state to compare). Builders are called after ``pl.seed_everything(0)``, once per fit, so every
fit starts from the same weights and data. The docstring of each builder names the public code it is modelled
on (written anew here, tiny: a few thousand parameters, 96 samples, batch 8, 2-3 epochs).
"""

from __future__ import annotations

import copy
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (BackboneFinetuning, Callback, EMAWeightAveraging, LambdaCallback,
                                         StochasticWeightAveraging, WeightAveraging)
from lightning.pytorch.utilities import grad_norm

N, BATCH, D, C = 96, 8, 16, 4


# ------------------------------------------------------------------------------------------------ plumbing
@dataclass
class Spec:
    model: pl.LightningModule
    train: DataLoader
    val: Optional[DataLoader] = None
    trainer_kw: dict = field(default_factory=dict)
    callbacks: list = field(default_factory=list)
    # extra tensors to compare besides model.state_dict() (EMA model, target network, recorded values, ...)
    extra: Optional[Callable[["Spec"], dict[str, torch.Tensor]]] = None
    # extra JSON-able facts reported per run (e.g. per-rank control flow), not compared
    info: Optional[Callable[["Spec"], dict]] = None


@dataclass
class Case:
    name: str
    build: Callable[[], Spec]
    doc: str
    ref: str = "ddp"  # "ddp", "ddp_find_unused_parameters_true" or "union" (single process, union batches)
    epochs: int = 3
    kind: str = "parity"  # "parity" | "refusal_ok" (matching DDP or a ValueError naming `param` both pass)
    param: str = ""  # refusal_ok: the parameter name the error must contain
    skip: Optional[Callable[[], Optional[str]]] = None  # returns a reason to skip, measured at run time
    variants: Optional[list[str]] = None  # default: the harness's PIPEDAP_VARIANTS ("default", "dear", "switching")
    extra_variants: list[str] = field(default_factory=list)  # judged too, run besides ``variants``
    info_variants: list[str] = field(default_factory=list)  # run once, reported, not judged
    # state keys (substrings) that DDP itself keeps per rank (state updated in forward from the rank's own batch):
    # compared per rank with the reference's same rank, left out of the cross-rank replica check
    rank_local: tuple[str, ...] = ()
    # what the "switching" variants must show in every run (tests/test_realworld_parity.py): by default every candidate
    # installed in turn (>= 3 candidates, DDP's reducer among them, >= 3 windows measured); a case where that cannot
    # be says why in `no_torch_ddp` and sets the switches it must show in `min_switches`
    min_switches: Optional[int] = None
    no_torch_ddp: str = ""
    # steps at which the ranks took different control flow in the reference run (info "called"), asserted when set
    per_rank_steps: Optional[int] = None
    # why the shard_optimizer variants (``*_shard``) are not run for this case; empty: they run and are judged as the
    # others (manual optimization included: sharded in sync mode)
    no_shard: str = ""


CASES: dict[str, Case] = {}


def case(name: str, **kw: Any) -> Callable:
    def deco(fn: Callable[[], Spec]) -> Callable[[], Spec]:
        CASES[name] = Case(name=name, build=fn, doc=" ".join((fn.__doc__ or "").split()), **kw)
        return fn

    return deco


class Recorder:
    """Mixin: ``self.record(key, value)`` keeps per-step floats; exported as ``rec/<key>`` tensors and compared."""

    def record(self, key: str, value: Any) -> None:
        if not hasattr(self, "_rec"):
            self._rec = defaultdict(list)
        v = (value.detach().double().reshape(-1) if torch.is_tensor(value)
             else torch.tensor([float(value)], dtype=torch.float64))
        self._rec[key].append(v.clone())

    def records(self) -> dict[str, torch.Tensor]:
        return {f"rec/{k}": torch.cat(v) for k, v in getattr(self, "_rec", {}).items()}


def _records(spec: Spec) -> dict[str, torch.Tensor]:
    out = spec.model.records() if isinstance(spec.model, Recorder) else {}
    for cb in spec.callbacks:
        if isinstance(cb, Recorder):
            out.update({f"cb.{k}": v for k, v in cb.records().items()})
    return out


def classification(n: int = N, d: int = D, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


def sequences(n: int = N, t: int = 6, d: int = D, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, d, generator=g)
    y = (x[:, :, :4].sum((1, 2)) > 0).long() + 2 * (x[:, 0, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


def tokens(n: int = N, t: int = 8, vocab: int = 32, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    # a learnable rule (next token = (token * 3 + 1) mod vocab, with noise) on random starts
    x = torch.randint(0, vocab, (n, t + 1), generator=g)
    for i in range(1, t + 1):
        keep = torch.rand(n, generator=g) < 0.8
        x[keep, i] = (x[keep, i - 1] * 3 + 1) % vocab
    return TensorDataset(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def images(n: int = N, c: int = 3, hw: int = 8, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, hw, hw, generator=g)
    y = (x[:, 0, :4].mean((1, 2)) > 0).long() + 2 * (x[:, 1, :, :4].mean((1, 2)) > 0).long()
    return TensorDataset(x, y)


def loader(ds, shuffle: bool = True) -> DataLoader:
    return DataLoader(ds, batch_size=BATCH, shuffle=shuffle)


class Classifier(pl.LightningModule):
    """Shared classification steps: cross-entropy on ``self(x)``; validation logs val_loss."""

    lr = 1e-2

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class MLP(Classifier):
    def __init__(self, d: int = D, h: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, C))

    def forward(self, x):
        return self.net(x)


# ------------------------------------------------------------------------------------------------ 1-3 attention
class MHAClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.attn = nn.MultiheadAttention(D, num_heads=2, batch_first=True)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = self.proj(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + a).mean(1))


@case("mha")
def build_mha() -> Spec:
    """torch.nn.MultiheadAttention called directly (self-attention + residual + LayerNorm, mean-pooled head), as in
    the attention blocks of Lightning's course tutorials (Lightning-AI/tutorials,
    course_UvA-DL/05-transformers-and-MH-attention) and torch's own nn.Transformer layers
    (pytorch/pytorch torch/nn/modules/activation.py, MultiheadAttention: in_proj_weight used functionally)."""
    return Spec(MHAClassifier(), loader(sequences()))


class EncoderClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=D, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = self.encoder(torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1))
        return self.head(h[:, 0])


class MHAFirst(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, num_heads=4)  # sequence-first, need_weights=True (torch's defaults)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        x = x.transpose(0, 1)  # (T, B, D)
        pad = torch.zeros(x.size(1), x.size(0), dtype=torch.bool)
        pad[:, -1] = True  # key_padding_mask: the last position is padding
        a, w = self.attn(x, x, x, key_padding_mask=pad)
        return self.head(a.mean(0)) + 0.0 * w.sum()


@case("mha_first_layer_defaults")
def build_mha_first() -> Spec:
    """nn.MultiheadAttention as the very first module with torch's defaults (sequence-first, need_weights=True, the
    averaged attention weights used) and a key_padding_mask, as in the PyTorch docs example of
    nn.MultiheadAttention (pytorch/pytorch torch/nn/modules/activation.py: attn_output, attn_output_weights =
    multihead_attn(query, key, value))."""
    return Spec(MHAFirst(), loader(sequences()))


@case("transformer_encoder")
def build_encoder() -> Spec:
    """nn.TransformerEncoder of 2 nn.TransformerEncoderLayer with a learned CLS token registered on the LightningModule
    (pattern of Lightning's docs/source-pytorch/starter/introduction.rst transformer examples and
    pytorch/examples word_language_model/model.py TransformerModel)."""
    return Spec(EncoderClassifier(), loader(sequences()))


@case("lightning_demo_transformer")
def build_demo_transformer() -> Spec:
    """Lightning's own demo: lightning.pytorch.demos.transformer.LightningTransformer (training_step with nll_loss,
    SGD lr=0.1) around demos.Transformer (nn.Transformer encoder+decoder, dropout 0.2, embedding, positional
    encoding), shrunk to vocab 32 / d_model 16, on a WikiText2-like random-token dataset (no download).
    Source: Lightning-AI/pytorch-lightning src/lightning/pytorch/demos/transformer.py."""
    from lightning.pytorch.demos.transformer import LightningTransformer, Transformer

    class TinyLightningTransformer(LightningTransformer):
        def __init__(self) -> None:
            pl.LightningModule.__init__(self)  # the demo's __init__ builds a 33k-vocab model; same code, tiny sizes
            self.model = Transformer(vocab_size=32, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.2)

        def prepare_data(self) -> None:  # the demo downloads WikiText2 here; the random-token data needs nothing
            pass

    return Spec(TinyLightningTransformer(), loader(tokens()))


# ----------------------------------------------------------------------------------------------- 4-5 functional weights
class Block(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(pl.LightningModule):
    def __init__(self, vocab: int = 32, block: int = 8, d: int = 16) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
                                              h=nn.ModuleList([Block(d)]), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x)
        return self.lm_head(self.transformer.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def configure_optimizers(self):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=3e-3, betas=(0.9, 0.95))


@case("nanogpt_tied")
def build_nanogpt() -> Spec:
    """nanoGPT: token embedding tied to the LM head (transformer.wte.weight = lm_head.weight), causal self-attention
    with F.scaled_dot_product_attention, AdamW with decay / no-decay groups by p.dim().
    Source: karpathy/nanoGPT model.py (GPT.__init__, configure_optimizers)."""
    return Spec(TinyGPT(), loader(tokens()))


class MuonGPT(TinyGPT):
    """TinyGPT trained as modded-nanogpt trains GPT-2: Muon for the hidden 2-D matrices of the blocks, AdamW for the
    embeddings (tied to the head), the norms and the biases; two optimizers, manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opts = self.optimizers()
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return loss

    def configure_optimizers(self):
        hidden = [p for p in self.transformer.h.parameters() if p.ndim == 2]
        ids = {id(p) for p in hidden}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return (torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=0.01),
                torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0))


@case("nanogpt_muon")
def build_nanogpt_muon() -> Spec:
    """nanoGPT's model trained with Muon for the blocks' hidden matrices and AdamW for the embeddings (tied head),
    norms and biases, stepped after one backward (manual optimization, two optimizers). Sources: KellerJordan/
    modded-nanogpt train_gpt.py (Muon for hidden matrices, Adam for embeddings/head/scalars), torch.optim.Muon's
    docstring (2-D parameters only), karpathy/nanoGPT model.py (the model)."""
    return Spec(MuonGPT(), loader(tokens()))


class ChildWeightLM(pl.LightningModule):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn_cell = nn.Linear(2 * d, d)
        self.out_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, idx):
        e = self.embed(idx)
        h = torch.zeros_like(e[:, 0])
        outs = []
        for t in range(idx.size(1)):
            h = torch.tanh(self.rnn_cell(torch.cat([e[:, t], h], -1)))
            outs.append(h)
        h = torch.stack(outs, 1)
        # output projection through the embedding's weight: the parent uses a child's parameter directly
        return F.linear(h, self.embed.weight, self.out_bias)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@case("parent_uses_child_weight")
def build_child_weight() -> Spec:
    """A parent module's forward reads a child's weight directly: the output layer is F.linear(h, self.embed.weight)
    after the embedding ran (tied input/output embeddings, Press & Wolf 2017, as in pytorch/examples
    word_language_model/model.py RNNModel with tie_weights and HF transformers' get_output_embeddings)."""
    return Spec(ChildWeightLM(), loader(tokens()))


class L2Functional(Classifier, Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 32)
        self.w = nn.Parameter(torch.randn(C, 32) * 0.1)  # used only functionally
        self.b = nn.Parameter(torch.zeros(C))

    def forward(self, x):
        return F.linear(torch.tanh(self.fc1(x)), self.w, self.b)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # regulariser read BEFORE the forward pass (the weights as of this step), as in many public training_steps
        reg = self.fc1.weight.pow(2).sum() + self.w.pow(2).sum()
        self.record("reg", reg)
        loss = F.cross_entropy(self(x), y) + 1e-2 * reg
        return loss


@case("l2_penalty_functional")
def build_l2() -> Spec:
    """Functional use of weights in training_step: an explicit L2 penalty self.fc1.weight.pow(2).sum() computed
    before calling the model, and a head applied with F.linear(x, self.w, self.b) on nn.Parameters of the
    LightningModule. Pattern from Lightning's docs (docs/source-pytorch/common/lightning_module.rst, training_step
    returning a loss built from several terms) and e.g. Lightning-Universe/lightning-bolts
    src/pl_bolts/models/regression/logistic_regression.py (L1/L2 penalties on self.linear.weight in training_step)."""
    return Spec(L2Functional(), loader(classification()))


# ----------------------------------------------------------------------------------------------- 6-7 gradients in hooks
class ClipOverride(MLP):
    lr = 0.5

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.05)


@case("clip_grad_norm_override")
def build_clip() -> Spec:
    """configure_gradient_clipping overridden to call torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
    directly (no Trainer gradient_clip_val). Source: the hook in Lightning-AI/pytorch-lightning
    src/lightning/pytorch/core/module.py (LightningModule.configure_gradient_clipping, "Implement your own custom
    logic to clip gradients") and public modules that call clip_grad_norm_ there."""
    return Spec(ClipOverride(), loader(classification()))


class GradNoise(MLP, Recorder):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def on_before_optimizer_step(self, optimizer):
        g = torch.Generator().manual_seed(1000 + self.global_step)  # same noise on every rank, reproducible
        std = 0.05 / (1 + self.global_step) ** 0.55  # annealed Gaussian gradient noise (Neelakantan et al. 2015)
        for n, p in self.named_parameters():
            if p.grad is not None:
                p.grad.add_(torch.randn(p.grad.shape, generator=g) * std)
                if n.endswith("bias"):
                    p.grad.mul_(0.5)  # per-parameter gradient scaling / masking
        self.record("noisy_grad_sum", sum(p.grad.double().sum() for p in self.parameters() if p.grad is not None))


@case("grad_write_before_optimizer_step")
def build_grad_noise() -> Spec:
    """.grad WRITTEN in on_before_optimizer_step: annealed Gaussian gradient noise and a per-parameter gradient
    scale (masking). Hook documented in Lightning-AI/pytorch-lightning src/lightning/pytorch/core/hooks.py
    (ModelHooks.on_before_optimizer_step); noise as in public "gradient noise" Lightning callbacks. The recorded
    sum of the noisy gradients is compared too (DDP sees the averaged gradients here)."""
    return Spec(GradNoise(), loader(classification()))


class GradNormLog(MLP, Recorder):
    def on_before_optimizer_step(self, optimizer):
        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)
        self.record("grad_2.0_norm_total", norms["grad_2.0_norm_total"])


@case("grad_norm_logging")
def build_grad_norm() -> Spec:
    """.grad READ in on_before_optimizer_step for logging: self.log_dict(grad_norm(self, norm_type=2)). Source:
    Lightning-AI/pytorch-lightning docs/source-pytorch/debug/debugging_intermediate.rst ("Compute the 2-norm for
    each layer") and lightning.pytorch.utilities.grad_norm. The logged total norm is compared with DDP's."""
    return Spec(GradNormLog(), loader(classification()))


class GradAccumNorm(MLP, Recorder):
    def on_before_optimizer_step(self, optimizer):
        self.record("grad_norm_total", grad_norm(self, norm_type=2)["grad_2.0_norm_total"])


@case("accumulate_grad_norm", min_switches=1,
      no_torch_ddp="accumulate_grad_batches=3: a switch would fall inside an accumulation window, so DDP's reducer is "
                   "not trialled; 6 optimizer steps leave room for the first window and the switch to the second")
def build_accum_norm() -> Spec:
    """accumulate_grad_batches=3 with a gradient-norm read in on_before_optimizer_step (called once per 3
    micro-batches, after accumulation; documented in src/lightning/pytorch/core/hooks.py). Pattern of
    Lightning docs docs/source-pytorch/advanced/training_tricks.rst (Accumulate Gradients) + grad_norm logging."""
    return Spec(GradAccumNorm(), loader(classification()), trainer_kw={"accumulate_grad_batches": 3})


class AfterBackward(MLP, Recorder):
    def on_after_backward(self):
        # skip-bad-step guard + gradient statistics, a common public on_after_backward
        finite = all(torch.isfinite(p.grad).all() for p in self.parameters() if p.grad is not None)
        if not finite:
            self.zero_grad()
        self.record("grad_abs_sum", sum(p.grad.abs().double().sum() for p in self.parameters() if p.grad is not None))


@case("on_after_backward_reads_grad")
def build_after_backward() -> Spec:
    """on_after_backward reading .grad (a NaN/Inf guard that zeroes the gradients and a gradient statistic).
    Hook: Lightning-AI/pytorch-lightning src/lightning/pytorch/core/hooks.py ModelHooks.on_after_backward; the
    guard is the common public 'skip step on non-finite gradients' snippet. Compared: the recorded statistic."""
    return Spec(AfterBackward(), loader(classification()))


# ------------------------------------------------------------------------------------------------ 8 BackboneFinetuning
class BackboneModel(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, C)

    def forward(self, x):
        return self.head(self.backbone(x))

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)


@case("backbone_finetuning", ref="union", info_variants=["ddp"])
def build_backbone() -> Spec:
    """lightning.pytorch.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1): the backbone is frozen in setup
    and unfrozen with optimizer.add_param_group at epoch 1; optimizer built with filter(requires_grad).
    Source: Lightning-AI/pytorch-lightning src/lightning/pytorch/callbacks/finetuning.py (BackboneFinetuning
    docstring example). Reference: single process on the union of both ranks' batches (DDP registers only the
    parameters trainable at wrap time, so its replicas drift; the 'ddp' info variant shows how much)."""
    return Spec(BackboneModel(), loader(classification()),
                callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5,
                                              backbone_initial_ratio_lr=0.1, verbose=False)])


@case("union_reference_check", ref="union", variants=["ddp"])
def build_union_check() -> Spec:
    """Check of the harness itself: on a plain model (no finetuning callback) the single-process union-batch
    reference equals DDP (SGD + momentum, mean loss)."""
    return Spec(BackboneModel(), loader(classification()))


# ------------------------------------------------------------------------------------------ 9-10 averaged / target nets
def _avg_extra(spec: Spec) -> dict[str, torch.Tensor]:
    out = {}
    for cb in spec.callbacks:
        if isinstance(cb, WeightAveraging) and cb._average_model is not None:
            out.update({f"averaged.{k}": v.detach().clone() for k, v in cb._average_model.state_dict().items()})
    return out


@case("ema_weight_averaging")
def build_ema() -> Spec:
    """lightning.pytorch.callbacks.EMAWeightAveraging(decay=0.9): an AveragedModel updated after every optimizer step
    (on_train_batch_end), swapped into the model for validation and copied into it at the end of training.
    Compared: the final model and the averaged model's parameters and buffers.
    Source: Lightning-AI/pytorch-lightning src/lightning/pytorch/callbacks/weight_averaging.py."""
    return Spec(MLP(), loader(classification()), loader(classification(), shuffle=False),
                trainer_kw={"val_check_interval": 3}, callbacks=[EMAWeightAveraging(decay=0.9)], extra=_avg_extra)


@case("weight_averaging_swa_avgfn")
def build_wa() -> Spec:
    """lightning.pytorch.callbacks.WeightAveraging with a custom avg_fn (equal-weight average, AveragedModel default)
    and should_update overridden to start after 4 steps, as in the class docstring example. Compared: final
    model and averaged model. Source: src/lightning/pytorch/callbacks/weight_averaging.py (WeightAveraging)."""

    class StartLate(WeightAveraging):
        def should_update(self, step_idx=None, epoch_idx=None):
            return step_idx is not None and step_idx >= 4

    return Spec(MLP(), loader(classification()), callbacks=[StartLate(use_buffers=True)], extra=_avg_extra)


@case("stochastic_weight_averaging")
def build_swa() -> Spec:
    """lightning.pytorch.callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1): SWALR takes over the
    learning rate and the averaged weights are copied into the model at the end.
    Source: Lightning-AI/pytorch-lightning src/lightning/pytorch/callbacks/stochastic_weight_avg.py."""
    return Spec(MLP(), loader(classification()),
                callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)])


class BYOLLike(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.online_network = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, 16))
        self.predictor = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.target_network = copy.deepcopy(self.online_network)
        for p in self.target_network.parameters():
            p.requires_grad = False

    def training_step(self, batch, batch_idx):
        x, _ = batch
        g = torch.Generator().manual_seed(batch_idx + 31 * self.current_epoch)
        v1 = x + 0.1 * torch.randn(x.shape, generator=g)
        v2 = x * (1 + 0.1 * torch.randn(x.shape, generator=g))
        p1, p2 = self.predictor(self.online_network(v1)), self.predictor(self.online_network(v2))
        with torch.no_grad():
            z1, z2 = self.target_network(v1), self.target_network(v2)
        loss = ((2 - 2 * F.cosine_similarity(p1, z2, dim=-1)).mean()
                + (2 - 2 * F.cosine_similarity(p2, z1, dim=-1)).mean())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(list(self.online_network.parameters()) + list(self.predictor.parameters()), lr=1e-2)


class BYOLMAWeightUpdate(Callback):
    def __init__(self, initial_tau: float = 0.9) -> None:
        self.initial_tau = self.current_tau = initial_tau

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            for po, pt in zip(pl_module.online_network.parameters(), pl_module.target_network.parameters()):
                pt.data = self.current_tau * pt.data + (1 - self.current_tau) * po.data
        max_steps = len(trainer.train_dataloader) * trainer.max_epochs
        self.current_tau = 1 - (1 - self.initial_tau) * (math.cos(math.pi * trainer.global_step / max_steps) + 1) / 2


@case("byol_momentum_target")
def build_byol() -> Spec:
    """A momentum target network (BYOL) updated from the online network in a callback's on_train_batch_end
    (target params requires_grad False, cosine tau schedule). Source: Lightning-Universe/lightning-bolts
    src/pl_bolts/callbacks/byol_updates.py (BYOLMAWeightUpdate) and src/pl_bolts/models/self_supervised/byol."""
    return Spec(BYOLLike(), loader(classification()), callbacks=[BYOLMAWeightUpdate()])


# ------------------------------------------------------------------------------------------------ 11 GAN
class Generator(nn.Module):
    def __init__(self, latent: int = 8, out: int = D) -> None:
        super().__init__()

        def block(i, o, normalize=True):
            layers = [nn.Linear(i, o)]
            if normalize:
                layers.append(nn.BatchNorm1d(o, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(*block(latent, 32, normalize=False), *block(32, 32), nn.Linear(32, out), nn.Tanh())

    def forward(self, z):
        return self.model(z)


class GAN(pl.LightningModule):
    def __init__(self, latent: int = 8) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.latent = latent
        self.generator = Generator(latent)
        self.discriminator = nn.Sequential(nn.Linear(D, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1))

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        real = torch.tanh(real)
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.size(0), self.latent)
        bce = F.binary_cross_entropy_with_logits
        # generator
        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self(z)), torch.ones(real.size(0), 1))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        # discriminator
        self.toggle_optimizer(opt_d)
        real_loss = bce(self.discriminator(real), torch.ones(real.size(0), 1))
        fake_loss = bce(self.discriminator(self(z).detach()), torch.zeros(real.size(0), 1))
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)))


@case("gan_manual_toggle", ref="ddp_find_unused_parameters_true", min_switches=0,
      no_torch_ddp="manual optimization runs in sync mode: no plan, no trials")
def build_gan() -> Spec:
    """Lightning's basic GAN: manual optimization, two Adam optimizers (betas 0.5, 0.999), toggle_optimizer /
    untoggle_optimizer around each manual_backward, BatchNorm1d(o, 0.8) + LeakyReLU blocks in the generator.
    Source: Lightning-AI/tutorials lightning_examples/basic-gan/gan.py and Lightning-AI/pytorch-lightning
    examples/pytorch/domain_templates/generative_adversarial_net.py."""
    return Spec(GAN(), loader(classification()))


# ------------------------------------------------------------------------------------------------ 12 torch.compile
def _compile_skip() -> Optional[str]:
    try:
        f = torch.compile(nn.Linear(4, 4))
        f(torch.randn(2, 4)).sum().backward()
        return None
    except Exception as exc:  # a broken toolchain on this machine, not the strategy
        return f"torch.compile does not work on this machine: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


class CompiledSub(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(D, 32)
        self.net = torch.compile(nn.Sequential(nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, C)))

    def forward(self, x):
        return self.net(self.stem(x))


@case("torch_compile_submodule", skip=_compile_skip)
def build_compile() -> Spec:
    """torch.compile of a submodule inside the LightningModule (self.net = torch.compile(nn.Sequential(...))).
    Source: Lightning-AI/pytorch-lightning docs/source-pytorch/advanced/compile.rst ("compile individual
    submodules")."""
    return Spec(CompiledSub(), loader(classification()))


# ----------------------------------------------------------------------------------------------- 13 timm-style backbone
class TinyViT(nn.Module):
    def __init__(self, patch: int = 4, d: int = 16, in_chans: int = 3, img: int = 8) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(in_chans, d, kernel_size=patch, stride=patch)
        n = (img // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        self.blocks = nn.Sequential(Block(d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1000)  # the classifier of the pretrained model: never used by forward_features

    def _pos_embed(self, x):
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], 1)
        return x + self.pos_embed

    def forward_features(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        return self.norm(self.blocks(self._pos_embed(x)))

    def forward(self, x):  # never called by the LightningModule
        return self.head(self.forward_features(x)[:, 0])


class TimmStyle(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = TinyViT()
        self.backbone.head.requires_grad_(False)
        self.classifier = nn.Linear(16, C)

    def forward(self, x):
        return self.classifier(self.backbone.forward_features(x)[:, 0])


@case("timm_forward_features")
def build_timm() -> Spec:
    """timm-style backbone whose own forward never runs: the LightningModule calls self.backbone.forward_features(x),
    which reads cls_token / pos_embed parameters registered on the backbone module itself (the backbone's
    1000-class head stays frozen and unused). Source: huggingface/pytorch-image-models
    timm/models/vision_transformer.py (VisionTransformer._pos_embed, forward_features)."""
    return Spec(TimmStyle(), loader(images()))


# ----------------------------------------------------------------------------------- 14 RL: net used in the data loader
class ToyEnv:
    """Deterministic 4-d 'cart' with 2 actions; reward for keeping the state small."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.reset()

    def reset(self):
        self.state = torch.randn(4, generator=self.g) * 0.5
        self.t = 0

    def step(self, action: int):
        push = 0.3 if action == 1 else -0.3
        s = self.state
        self.state = torch.stack([s[0] + 0.1 * s[1], s[1] + push - 0.1 * s[0],
                                  0.9 * s[2] + 0.1 * s[3], s[3] - 0.05 * s[2]])
        self.t += 1
        reward = float(1.0 - self.state.abs().mean())
        done = self.t >= 12 or bool(self.state.abs().max() > 3)
        return self.state.clone(), reward, done


class RLDataset(IterableDataset):
    def __init__(self, module: "DQNLike", steps: int = 6) -> None:
        self.module, self.steps = module, steps

    def __iter__(self) -> Iterator:
        m = self.module
        for _ in range(self.steps):
            for _ in range(BATCH):
                m.play_step()  # uses m.net(obs) under no_grad: the model OUTSIDE training_step
            idx = torch.randint(0, len(m.buffer), (BATCH,), generator=m.sample_g).tolist()
            s, a, r, d, s2 = zip(*(m.buffer[i] for i in idx))
            yield torch.stack(s), torch.tensor(a), torch.tensor(r), torch.tensor(d), torch.stack(s2)


class DQNLike(pl.LightningModule, Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
        self.target_net = copy.deepcopy(self.net)
        self.buffer: list = []
        self.env = None

    def setup(self, stage):
        rank = self.trainer.global_rank
        self.env = ToyEnv(seed=100 + rank)
        self.act_g = torch.Generator().manual_seed(200 + rank)
        self.sample_g = torch.Generator().manual_seed(300 + rank)
        for _ in range(16):  # populate with a random policy
            self.play_step(epsilon=1.0)

    @torch.no_grad()
    def play_step(self, epsilon: Optional[float] = None):
        if epsilon is None:
            epsilon = max(0.05, 1.0 - self.global_step / 10)
        s = self.env.state.clone()
        if torch.rand(1, generator=self.act_g).item() < epsilon:
            a = int(torch.randint(0, 2, (1,), generator=self.act_g))
        else:
            q = self.net(s.unsqueeze(0))
            self.record("q_played", q.max())
            a = int(q.argmax())
        s2, r, done = self.env.step(a)
        self.buffer.append((s, a, r, done, s2))
        if done:
            self.env.reset()

    def training_step(self, batch, batch_idx):
        s, a, r, d, s2 = batch
        q = self.net(s).gather(1, a.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            nxt = self.target_net(s2).max(1)[0]
            nxt[d] = 0.0
        loss = F.mse_loss(q, r + 0.9 * nxt)
        if self.global_step % 4 == 0:
            self.target_net.load_state_dict(self.net.state_dict())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(RLDataset(self), batch_size=None, num_workers=0)


@case("rl_dataloader_uses_net", ref="ddp_find_unused_parameters_true")
def build_dqn() -> Spec:
    """RL: an IterableDataset whose __iter__ plays the environment with self.net(obs) (epsilon-greedy, no_grad) to
    produce the next batch, so the model runs outside training_step between optimizer steps (Lightning fetches one
    batch ahead); target net synced by load_state_dict every 4 steps. Source: Lightning-AI/pytorch-lightning
    examples/pytorch/domain_templates/reinforce_learn_Qnet.py (RLDataset, Agent.play_step, DQNLightning);
    per-rank environments (seeded by rank). Compared: parameters and the recorded Q-values of played steps."""
    m = DQNLike()
    return Spec(m, None)  # train_dataloader() of the module


# ------------------------------------------------------------------------------------------------ 15 MoE
class Top1MoE(Classifier, Recorder):
    def __init__(self, experts: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(D, 16)
        self.gate = nn.Linear(16, experts, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
                                      for _ in range(experts)])
        self.head = nn.Linear(16, C)
        self.called: list[list[int]] = []

    def forward(self, x):
        h = self.inp(x)  # (B, T, 16)
        flat = h.reshape(-1, h.size(-1))
        probs = F.softmax(self.gate(flat), -1)
        w, idx = probs.max(-1)
        out = torch.zeros_like(flat)
        called = []
        for e, expert in enumerate(self.experts):
            sel = torch.where(idx == e)[0]
            if sel.numel() == 0:
                continue  # this expert gets no tokens on this rank in this step: its module is not called
            called.append(e)
            out.index_add_(0, sel, expert(flat[sel]) * w[sel, None])
        if self.training:
            self.called.append(called)
        return self.head((flat + out).view_as(h).mean(1))


@case("moe_top1_per_rank_routing", ref="ddp_find_unused_parameters_true")
def build_moe() -> Spec:
    """Top-1 mixture of experts: tokens routed by argmax of a softmax gate; an expert that receives no token is
    skipped (`if top_x.shape[0] == 0: continue`), so each rank calls a different set of expert modules in some
    steps. Source: huggingface/transformers src/transformers/models/mixtral/modeling_mixtral.py
    (MixtralSparseMoeBlock.forward) and Switch Transformers' top-1 router. Reported: steps where the ranks called
    different experts."""
    m = Top1MoE()
    return Spec(m, loader(sequences(t=2)), info=lambda s: {"called": s.model.called})


# ------------------------------------------------------------------------------------------------ 16 weight norm
class WN(Classifier):
    def __init__(self, legacy: bool) -> None:
        super().__init__()
        if legacy:
            from torch.nn.utils import weight_norm
        else:
            from torch.nn.utils.parametrizations import weight_norm
        self.fc1 = weight_norm(nn.Linear(D, 32))
        self.fc2 = weight_norm(nn.Linear(32, 32))
        self.out = nn.Linear(32, C)

    def forward(self, x):
        return self.out(F.leaky_relu(self.fc2(F.leaky_relu(self.fc1(x), 0.1)), 0.1))


@case("weight_norm_legacy_prehook")
def build_wn_legacy() -> Spec:
    """Legacy torch.nn.utils.weight_norm: a forward pre-hook registered by the user BEFORE the strategy's recomputes
    `weight` from weight_g / weight_v at every call. Source: jik876/hifi-gan models.py (weight_norm(Conv1d(...))
    in the generator / discriminators) and pytorch/pytorch torch/nn/utils/weight_norm.py."""
    return Spec(WN(legacy=True), loader(classification()))


@case("weight_norm_parametrization")
def build_wn_param() -> Spec:
    """New-style torch.nn.utils.parametrizations.weight_norm (parametrizations.weight.original0/original1 recombined
    on every access of .weight). Source: pytorch/pytorch torch/nn/utils/parametrizations.py and its use in
    e.g. huggingface/transformers wav2vec2 positional conv embedding."""
    return Spec(WN(legacy=False), loader(classification()))


# ------------------------------------------------------------------------------------------------ 17 LoRA
class LoRALinear(nn.Linear):
    def __init__(self, i: int, o: int, r: int = 4, alpha: int = 8) -> None:
        super().__init__(i, o)
        self.lora_A = nn.Parameter(torch.randn(r, i) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(o, r))
        self.scaling = alpha / r
        self.weight.requires_grad = False
        self.bias.requires_grad = False
        self.merged = False

    def train(self, mode: bool = True):
        super().train(mode)
        with torch.no_grad():
            if mode and self.merged:  # back to training: take the delta out of the base weight
                self.weight.data -= (self.lora_B @ self.lora_A) * self.scaling
                self.merged = False
            elif not mode and not self.merged:  # eval: merge the delta into the frozen base weight
                self.weight.data += (self.lora_B @ self.lora_A) * self.scaling
                self.merged = True
        return self

    def forward(self, x):
        if self.merged:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class LoRAModel(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = LoRALinear(D, 32)
        self.l2 = LoRALinear(32, 32)
        self.head = nn.Linear(32, C)

    def forward(self, x):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(x)))))

    def on_validation_model_train(self):
        # Lightning 2.6 restores the training flags after validation by assignment (module.training = mode), which
        # would leave the adapters merged; call train() so LoRALinear.train(True) un-merges (the documented hook)
        self.train()


@case("lora_merge_on_eval")
def build_lora() -> Spec:
    """LoRA adapter that merges B@A into the frozen base weight in train(False) and un-merges in train(True);
    Lightning calls model.eval() before the validation that val_check_interval=2 runs mid-epoch; the module's
    on_validation_model_train calls self.train() after it (Lightning 2.6 otherwise restores flags by assignment
    and the adapters would stay merged). Source: microsoft/LoRA loralib/layers.py (Linear.train with
    merge_weights); hooks in src/lightning/pytorch/core/hooks.py (on_validation_model_eval / _train)."""
    return Spec(LoRAModel(), loader(classification()), loader(classification(), shuffle=False),
                trainer_kw={"val_check_interval": 2})


# ------------------------------------------------------------------------------------------------ 18 torch.func PINN
class PINN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 1))

    def u(self, xt):  # one point (2,) -> scalar
        return self.net(xt).squeeze(-1)

    def training_step(self, batch, batch_idx):
        (xt,) = batch  # collocation points (B, 2): x in [-1, 1], t in [0, 1]
        jac = torch.func.vmap(torch.func.jacrev(self.u))(xt)  # (B, 2): du/dx, du/dt
        u = self.net(xt).squeeze(-1)
        residual = jac[:, 1] + u * jac[:, 0]  # inviscid Burgers: u_t + u u_x = 0
        x0 = xt.clone()
        x0[:, 1] = 0.0
        ic = self.net(x0).squeeze(-1) + torch.sin(math.pi * x0[:, 0])  # u(x, 0) = -sin(pi x)
        return residual.pow(2).mean() + ic.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=5e-3)


@case("pinn_torch_func")
def build_pinn() -> Spec:
    """Physics-informed loss with torch.func: vmap(jacrev(u)) of the network w.r.t. its input inside training_step
    (Burgers residual + initial condition). Source: rezaakb/pinns-torch (PINNs with Lightning) and the PyTorch
    tutorial pytorch/tutorials intermediate_source/jacobians_hessians.py (vmap(jacrev(...)) of a model)."""
    g = torch.Generator().manual_seed(7)
    xt = torch.stack([torch.rand(N, generator=g) * 2 - 1, torch.rand(N, generator=g)], 1)
    return Spec(PINN(), loader(TensorDataset(xt)))


# ------------------------------------------------------------------------------------------------ 19 sparse gradients
class SparseEmb(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16, sparse=True)
        self.head = nn.Linear(16, 32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(self.emb(x))
        return F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@case("sparse_embedding")
def build_sparse() -> Spec:
    """nn.Embedding(sparse=True) trained with SGD (one of the optimizers documented to accept sparse gradients):
    the sparse table is reduced as DDP reduces it (more cases in tests/test_sparse_grads.py). Source: pytorch/pytorch
    torch/nn/modules/sparse.py (Embedding docstring, sparse gradients with optim.SGD / SparseAdam) and public
    recommender LightningModules with sparse embeddings."""
    return Spec(SparseEmb(), loader(tokens()))


# ------------------------------------------------------------------------------------------------ 20+ other findings
class WarmupStep(MLP):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        # manually warm up lr without a scheduler (the docs' example, warm-up over 5 steps here)
        if self.trainer.global_step < 5:
            scale = min(1.0, float(self.trainer.global_step + 1) / 5.0)
            for pg in optimizer.param_groups:
                pg["lr"] = scale * 0.2


@case("optimizer_step_lr_warmup")
def build_warmup() -> Spec:
    """optimizer_step overridden to warm the learning rate up by hand after optimizer.step(closure=...). Source:
    Lightning-AI/pytorch-lightning docs/source-pytorch/common/optimization.rst ("Learning rate warm-up":
    lr_scale = min(1.0, float(self.trainer.global_step + 1) / 500.0))."""
    return Spec(WarmupStep(), loader(classification()))


class WeightLog(MLP, Recorder):
    def training_step(self, batch, batch_idx):
        w = self.net[0].weight.norm()  # read before the forward pass
        self.log("w0_norm", w)
        self.record("w0_norm", w)
        return super().training_step(batch, batch_idx)


@case("log_weight_norm_in_training_step")
def build_wlog() -> Spec:
    """self.log of a weight norm in training_step, read before the model is called (common monitoring code, e.g.
    public LightningModules logging self.layer.weight.norm()). Compared: parameters and the logged norms."""
    return Spec(WeightLog(), loader(classification()))


class HookReader(Callback, Recorder):
    def on_train_epoch_end(self, trainer, pl_module):
        self.record("epoch_param_norm", torch.stack([p.detach().norm() for p in pl_module.parameters()]).sum())


@case("lambda_callback_reads_weights")
def build_lambda() -> Spec:
    """LambdaCallback(on_train_batch_end=...) that reads a weight and runs the model on a probe batch under no_grad
    between steps, plus a Callback.on_train_epoch_end reading pl_module.parameters(). Source:
    Lightning-AI/pytorch-lightning src/lightning/pytorch/callbacks/lambda_function.py (LambdaCallback) and
    docs/source-pytorch/extensions/callbacks.rst."""
    model = MLP()
    probe = classification(8, seed=11).tensors[0]
    reader = HookReader()

    def batch_end(trainer, pl_module, outputs, batch, batch_idx):
        reader.record("w_sum", pl_module.net[0].weight.detach().sum())
        with torch.no_grad():
            reader.record("probe_out", pl_module(probe).sum())

    return Spec(model, loader(classification()), callbacks=[LambdaCallback(on_train_batch_end=batch_end), reader])


class LSTMLM(pl.LightningModule):
    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, d, layers, batch_first=True)
        self.decoder = nn.Linear(d, vocab)
        self.layers, self.d, self.vocab = layers, d, vocab
        self.hidden = None

    def init_hidden(self, b: int):
        weight = next(self.parameters())  # the demo's way to get dtype/device: reads a parameter
        return (weight.new_zeros(self.layers, b, self.d), weight.new_zeros(self.layers, b, self.d))

    def on_train_epoch_end(self):
        self.hidden = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hidden is None:
            self.hidden = self.init_hidden(x.size(0))
        self.hidden = (self.hidden[0].detach(), self.hidden[1].detach())  # truncated BPTT across steps
        out, self.hidden = self.rnn(self.encoder(x), self.hidden)
        logits = F.log_softmax(self.decoder(out), -1)
        return F.nll_loss(logits.reshape(-1, self.vocab), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


@case("lstm_demo_hidden_carry")
def build_lstm() -> Spec:
    """nn.LSTM (flat weights) language model with the hidden state carried (detached) across steps and
    init_hidden built from next(self.parameters()), as Lightning's demo does. Source: Lightning-AI/pytorch-lightning
    src/lightning/pytorch/demos/lstm.py (SimpleLSTM, LightningLSTM), sizes shrunk, WikiText2 replaced by
    random tokens."""
    return Spec(LSTMLM(), loader(tokens(), shuffle=False))


class SharedEncDec(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(32, 16)
        self.encoder = nn.GRU(16, 16, batch_first=True)
        self.decoder = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, 32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, h = self.encoder(self.shared(x))
        out, _ = self.decoder(self.shared(y[:, :-1]), h)  # the same embedding module used by encoder and decoder
        logits = self.head(out)
        return F.cross_entropy(logits.reshape(-1, 32), y[:, 1:].reshape(-1))


@case("shared_embedding_encdec")
def build_shared() -> Spec:
    """Encoder-decoder sharing one embedding module called twice per step (T5/BART's `shared` embedding; seq2seq
    GRUs). Source: huggingface/transformers src/transformers/models/t5/modeling_t5.py (T5Model.shared passed to
    encoder and decoder) and pytorch/tutorials intermediate_source/seq2seq_translation_tutorial.py."""
    return Spec(SharedEncDec(), loader(tokens()))


# ------------------------------------------------------------------------------------------- found by a fresh-user test
class PrevGradAndState(MLP, Recorder):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def training_step(self, batch, batch_idx):
        w = self.net[0].weight
        state = self.optimizers().optimizer.state.get(w, {})
        if w.grad is not None and state:  # last step's gradient and Adam moments, read before the forward
            self.record("prev_grad", w.grad)
            self.record("exp_avg", state["exp_avg"])
            self.record("adam_step", state["step"])
        return super().training_step(batch, batch_idx)


@case("prev_grad_and_optimizer_state_in_training_step",
      no_shard="reads optimizer.state[p] in training_step: sharded, that read raises ShardedStateError naming the "
               "parameter and trainer.strategy.optimizer_state (tests/test_shard_step.py)")
def build_prev_state() -> Spec:
    """training_step reads the previous step's ``.grad`` and the optimizer state (``self.optimizers().optimizer.
    state[p]``) before its forward, e.g. to log them. Source: Lightning-AI/pytorch-lightning
    docs/source-pytorch/common/optimization.rst ("Access your own optimizer": self.optimizers()) and the state
    layout of torch/optim/adam.py (exp_avg, step). Compared: parameters and every recorded value."""
    return Spec(PrevGradAndState(), loader(classification()))


class BatchTransferUsesWeights(MLP, Recorder):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        if self.trainer.training:
            with torch.no_grad():  # an input normalisation from the current weights, applied on the device
                scale = 1.0 + self.net[0].weight.abs().mean()
                self.record("scale_seen", scale)
                x = x / scale
        return x, y


@case("on_after_batch_transfer_uses_weights")
def build_batch_hook() -> Spec:
    """LightningModule.on_after_batch_transfer transforms the batch with a parameter (on-device augmentation /
    normalisation). Source: Lightning-AI/pytorch-lightning src/lightning/pytorch/core/hooks.py
    (DataHooks.on_after_batch_transfer, "apply GPU augmentations") and docs/source-pytorch/data/datamodule.rst."""
    return Spec(BatchTransferUsesWeights(), loader(classification()))


class PeriodicRead(MLP, Recorder):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step % 3 == 2:  # every third step only: after the first guarded steps too
            with torch.no_grad():
                self.record("w2", self.net[4].weight.abs().mean())
        return super().training_step(batch, batch_idx)


@case("periodic_weight_read_in_training_step")
def build_periodic() -> Spec:
    """A weight statistic read in training_step every few steps (``if self.global_step % k == 0`` monitoring).
    Source: Lightning-AI/pytorch-lightning docs/source-pytorch/visualize/logging_advanced.rst (logging every n
    steps) with a weight read as in public LightningModules."""
    return Spec(PeriodicRead(), loader(classification()))


class BranchOnStep(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(D, 32), nn.Linear(32, 32), nn.Linear(32, C)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if self.trainer.global_step >= 5:  # from step 5 on, the parent reads l3's weight before l3 runs
            h = h + 0.1 * F.linear(h, self.l3.weight.t() @ self.l3.weight)
        return self.l3(torch.tanh(self.l2(h)))


@case("forward_branches_on_global_step")
def build_branch() -> Spec:
    """The forward changes with training progress (curriculum / staged losses keyed on ``self.global_step``), and
    the new branch reads a child's weight before the child runs. Source: Lightning-AI/pytorch-lightning
    docs/source-pytorch/common/lightning_module.rst (``self.global_step`` in the module) and weight sharing as
    in pytorch/examples word_language_model/model.py (tie_weights)."""
    return Spec(BranchOnStep(), loader(classification()))


class BackwardOverride(MLP, Recorder):
    def backward(self, loss, *args, **kwargs):
        loss.backward(*args, **kwargs)
        self.record("grad_after_backward", self.net[0].weight.grad)  # DDP: already averaged here


@case("backward_override_reads_grad")
def build_backward_override() -> Spec:
    """LightningModule.backward overridden (``loss.backward()`` then a look at ``.grad``). Source:
    Lightning-AI/pytorch-lightning src/lightning/pytorch/core/module.py (LightningModule.backward: "override
    backward with your own implementation if you need to")."""
    return Spec(BackwardOverride(), loader(classification()))


class ZeroGradOverride(MLP, Recorder):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        w = self.net[0].weight
        if w.grad is not None:
            self.record("grad_before_zero", w.grad)
        optimizer.zero_grad(set_to_none=True)


@case("optimizer_zero_grad_override_reads_grad")
def build_zero_grad() -> Spec:
    """optimizer_zero_grad overridden (Lightning docs: set_to_none / custom zeroing) and reading ``.grad`` before
    clearing it. Source: Lightning-AI/pytorch-lightning src/lightning/pytorch/core/module.py
    (LightningModule.optimizer_zero_grad) and docs/source-pytorch/common/optimization.rst."""
    return Spec(ZeroGradOverride(), loader(classification()))


class ValGradReader(Callback, Recorder):
    pipedap_reads_model = True

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            g = pl_module.net[0].weight.grad
            self.record("val_grad_is_none", 1.0 if g is None else 0.0)
            self.record("val_weight", pl_module.net[0].weight.sum())


@case("validation_hooks_read_grad_and_weights")
def build_val_reader() -> Spec:
    """A callback reading weights and ``.grad`` in on_validation_batch_end with validation every 2 steps
    (Lightning sets ``.grad`` to None before validation: LightningModule.on_validation_model_zero_grad). Source:
    Lightning-AI/pytorch-lightning src/lightning/pytorch/core/hooks.py (on_validation_model_zero_grad) and
    src/lightning/pytorch/callbacks/callback.py (on_validation_batch_end)."""
    ds = classification()
    return Spec(MLP(), loader(ds), val=loader(ds, shuffle=False), trainer_kw={"val_check_interval": 2,
                                                                          "limit_val_batches": 2},
                callbacks=[ValGradReader()])


# ------------------------------------------------------------------------ issue 26: switching must never change results
def _world() -> int:
    """The number of ranks the harness runs (data layouts that place batches on ranks need it): the default process
    group's size (the harness keeps one across fits; ``WORLD_SIZE`` does not survive a Lightning fit), else the
    launch's ``WORLD_SIZE``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


class ConditionalBoxHead(pl.LightningModule):
    """Detection-style: objectness on every anchor, box regression through ``box_head`` only for positive anchors,
    the head not called at all when the batch has none."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D, 32), nn.ReLU())
        self.cls_head = nn.Linear(32, 1)
        self.box_head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.called: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, labels, boxes = batch  # (B, A, D), (B, A), (B, A, 4)
        feat = self.backbone(x)
        positives = labels > 0
        loss = F.binary_cross_entropy_with_logits(self.cls_head(feat).squeeze(-1), positives.float())
        if positives.any():  # the box head runs on positive anchors only: not at all for a batch without one
            loss = loss + F.smooth_l1_loss(self.box_head(feat[positives]), boxes[positives])
        self.called.append(bool(positives.any()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


#: (rank, step) whose batch has no positive anchor in ``build_conditional_box_head`` (rank None: every rank), late in
#: the 40-step fit, after start-up and after the switching variants' trials (steps 2-15) have ended
NO_POSITIVES = ((1, 31), (1, 35), (0, 37), (None, 39))
BOX_STEPS, ANCHORS = 40, 4


def detection_data(world: int, steps: int = BOX_STEPS, seed: int = 7) -> TensorDataset:
    """``steps * BATCH * world`` samples of ``ANCHORS`` anchors each (~27% positive) for one epoch; the batches of
    :data:`NO_POSITIVES` get none. Lightning gives each rank of a training loader ``DistributedSampler(shuffle=True,
    seed=0)`` (whatever the loader's own ``shuffle``), epoch 0: the same sampler places those batches."""
    g = torch.Generator().manual_seed(seed)
    n = steps * BATCH * world
    x = torch.randn(n, ANCHORS, D, generator=g)
    labels = (x[:, :, :3].sum(-1) > 0.9).long()
    boxes = torch.tanh(x[:, :, 4:8] + 0.5 * x[:, :, 8:12])
    per_rank = []
    for r in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=0)
        sampler.set_epoch(0)
        per_rank.append(list(sampler))
    for r, s in NO_POSITIVES:
        for rr in (range(world) if r is None else [r % world]):
            labels[per_rank[rr][s * BATCH:(s + 1) * BATCH]] = 0
    return TensorDataset(x, labels, boxes)


@case("detection_box_head_if_positives", ref="ddp_find_unused_parameters_true", epochs=1,
      extra_variants=["switching_keep_ddp"], per_rank_steps=3)
def build_conditional_box_head() -> Spec:
    """A detection-style box head run only ``if positives.any()`` (issue 26, finding 1: DDP's reducer installed
    without find_unused_parameters crashed at step 372 when one rank's batch had no positives). Box and class terms
    only for a batch with targets, as ultralytics/yolov5 utils/loss.py (ComputeLoss.__call__: ``if n :=
    b.shape[0]:``); the head module itself run on positive proposals only, as two-stage detectors do
    (facebookresearch/maskrcnn-benchmark maskrcnn_benchmark/modeling/roi_heads/mask_head/mask_head.py:
    keep_only_positive_boxes before the head during training). One epoch of 40 steps: rank 1 has no positive at
    steps 31 and 35, rank 0 at step 37, no rank at step 39 (the head gets no gradient anywhere: SGD skips it);
    ``switching_keep_ddp`` keeps DDP's reducer after the trials, so those steps run under it."""
    return Spec(ConditionalBoxHead(), loader(detection_data(_world())),
                info=lambda s: {"called": s.model.called})


class VectorQuantizerEMA(nn.Module):
    """VQ-VAE quantizer whose codebook follows exponential moving averages of the encoder outputs assigned to each
    code, updated in forward (training only) from this rank's batch: the cluster sizes a buffer, the summed vectors
    and the codebook frozen parameters, all updated in place. No gradient reaches the codebook (straight-through)."""

    def __init__(self, num_embeddings: int = 8, embedding_dim: int = 4, commitment_cost: float = 0.25,
                 decay: float = 0.9, epsilon: float = 1e-5) -> None:
        super().__init__()
        self._num_embeddings, self._embedding_dim = num_embeddings, embedding_dim
        self._commitment_cost, self._decay, self._epsilon = commitment_cost, decay, epsilon
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight.data.normal_()
        self._embedding.weight.requires_grad_(False)
        self.register_buffer("_ema_cluster_size", torch.zeros(num_embeddings))
        self._ema_w = nn.Parameter(torch.randn(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, inputs):  # (..., embedding_dim)
        flat = inputs.reshape(-1, self._embedding_dim)
        w = self._embedding.weight
        distances = flat.pow(2).sum(1, keepdim=True) + w.pow(2).sum(1) - 2 * flat @ w.t()
        encodings = F.one_hot(distances.argmin(1), self._num_embeddings).to(flat.dtype)
        if self.training:
            with torch.no_grad():
                size = self._ema_cluster_size
                size.mul_(self._decay).add_((1 - self._decay) * encodings.sum(0))
                n = size.sum()
                size.copy_((size + self._epsilon) / (n + self._num_embeddings * self._epsilon) * n)
                self._ema_w.mul_(self._decay).add_((1 - self._decay) * (encodings.t() @ flat))
                self._embedding.weight.copy_(self._ema_w / size.unsqueeze(1))
        quantized = encodings @ self._embedding.weight
        loss = self._commitment_cost * F.mse_loss(quantized.detach(), flat)
        quantized = flat + (quantized - flat).detach()  # straight-through estimator
        return loss, quantized.view_as(inputs)


class VQVAE(pl.LightningModule):
    def __init__(self, tokens: int = 4, dim: int = 4) -> None:
        super().__init__()
        self.tokens, self.dim = tokens, dim
        self.encoder = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, tokens * dim))
        self.vq = VectorQuantizerEMA(embedding_dim=dim)
        self.decoder = nn.Sequential(nn.Linear(tokens * dim, 32), nn.ReLU(), nn.Linear(32, D))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        z = self.encoder(x).view(-1, self.tokens, self.dim)
        vq_loss, q = self.vq(z)
        return F.mse_loss(self.decoder(q.reshape(x.size(0), -1)), x) + vq_loss

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)


@case("vqvae_ema_codebook", rank_local=("vq._embedding.weight", "vq._ema_w", "vq._ema_cluster_size"))
def build_vqvae() -> Spec:
    """VQ-VAE with an EMA codebook (issue 26, finding 2: every switch into DDP's reducer re-broadcast rank 0's
    parameters and buffers, and the rank-local codebook ended 0.22 from DDP). Quantizer after VectorQuantizerEMA of
    zalandoresearch/pytorch-vq-vae vq-vae.ipynb (EMA cluster sizes and summed vectors, codebook = ema_w / cluster
    size, straight-through quantized output, commitment loss only), written with in-place updates of a buffer
    (cluster sizes) and frozen parameters (codebook, summed vectors) as ports to DDP do. Under DDP the frozen
    parameters stay per rank (never broadcast after set-up) and the buffer is rank 0's before every training
    forward (broadcast_buffers), then updated per rank: the case compares every rank with DDP's same rank, and
    leaves these three tensors out of the replica check."""
    return Spec(VQVAE(), loader(classification()))


class BertFineTune(pl.LightningModule):
    """BertForSequenceClassification (tiny BertConfig) fine-tuned as the GLUE tutorial does it: AdamW with no
    weight decay on biases and LayerNorm weights, linear warm-up/decay per step."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        # initializer_range 0.2: gradient norms 1.5-3.5 over the fit, so that gradient_clip_val=1.0 clips every step
        cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=16, num_labels=2, initializer_range=0.2)
        self.model = BertForSequenceClassification(cfg)

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

    def configure_optimizers(self):
        from transformers import get_linear_schedule_with_warmup

        no_decay = ("bias", "LayerNorm.weight")
        named = list(self.model.named_parameters())
        groups = [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
                  {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-3, eps=1e-8)
        sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2,
                                                num_training_steps=self.trainer.estimated_stepping_batches)
        return [opt], [{"scheduler": sched, "interval": "step", "frequency": 1}]


def padded_tokens(n: int = N, t: int = 12, vocab: int = 64, seed: int = 7) -> TensorDataset:
    """Token ids 1..vocab-1 of random lengths 6..t, padded with 0 (attention_mask 0), and a binary label."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, t), generator=g)
    lengths = torch.randint(6, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    labels = ((ids[:, 0] + ids[:, 1]) % 2 == 0).long()
    return TensorDataset(ids, mask, labels)


def _transformers_skip() -> Optional[str]:
    try:
        import transformers  # noqa: F401
        return None
    except Exception as exc:
        return f"transformers is not installed ({type(exc).__name__}: {exc})"


@case("bert_finetune_clip_adamw", skip=_transformers_skip)
def build_bert() -> Spec:
    """BERT fine-tuning with Trainer(gradient_clip_val=1.0) and AdamW (issue 26, finding 3: the clip coefficient from
    float64 shard sums differed from torch's fp32 per-tensor norms, and AdamW amplified the difference on the
    attention key bias, whose true gradient is zero: 6.8e-5..9.1e-5 from DDP, different every run). The model is
    huggingface/transformers src/transformers/models/bert/modeling_bert.py BertForSequenceClassification with a
    tiny BertConfig (hidden 32, 2 layers, 2 heads, vocab 64, dropout 0.1 as configured); the LightningModule follows
    Lightning-AI/tutorials lightning_examples/text-transformers/text-transformers.py (GLUETransformer: AdamW, no
    decay for bias/LayerNorm.weight, get_linear_schedule_with_warmup per step), clipping at 1.0 as the HF Trainer's
    default max_grad_norm (src/transformers/training_args.py). Padded token sequences with an attention mask."""
    return Spec(BertFineTune(), loader(padded_tokens()), trainer_kw={"gradient_clip_val": 1.0})


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class TinyResNet(Classifier):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.layer1 = BasicBlock(c)
        self.fc = nn.Linear(c, C)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.layer1(self.stem(x)), 1).flatten(1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)


@case("resnet_batchnorm", rank_local=("running_mean", "running_var"))
def build_resnet_bn() -> Spec:
    """A ResNet basic block with BatchNorm2d (running statistics: buffers updated in every training forward, which
    DDP broadcasts from rank 0 before each forward: the buffer rule a switch of reducer must carry over), SGD with
    momentum and weight decay 5e-4. Source: pytorch/vision torchvision/models/resnet.py (BasicBlock) and
    Lightning-AI/tutorials lightning_examples/cifar10-baseline/baseline.py (ResNet with BatchNorm, SGD momentum 0.9,
    weight_decay 5e-4), shrunk to 8 channels on 8x8 images. Under DDP the running statistics end per rank (rank 0's
    before the last forward, then each rank's batch): compared per rank, left out of the replica check."""
    return Spec(TinyResNet(), loader(images()))

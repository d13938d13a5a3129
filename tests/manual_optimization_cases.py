"""Manual optimization under ``strategy="pipedap"``: per-rank script of ``tests/test_manual_optimization.py``.

Manual optimization (``self.automatic_optimization = False``, ``opt.step()`` inside ``training_step``), tiny sizes,
2 ranks:

* ``gan``: the model of Lightning's GAN template (Lightning-AI/pytorch-lightning
  ``examples/pytorch/domain_templates/generative_adversarial_net.py``): generator (Linear / BatchNorm1d(o, 0.8) /
  LeakyReLU blocks, Tanh) and discriminator (Linear / LeakyReLU), two Adam optimizers (lr 2e-4, betas 0.5, 0.999),
  ``toggle_optimizer`` / ``zero_grad`` / ``manual_backward`` / ``step`` / ``untoggle_optimizer`` for the generator,
  then the same for the discriminator on real and detached fake images: two backward passes and two optimizer
  steps per ``training_step``;
* ``wgan_gp``: a WGAN-GP in the style of eriklindernoren/PyTorch-GAN ``implementations/wgan_gp/wgan_gp.py`` (the
  version whose inner loop trains the critic ``n_critic`` times per generator step): ``n_critic=3`` critic steps
  (Wasserstein loss plus the gradient penalty ``λ·(‖∇_x̂ D(x̂)‖₂ - 1)²`` on random interpolates, the gradient taken
  with ``torch.autograd.grad(..., create_graph=True, retain_graph=True)``, λ = 10), then one generator step (Adam,
  betas 0.5, 0.999): four backward passes (three of them double backward) and four optimizer steps per
  ``training_step``;
* ``manual_accumulate``: gradient accumulation by hand (:class:`ManualAccumulate`); with this case, the script also
  records what ``Trainer(accumulate_grad_batches=2)`` under manual optimization raises with ``ddp`` and ``pipedap``.

Each case runs with the reference strategy (``ddp_find_unused_parameters_true`` for the GANs: the toggled-off
optimizer's parameters get no gradient in a backward; else ``ddp``) and with ``strategy="pipedap"`` (short
start-up options); a callback reads the strategy's run-time in ``on_train_end``. Every rank writes
``OUT.rank{r}.json``::

    python -m tests.manual_optimization_cases OUT [case ...]     # started once per rank (run_lightning_ranks)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

import lightning_pipedap  # noqa: F401  (registers "pipedap")

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LATENT, IMG = 8, (1, 4, 4)
PIX = IMG[0] * IMG[1] * IMG[2]
BATCH = 8
#: short start-up: 2 profiled steps, one measured step per trial window, one round, no minimum window time, and no
#: start-up budget (the fits are a few dozen steps: the selection runs to its end)
PIPEDAP_OPTIONS = dict(profile_steps=2, trial_steps=1, trial_rounds=1, trial_window_s=0.0, wait_timeout_s=60.0,
                       startup_budget=None)


# ------------------------------------------------------------------------------------------------ models
class Generator(nn.Module):
    def __init__(self, latent_dim: int = LATENT, img_shape: tuple = IMG, bn: bool = True) -> None:
        super().__init__()
        self.img_shape = img_shape

        def block(i: int, o: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(i, o)]
            if normalize and bn:
                layers.append(nn.BatchNorm1d(o, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(*block(latent_dim, 16, normalize=False), *block(16, 32), *block(32, 32),
                                   nn.Linear(32, PIX), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(PIX, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 16),
                                   nn.LeakyReLU(0.2, inplace=True), nn.Linear(16, 1))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.model(img.view(img.size(0), -1))


class TemplateGAN(pl.LightningModule):
    """Lightning's GAN template (see the module docstring), tiny."""

    def __init__(self, lr: float = 2e-4) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        self.generator = Generator()
        self.discriminator = Discriminator()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch: Any) -> None:
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], LATENT).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.lr, betas=(0.5, 0.999))
        return opt_g, opt_d


class WGANGP(pl.LightningModule):
    """WGAN-GP, the critic trained ``n_critic`` times per generator step (see the module docstring), tiny."""

    def __init__(self, n_critic: int = 3, lambda_gp: float = 10.0, lr: float = 2e-4) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.n_critic, self.lambda_gp, self.lr = n_critic, lambda_gp, lr
        self.generator = Generator(bn=False)
        self.critic = Discriminator()

    def gradient_penalty(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        alpha = torch.rand(real.size(0), 1, 1, 1).type_as(real)
        interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        d_interpolates = self.critic(interpolates)
        gradients = torch.autograd.grad(outputs=d_interpolates, inputs=interpolates,
                                        grad_outputs=torch.ones_like(d_interpolates), create_graph=True,
                                        retain_graph=True, only_inputs=True)[0]
        gradients = gradients.view(gradients.size(0), -1)
        return ((gradients.norm(2, dim=1) - 1) ** 2).mean()

    def training_step(self, batch: Any) -> None:
        real, _ = batch
        opt_g, opt_c = self.optimizers()
        for _ in range(self.n_critic):
            self.toggle_optimizer(opt_c)
            z = torch.randn(real.size(0), LATENT).type_as(real)
            fake = self.generator(z).detach()
            c_loss = (-self.critic(real).mean() + self.critic(fake).mean()
                      + self.lambda_gp * self.gradient_penalty(real, fake))
            opt_c.zero_grad()
            self.manual_backward(c_loss)
            opt_c.step()
            self.untoggle_optimizer(opt_c)
        self.toggle_optimizer(opt_g)
        z = torch.randn(real.size(0), LATENT).type_as(real)
        g_loss = -self.critic(self.generator(z)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.log_dict({"c_loss": c_loss, "g_loss": g_loss})

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=(0.5, 0.999)),
                torch.optim.Adam(self.critic.parameters(), lr=self.lr, betas=(0.5, 0.999)))


class ManualAccumulate(pl.LightningModule):
    """Gradient accumulation under manual optimization as Lightning's docs show it
    (Lightning-AI/pytorch-lightning ``docs/source-pytorch/model/manual_optimization.rst``, "Gradient
    Accumulation"): ``manual_backward`` of ``loss / N`` every batch, ``opt.step()`` and ``opt.zero_grad()`` every
    ``N``-th batch (``Trainer(accumulate_grad_batches=N)`` is refused under manual optimization)."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.n = n
        self.net = nn.Sequential(nn.Linear(PIX, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        loss = F.mse_loss(self.net(x.view(x.size(0), -1)).squeeze(1), y) / self.n
        self.manual_backward(loss)
        if (batch_idx + 1) % self.n == 0:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


MODELS = {"gan": TemplateGAN, "wgan_gp": WGANGP, "manual_accumulate": ManualAccumulate}
#: batches per rank of each case's one epoch
BATCHES = {"gan": 40, "wgan_gp": 40, "manual_accumulate": 40}
#: the reference strategy: the toggled-off optimizer's parameters get no gradient in the GANs' backward passes
REFERENCE = {"gan": "ddp_find_unused_parameters_true", "wgan_gp": "ddp_find_unused_parameters_true",
             "manual_accumulate": "ddp"}


# ------------------------------------------------------------------------------------------------ one fit
class RunState(pl.Callback):
    """The strategy's run-time state at the end of the fit (reads no parameter and no gradient)."""

    pipedap_reads_model = False

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        st = trainer.strategy
        if not hasattr(st, "what_ran"):
            return
        phase = st.phase
        profile = st.profile or {}
        self.state = {"phase": phase.value if phase is not None else None, "what_ran": st.what_ran(),
                      "installed": st.installed_schedule, "update_counts": dict(st.update_counts),
                      "startup": dict(st.startup), "profile_meta": profile.get("meta", {}),
                      "profile_layers": [lay["name"] for lay in profile.get("layers", [])]}


def data(n_batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = n_batches * BATCH * WORLD
    imgs = torch.rand(n, *IMG, generator=g) * 2 - 1
    return DataLoader(TensorDataset(imgs, torch.randn(n, generator=g)), batch_size=BATCH, shuffle=True)


def fit(case: str, strategy: Any, **trainer_kw: Any) -> dict[str, Any]:
    pl.seed_everything(0, workers=True, verbose=False)
    model = MODELS[case]()
    cb = RunState()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb], **trainer_kw)
    t0 = time.monotonic()
    trainer.fit(model, data(BATCHES[case]))
    return {"wall_s": time.monotonic() - t0, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "run": cb.state, "global_step": trainer.global_step}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, bool, str]:
    """``(max |a - b| over floating tensors, every tensor bit-identical, the worst tensor's name)``."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst, name, same = 0.0, "", True
    for k in a:
        same = same and torch.equal(a[k], b[k])
        if a[k].is_floating_point() and a[k].numel():
            d = float((a[k].double() - b[k].double()).abs().max())
            if d >= worst:
                worst, name = d, k
    return worst, same, name


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def refusal(strategy: Any) -> str:
    """What ``Trainer(accumulate_grad_batches=2)`` under manual optimization raises (Lightning refuses it)."""
    try:
        fit("manual_accumulate", strategy, accumulate_grad_batches=2)
    except Exception as exc:  # noqa: BLE001  (the type and message are the result)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main(out: str, cases: list[str]) -> None:
    from lightning_pipedap import PipeDAPStrategy  # noqa: PLC0415

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for case in cases or list(MODELS):
        ref = fit(case, REFERENCE[case])
        run = fit(case, PipeDAPStrategy(**PIPEDAP_OPTIONS))
        worst, same, name = compare(run["state"], ref["state"])
        pl.seed_everything(0, workers=True, verbose=False)
        moved = compare(ref["state"], MODELS[case]().state_dict())[0]
        results[case] = {"max_diff": worst, "bit_identical": same, "worst": name, "ref_moved": moved,
                         "digest": digest(run["state"]), "run": run["run"], "global_step": run["global_step"],
                         "ref_global_step": ref["global_step"], "wall_s": run["wall_s"], "ref_wall_s": ref["wall_s"]}
        print(f"[manual] rank {RANK} {case}: max |Δ| {worst:.3g} ({name}) identical {same} "
              f"phase {run['run'].get('phase')} {run['wall_s']:.1f} s (reference {ref['wall_s']:.1f} s)", flush=True)
    if "manual_accumulate" in (cases or list(MODELS)):
        results["refusal"] = {"ddp": refusal("ddp"), "pipedap": refusal(PipeDAPStrategy(**PIPEDAP_OPTIONS))}
    with open(f"{out}.rank{RANK}.json", "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

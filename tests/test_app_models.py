"""Each model config instantiates and runs one training step on tiny data in one CPU process."""

from __future__ import annotations

import hydra
import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_pipedap.app.train import CONFIG_PATH
from lightning_pipedap.models import BERT, GPT, MaskedLM, resnet18, resnet50

TINY = {
    "digits_cnn": ["data=digits", "data.limit=40", "data.batch_size=4"],
    "resnet18": ["data=synthetic_images", "data.num_samples=4", "data.val_samples=2", "data.batch_size=2"],
    "resnet50": ["data=synthetic_images", "data.num_samples=4", "data.val_samples=2", "data.batch_size=2"],
    "vgg16": ["data=synthetic_images", "data.num_samples=4", "data.val_samples=2", "data.batch_size=2"],
    "gpt": ["data=stdlib_text", "data.block_size=32", "data.train_bytes=400", "data.val_bytes=200",
            "data.batch_size=2"],
    "bert": ["data=synthetic_tokens", "data.num_samples=4", "data.val_samples=2", "data.block_size=32",
             "data.batch_size=2"],
}


@pytest.mark.parametrize("model", sorted(TINY))
def test_model_config_trains_one_step(model):
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", "strategy=auto", "trainer.devices=1", *TINY[model]])
    pl.seed_everything(0, verbose=False)
    module = hydra.utils.instantiate(cfg.model)
    data = hydra.utils.instantiate(cfg.data)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="auto", max_epochs=1, limit_train_batches=1,
                         limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1
    loss = trainer.callback_metrics["train/loss"]
    assert torch.isfinite(loss) and loss > 0
    changed = [n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(before)  # every parameter got a gradient and an update
    assert 0.0 <= float(trainer.callback_metrics["val/acc"]) <= 1.0


def test_known_parameter_counts():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # CIFAR-style ResNets with BatchNorm and 1x1 conv shortcuts, 10 classes (the usual published sizes)
    assert count(resnet18()) == 11_173_962
    assert count(resnet50()) == 23_520_842
    # GPT: tok 256*128 + pos 128*128 + 4 blocks * (2 LN + qkv + proj + MLP) + final LN; head tied
    block = 2 * 2 * 128 + (128 * 384 + 384) + (128 * 128 + 128) + (128 * 512 + 512) + (512 * 128 + 128)
    assert count(GPT()) == 256 * 128 + 128 * 128 + 4 * block + 2 * 128
    gpt = GPT()
    assert gpt.head.weight is gpt.tok_emb.weight


def test_gpt_is_causal_and_bert_is_not():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (1, 8))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 256  # change only the last token
    gpt, bert = GPT(block_size=8, n_layer=1).eval(), BERT(block_size=8, n_layer=1).eval()
    assert torch.allclose(gpt(x)[0, :-1], gpt(y)[0, :-1])  # earlier positions cannot see the last token
    assert not torch.allclose(bert(x)[0, :-1], bert(y)[0, :-1])


def test_masked_lm_masking_rule():
    mlm = MaskedLM(BERT(vocab_size=257, block_size=64, n_layer=1), mask_prob=1.0)
    x = torch.randint(0, 256, (4, 64))
    inputs, targets = mlm.mask(x, torch.Generator().manual_seed(0))
    assert torch.equal(targets, x)  # every position chosen at mask_prob=1
    frac_mask = (inputs == 256).float().mean().item()
    assert 0.7 < frac_mask < 0.9  # 80% [MASK] in expectation
    mlm = MaskedLM(BERT(vocab_size=257, block_size=64, n_layer=1), mask_prob=0.15)
    inputs, targets = mlm.mask(x, torch.Generator().manual_seed(0))
    kept = targets == -100
    assert torch.equal(inputs[kept], x[kept])  # unchosen positions are untouched and not predicted
    with pytest.raises(ValueError, match="mask_prob"):
        MaskedLM(BERT(), mask_prob=0.0)

"""Example models for the pipedap app: ``torch.nn`` networks and the LightningModules that train them.

Networks (plain ``nn.Module``, written here because torchvision does not import on every machine):
:class:`DigitsCNN`, :class:`ResNet` (CIFAR-style ResNet-18/50 shapes), :class:`VGG` (VGG-16 style),
:class:`GPT` (nanoGPT-style decoder), :class:`BERT` (encoder with a masked-LM head).

LightningModules: :class:`ImageClassifier` (cross-entropy, ``val/acc``), :class:`CausalLM`
(next-token prediction) and :class:`MaskedLM` (BERT-style masked-token prediction).
"""

from lightning_pipedap.models.cnn import DigitsCNN
from lightning_pipedap.models.modules import CausalLM, ImageClassifier, MaskedLM
from lightning_pipedap.models.resnet import ResNet, resnet18, resnet50
from lightning_pipedap.models.transformer import BERT, GPT
from lightning_pipedap.models.vgg import VGG, vgg16

__all__ = [
    "BERT",
    "GPT",
    "VGG",
    "CausalLM",
    "DigitsCNN",
    "ImageClassifier",
    "MaskedLM",
    "ResNet",
    "resnet18",
    "resnet50",
    "vgg16",
]

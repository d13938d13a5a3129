"""CIFAR-style ResNets in the ResNet-18 and ResNet-50 shapes (He et al., CVPR 2016).

"CIFAR-style" means a 3x3 stride-1 stem without max-pool, so 32x32 inputs keep enough resolution;
the four stages, block types and block counts are those of the ImageNet ResNet-18/50
(BasicBlock x [2, 2, 2, 2]; Bottleneck x [3, 4, 6, 3], expansion 4).
"""

from __future__ import annotations

from typing import Sequence, Union

from torch import Tensor, nn


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (ResNet-18/34). ``(B, C_in, H, W) -> (B, C, H/s, W/s)``."""

    expansion = 1

    def __init__(self, in_ch: int, ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_ch, ch, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) with a residual (ResNet-50). ``(B, C_in, H, W) -> (B, 4C, H/s, W/s)``."""

    expansion = 4

    def __init__(self, in_ch: int, ch: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = ch * self.expansion
        self.conv1 = nn.Conv2d(in_ch, ch, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.conv3 = nn.Conv2d(ch, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_ch, out_ch, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))


_BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
    """A CIFAR-style ResNet.

    Shapes: input ``(B, in_channels, H, W)`` (H, W >= 8, e.g. 32x32) -> logits ``(B, num_classes)``.

    Args:
        block: ``"basic"`` (ResNet-18/34) or ``"bottleneck"`` (ResNet-50/101).
        layers: blocks per stage, e.g. ``[2, 2, 2, 2]`` (ResNet-18) or ``[3, 4, 6, 3]`` (ResNet-50).
        num_classes: output classes.
        width: channels of the first stage (64 in the paper); stages use width x 1, 2, 4, 8.
        in_channels: input image channels.

    Raises:
        ValueError: unknown ``block`` (names the valid choices) or non-positive sizes.
    """

    def __init__(
        self,
        block: str = "basic",
        layers: Sequence[int] = (2, 2, 2, 2),
        num_classes: int = 10,
        width: int = 64,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if block not in _BLOCKS:
            raise ValueError(f"ResNet: unknown block {block!r}; valid: {', '.join(_BLOCKS)}")
        if not layers or any(n < 1 for n in layers) or width < 1 or num_classes < 1:
            raise ValueError(f"ResNet: layers, width and num_classes must be positive, "
                             f"got {list(layers)}, {width}, {num_classes}")
        cls: Union[type[BasicBlock], type[Bottleneck]] = _BLOCKS[block]
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        stages: list[nn.Module] = []
        in_ch = width
        for i, n in enumerate(layers):
            ch = width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(cls(in_ch, ch, stride=2 if (i > 0 and j == 0) else 1))
                in_ch = ch * cls.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, C, H, W)`` -> ``(B, num_classes)`` logits."""
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


def resnet18(num_classes: int = 10, width: int = 64, in_channels: int = 3) -> ResNet:
    """ResNet-18 shape: BasicBlock x [2, 2, 2, 2] (11.2 M parameters at width 64, 10 classes)."""
    return ResNet("basic", (2, 2, 2, 2), num_classes, width, in_channels)


def resnet50(num_classes: int = 10, width: int = 64, in_channels: int = 3) -> ResNet:
    """ResNet-50 shape: Bottleneck x [3, 4, 6, 3] (23.5 M parameters at width 64, 10 classes)."""
    return ResNet("bottleneck", (3, 4, 6, 3), num_classes, width, in_channels)

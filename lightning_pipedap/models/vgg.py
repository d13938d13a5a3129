"""A VGG-16-style network (Simonyan & Zisserman, ICLR 2015, configuration "D") with BatchNorm.

Thirteen 3x3 conv layers in five stages separated by 2x2 max-pools, then a classifier. For 32x32
inputs (CIFAR) the feature map is 1x1 after the last pool and the classifier is 512 -> 512 -> classes,
the usual CIFAR adaptation; large layers at the end make it a communication-heavy benchmark.
"""

from __future__ import annotations

from typing import Sequence, Union

from torch import Tensor, nn

#: VGG-16 (configuration D): conv output channels at width 64, "M" = 2x2 max-pool.
VGG16_LAYOUT: tuple[Union[int, str], ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)


class VGG(nn.Module):
    """VGG-style conv net.

    Shapes: input ``(B, in_channels, H, W)`` with H, W divisible by 2**(number of "M") (32 for VGG-16)
    -> logits ``(B, num_classes)``.

    Args:
        layout: conv channels at width 64 and ``"M"`` for max-pool (default: VGG-16).
        num_classes: output classes.
        width: channel scale: every conv gets ``channels * width // 64`` (64 = paper size).
        hidden: width of the two hidden classifier layers.
        in_channels: input image channels.
        dropout: dropout in the classifier.

    Raises:
        ValueError: a layout entry that is neither a positive int nor ``"M"``, or non-positive sizes.
    """

    def __init__(
        self,
        layout: Sequence[Union[int, str]] = VGG16_LAYOUT,
        num_classes: int = 10,
        width: int = 64,
        hidden: int = 512,
        in_channels: int = 3,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        if width < 1 or hidden < 1 or num_classes < 1:
            raise ValueError(f"VGG: width, hidden, num_classes must be >= 1, got {width}, {hidden}, {num_classes}")
        layers: list[nn.Module] = []
        ch = in_channels
        for item in layout:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            elif isinstance(item, int) and item > 0:
                out = max(1, item * width // 64)
                layers += [nn.Conv2d(ch, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
                ch = out
            else:
                raise ValueError(f"VGG: layout entries must be positive ints or 'M', got {item!r}")
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(ch, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        """``(B, C, H, W)`` -> ``(B, num_classes)`` logits."""
        return self.classifier(self.pool(self.features(x)).flatten(1))


def vgg16(num_classes: int = 10, width: int = 64, hidden: int = 512, in_channels: int = 3) -> VGG:
    """VGG-16 layout with BatchNorm (14.7 M conv + 0.5 M classifier parameters at width 64)."""
    return VGG(VGG16_LAYOUT, num_classes, width, hidden, in_channels)

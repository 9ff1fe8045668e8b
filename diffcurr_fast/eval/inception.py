"""The FID Inception-v3 (TensorFlow 2015-12-05 graph, as ported by pytorch-fid) in plain torch.

The structure is torchvision's ``Inception3`` (Szegedy et al. 2016) without the auxiliary head and with 1008
classes, patched as pytorch-fid's ``fid_inception_v3`` does: in the A, C and first E blocks the pooling
branch averages without counting the zero padding (``count_include_pad=False``), and the last E block pools
with a max instead of an average. Module names equal torchvision's, so the pytorch-fid weights file
``pt_inception-2015-12-05-6726825d.pth`` loads with ``strict=True``. Weights are never downloaded: the user
supplies the file.

Input: images (N, 3, H, W) in [-1, 1] (bilinearly resized to 299 x 299; grayscale is repeated to 3 channels).
Output of ``forward``: pool3 features (N, 2048); ``logits`` gives the 1008-way classifier output.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

FID_WEIGHTS_NAME = "pt_inception-2015-12-05-6726825d.pth"


class BasicConv2d(nn.Module):
    """Conv (no bias) + BatchNorm (eps 1e-3) + ReLU."""

    def __init__(self, cin: int, cout: int, **kwargs) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class FIDInceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool(no pad count)-1x1."""

    def __init__(self, cin: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(cin, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch1x1(x)
        b = self.branch5x5_2(self.branch5x5_1(x))
        c = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        d = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False))
        return torch.cat([a, b, c, d], 1)  # (N, 224 + pool_features, 35, 35)


class InceptionB(nn.Module):
    """35 -> 17 reduction: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch3x3(x)
        b = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([a, b, F.max_pool2d(x, 3, stride=2)], 1)  # (N, 768, 17, 17)


class FIDInceptionC(nn.Module):
    """17x17 block with factorised 7x7 convolutions; avgpool without counting padding."""

    def __init__(self, cin: int, channels_7x7: int) -> None:
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch1x1(x)
        b = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        c = self.branch7x7dbl_1(x)
        for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            c = layer(c)
        d = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False))
        return torch.cat([a, b, c, d], 1)  # (N, 768, 17, 17)


class InceptionD(nn.Module):
    """17 -> 8 reduction: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch3x3_2(self.branch3x3_1(x))
        b = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([a, b, F.max_pool2d(x, 3, stride=2)], 1)  # (N, 1280, 8, 8)


class FIDInceptionE(nn.Module):
    """8x8 block with split 1x3/3x1 branches; ``pool="avg"`` (no pad count) for 7b, ``"max"`` for 7c."""

    def __init__(self, cin: int, pool: str) -> None:
        super().__init__()
        if pool not in ("avg", "max"):
            raise ValueError(f"pool must be 'avg' or 'max', got {pool!r}")
        self.pool = pool
        self.branch1x1 = BasicConv2d(cin, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(cin, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch1x1(x)
        b = self.branch3x3_1(x)
        b = torch.cat([self.branch3x3_2a(b), self.branch3x3_2b(b)], 1)
        c = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        c = torch.cat([self.branch3x3dbl_3a(c), self.branch3x3dbl_3b(c)], 1)
        if self.pool == "avg":
            p = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
        else:
            p = F.max_pool2d(x, 3, stride=1, padding=1)
        return torch.cat([a, b, c, self.branch_pool(p)], 1)  # (N, 2048, 8, 8)


class FIDInceptionV3(nn.Module):
    """FID Inception-v3 returning pool3 features (N, 2048) for images (N, C, H, W) in [-1, 1]."""

    def __init__(self, num_classes: int = 1008) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = FIDInceptionA(192, pool_features=32)
        self.Mixed_5c = FIDInceptionA(256, pool_features=64)
        self.Mixed_5d = FIDInceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = FIDInceptionC(768, channels_7x7=128)
        self.Mixed_6c = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6d = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6e = FIDInceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = FIDInceptionE(1280, pool="avg")
        self.Mixed_7c = FIDInceptionE(2048, pool="max")
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor, resize: bool = True) -> torch.Tensor:
        """Pool3 features; ``resize=False`` skips the 299 x 299 resize (inputs must then be at least 75 x 75)."""
        if x.ndim != 4 or x.shape[1] not in (1, 3):
            raise ValueError(f"expected images (N, 1 or 3, H, W), got shape {tuple(x.shape)}")
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        # pytorch-fid resizes [0, 1] input then maps it to [-1, 1]; bilinear resizing is linear, so resizing
        # [-1, 1] input directly is the same.
        if resize:
            x = F.interpolate(x.float(), size=(299, 299), mode="bilinear", align_corners=False)  # (N, 3, 299, 299)
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))  # (N, 64, 147, 147)
        x = F.max_pool2d(x, 3, stride=2)  # (N, 64, 73, 73)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))  # (N, 192, 71, 71)
        x = F.max_pool2d(x, 3, stride=2)  # (N, 192, 35, 35)
        x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))  # (N, 288, 35, 35)
        x = self.Mixed_6a(x)  # (N, 768, 17, 17)
        x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(x))))  # (N, 768, 17, 17)
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))  # (N, 2048, 8, 8)
        return x.mean(dim=(2, 3))  # (N, 2048)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Classifier logits (N, 1008) from pool3 features (N, 2048)."""
        return self.fc(features)


def load_fid_inception(path: str | os.PathLike, device: str | torch.device = "cpu") -> FIDInceptionV3:
    """The FID Inception with the pytorch-fid weights file at ``path`` (never downloaded), in eval mode."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Inception weights {path} not found: supply pytorch-fid's {FID_WEIGHTS_NAME} "
            "(from its GitHub release 'fid_weights'); nothing is downloaded at run time"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise ValueError(f"{path}: not a readable torch state dict ({exc})") from None
    model = FIDInceptionV3()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise ValueError(
            f"{path}: not the FID Inception weights ({len(missing)} missing keys e.g. {missing[:2]}, "
            f"{len(unexpected)} unexpected e.g. {unexpected[:2]})"
        )
    return model.eval().to(device)

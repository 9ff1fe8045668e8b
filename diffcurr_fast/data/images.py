"""Image folders in ImageNet layout (``ROOT/<class>/<image>``) and ADM/DiT preprocessing.

Preprocessing follows ADM's ``center_crop_arr`` (used by DiT): halve the image with a box filter while its
short side is at least twice the target, resize bicubically so the short side equals the target, crop the
centre (offsets rounded down), then optionally flip horizontally and map [0, 255] to [-1, 1]
(``x / 127.5 - 1``, the same as ``ToTensor`` + ``Normalize(0.5, 0.5)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from diffcurr_fast.data.errors import BadDataReport, check_on_bad

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff")
CHECKS = ("none", "header", "full")


@dataclass(frozen=True)
class CropGeometry:
    """ADM centre-crop geometry of one image: size after box halvings, after the bicubic resize, crop offsets."""

    halved: tuple[int, int]  # (W, H) after the box-filter halvings
    resized: tuple[int, int]  # (W, H) after the bicubic resize
    offset: tuple[int, int]  # (x, y) of the crop's top-left corner


def adm_crop_geometry(width: int, height: int, image_size: int) -> CropGeometry:
    """The geometry ``center_crop_arr`` applies to a ``width`` x ``height`` image for ``image_size``."""
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    w, h = width, height
    while min(w, h) >= 2 * image_size:
        w, h = w // 2, h // 2
    scale = image_size / min(w, h)
    rw, rh = round(w * scale), round(h * scale)
    return CropGeometry((w, h), (rw, rh), ((rw - image_size) // 2, (rh - image_size) // 2))


def center_crop_arr(pil_image: Image.Image, image_size: int) -> np.ndarray:
    """ADM centre crop of a PIL image to ``image_size`` x ``image_size``; returns (H, W, C) uint8."""
    geo = adm_crop_geometry(*pil_image.size, image_size)
    while pil_image.size != geo.halved and min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    pil_image = pil_image.resize(geo.resized, resample=Image.BICUBIC)
    arr = np.asarray(pil_image)
    x, y = geo.offset
    return arr[y : y + image_size, x : x + image_size]


def to_unit_range(arr: np.ndarray, flip: bool = False) -> torch.Tensor:
    """(H, W, C) uint8 -> (C, H, W) float32 in [-1, 1], optionally flipped horizontally."""
    if flip:
        arr = arr[:, ::-1]
    x = torch.from_numpy(np.array(arr, copy=True)).permute(2, 0, 1).to(torch.float32)  # (C, H, W)
    return x / 127.5 - 1.0


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """Fully decode an image file as RGB; raises ``ValueError`` naming the file if it is corrupt or truncated."""
    try:
        with Image.open(path) as img:
            img.load()
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{path}: corrupt or truncated image ({exc})") from None


class ImageFolder:
    """The files of an ImageNet-layout folder: ``files[i]``, ``labels[i]`` (class index), ``classes``.

    Classes are the sorted subdirectory names (as torchvision's ``ImageFolder`` numbers them); images within a
    class are sorted by name.

    Args:
        root: the folder.
        on_bad: ``"stop"`` raises on a bad image; ``"skip"`` drops it (counted in ``report``).
        check: ``"none"`` (extension only), ``"header"`` (PIL ``verify``: header and, for PNG, checksums) or
            ``"full"`` (decode every image once; catches truncated JPEGs).
    """

    def __init__(self, root: str | os.PathLike, on_bad: str = "stop", check: str = "header") -> None:
        check_on_bad(on_bad)
        if check not in CHECKS:
            raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder {self.root} does not exist")
        self.report = BadDataReport(on_bad)
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        if not self.classes:
            raise ValueError(f"{self.root}: no class subdirectories (expected {self.root}/<class>/<image>)")
        self.files: list[Path] = []
        self.labels: list[int] = []
        for label, cls in enumerate(self.classes):
            for path in sorted((self.root / cls).iterdir()):
                if not path.is_file() or path.suffix.lower() not in IMAGE_EXTENSIONS:
                    continue
                if check != "none":
                    try:
                        self._check(path, check)
                    except ValueError as exc:
                        self.report.bad(path, f"corrupt: {str(exc).split(': ', 1)[-1]}")
                        continue
                self.files.append(path)
                self.labels.append(label)
        if not self.files:
            raise ValueError(
                f"{self.root}: no usable images with extensions {IMAGE_EXTENSIONS} "
                f"({self.report.summary() if len(self.report) else 'empty folder'})"
            )
        self.report.warn()

    @staticmethod
    def _check(path: Path, check: str) -> None:
        if check == "full":
            load_rgb(path)
            return
        try:
            with Image.open(path) as img:
                img.verify()
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
            raise ValueError(f"{path}: corrupt image ({exc})") from None

    def __len__(self) -> int:
        return len(self.files)


class ImageDataset(Dataset):
    """Images of an ``ImageFolder`` preprocessed as ADM/DiT do; item ``i`` or ``(i, flip)``.

    Returns ``(x (3, S, S) float32 in [-1, 1], label int64)``. An image that fails to decode at read time
    raises ``ValueError`` naming it under ``on_bad="stop"`` and returns ``None`` under ``"skip"`` (the loader's
    collate drops it and counts it).
    """

    def __init__(self, folder: ImageFolder, image_size: int) -> None:
        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        self.folder, self.image_size = folder, image_size

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: int | tuple[int, bool]) -> tuple[torch.Tensor, torch.Tensor] | None:
        index, flip = (key, False) if isinstance(key, (int, np.integer)) else key
        path = self.folder.files[int(index)]
        try:
            img = load_rgb(path)
        except ValueError:
            if self.folder.report.on_bad == "stop":
                raise
            return None
        x = to_unit_range(center_crop_arr(img, self.image_size), bool(flip))  # (3, S, S)
        return x, torch.tensor(self.folder.labels[int(index)], dtype=torch.int64)

"""Latent datasets on disk: the fast-DiT per-sample layout and our sharded layout, with writers for both.

fast-DiT layout (one sample per file, as fast-DiT's ``extract_features.py`` writes it)::

    ROOT/features/{i}.npy   float array (1, C, H, W) or (C, H, W)   (also accepted: ROOT/<name>_features/)
    ROOT/labels/{i}.npy     integer array (1,) or ()                 (ROOT/<name>_labels/)

Sharded layout (``diffcurr-latents`` v1; few large files, memory-mapped, random access)::

    ROOT/index.json                      {"format": "diffcurr-latents", "version": 1, "latent_shape": [C, H, W],
                                          "dtype": "float16"|"float32", "scale": 0.18215,
                                          "shards": [{"latents": "shard-00000.latents.npy",
                                                      "labels": "shard-00000.labels.npy", "count": n}, ...]}
    ROOT/shard-00000.latents.npy         (n, C, H, W) float16/float32
    ROOT/shard-00000.labels.npy          (n,) int64

Sample ``i`` of the sharded layout is row ``i - offset`` of the shard that holds it (shards in index order).
A shard enters ``index.json`` only once both of its files are complete, which makes writing resumable.
"""

from __future__ import annotations

import abc
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from diffcurr_fast._files import write_json
from diffcurr_fast.data.errors import BadDataReport, check_finite, check_on_bad

SHARDED_FORMAT = "diffcurr-latents"
SHARDED_VERSION = 1
LATENT_DTYPES = ("float16", "float32")


def read_npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a ``.npy`` file without reading its data; raises ``ValueError`` if unreadable/truncated."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}")
            offset = f.tell()
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ValueError(f"not a readable .npy file ({exc})") from None
    if dtype.hasobject:
        raise ValueError("object arrays are not allowed")
    need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = path.stat().st_size
    if size < need:
        raise ValueError(f"truncated: {size} bytes, header promises {need}")
    return tuple(int(s) for s in shape), dtype


def _stem_key(name: str) -> tuple[int, int | str]:
    stem = name[: -len(".npy")]
    return (0, int(stem)) if stem.isdigit() else (1, stem)


def find_fastdit_dirs(root: str | os.PathLike) -> tuple[Path, Path]:
    """(features dir, labels dir) of a fast-DiT layout under ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"latent directory {root} does not exist")
    if (root / "features").is_dir() and (root / "labels").is_dir():
        return root / "features", root / "labels"
    feats = sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith("_features"))
    for f in feats:
        lab = root / (f.name[: -len("_features")] + "_labels")
        if lab.is_dir():
            return f, lab
    raise FileNotFoundError(
        f"{root}: no fast-DiT layout (expected features/ and labels/, or <name>_features/ and <name>_labels/)"
    )


def detect_latent_format(root: str | os.PathLike) -> str:
    """``"sharded"`` when ``root/index.json`` exists, ``"fastdit"`` for a features/labels layout."""
    root = Path(root)
    if (root / "index.json").is_file():
        return "sharded"
    find_fastdit_dirs(root)
    return "fastdit"


class LatentDataset(Dataset, abc.ABC):
    """Common interface: ``len``, ``latent_shape``, ``read(i) -> (latent (C, H, W) float32, label)`` and
    ``__getitem__(i) -> (tensor (C, H, W) float32, tensor () int64)``; ``report`` holds skipped files."""

    latent_shape: tuple[int, int, int]
    report: BadDataReport

    @abc.abstractmethod
    def read(self, index: int) -> tuple[np.ndarray, int]:
        """Sample ``index`` as (latent (C, H, W) float32, integer label)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        lat, label = self.read(int(index))
        return torch.from_numpy(lat), torch.tensor(label, dtype=torch.int64)


def _check_latent_shape(shape: tuple[int, ...], leading: bool) -> tuple[int, int, int] | None:
    if len(shape) == 4 and leading and shape[0] == 1:
        shape = shape[1:]
    return shape if len(shape) == 3 and all(s > 0 for s in shape) else None  # type: ignore[return-value]


class FastDiTLatents(LatentDataset):
    """fast-DiT per-sample ``.npy`` latents; files are validated (header, size, shape, dtype, pairing) at open.

    Args:
        root: directory holding ``features/`` and ``labels/`` (or ``<name>_features/``, ``<name>_labels/``).
        on_bad: ``"stop"`` raises on the first bad file; ``"skip"`` drops it and records it in ``report``.
        latent_shape: expected (C, H, W); default: the shape of the first valid file.
    """

    def __init__(
        self, root: str | os.PathLike, on_bad: str = "stop", latent_shape: tuple[int, int, int] | None = None
    ) -> None:
        check_on_bad(on_bad)
        self.root = Path(root)
        self.features_dir, self.labels_dir = find_fastdit_dirs(root)
        self.report = BadDataReport(on_bad)
        feats = {p.name for p in self.features_dir.iterdir() if p.name.endswith(".npy")}
        labs = {p.name for p in self.labels_dir.iterdir() if p.name.endswith(".npy")}
        if not feats and not labs:
            raise ValueError(f"{self.features_dir}: no .npy files (empty latent directory)")
        for name in sorted(labs - feats, key=_stem_key):
            self.report.bad(self.labels_dir / name, "unpaired: label without a feature file")
        expected = tuple(latent_shape) if latent_shape is not None else None
        self.feature_files: list[Path] = []
        self.label_files: list[Path] = []
        for name in sorted(feats, key=_stem_key):
            fpath, lpath = self.features_dir / name, self.labels_dir / name
            if name not in labs:
                self.report.bad(fpath, f"unpaired: no label file {lpath}")
                continue
            try:
                fshape, fdtype = read_npy_header(fpath)
            except ValueError as exc:
                self.report.bad(fpath, f"corrupt: {exc}")
                continue
            try:
                lshape, ldtype = read_npy_header(lpath)
            except ValueError as exc:
                self.report.bad(lpath, f"corrupt: {exc}")
                continue
            shape = _check_latent_shape(fshape, leading=True)
            if shape is None:
                self.report.bad(fpath, f"wrong shape: {fshape}, expected (1, C, H, W) or (C, H, W)")
                continue
            if fdtype.kind != "f":
                self.report.bad(fpath, f"wrong dtype: {fdtype}, expected a float dtype")
                continue
            if expected is None:
                expected = shape
            elif shape != expected:
                self.report.bad(fpath, f"wrong shape: {shape}, other latents are {expected}")
                continue
            if lshape not in ((), (1,)) or ldtype.kind not in "iu":
                self.report.bad(lpath, f"wrong label: shape {lshape} dtype {ldtype}, expected an integer (1,) or ()")
                continue
            self.feature_files.append(fpath)
            self.label_files.append(lpath)
        if not self.feature_files:
            raise ValueError(f"{self.root}: no usable latents ({self.report.summary()})")
        self.latent_shape = expected  # type: ignore[assignment]
        self.report.warn()

    def __len__(self) -> int:
        return len(self.feature_files)

    def read(self, index: int) -> tuple[np.ndarray, int]:
        lat = np.load(self.feature_files[index]).reshape(self.latent_shape).astype(np.float32, copy=False)
        check_finite(lat[None], str(self.feature_files[index]), offset=index)
        return lat, int(np.load(self.label_files[index]).reshape(()))


class ShardedLatents(LatentDataset):
    """Our sharded layout (see the module docstring), memory-mapped; shards are validated at open.

    A bad shard (missing/truncated file, wrong shape or dtype, count not matching the index, labels not matching
    latents) raises under ``on_bad="stop"`` or is dropped whole under ``"skip"``.
    """

    def __init__(self, root: str | os.PathLike, on_bad: str = "stop") -> None:
        check_on_bad(on_bad)
        self.root = Path(root)
        self.report = BadDataReport(on_bad)
        index_path = self.root / "index.json"
        if not index_path.is_file():
            raise FileNotFoundError(f"{index_path} not found (not a {SHARDED_FORMAT} directory)")
        try:
            meta = json.loads(index_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{index_path}: invalid JSON ({exc})") from None
        if meta.get("format") != SHARDED_FORMAT or meta.get("version") != SHARDED_VERSION:
            raise ValueError(
                f"{index_path}: format {meta.get('format')!r} v{meta.get('version')}, "
                f"expected {SHARDED_FORMAT!r} v{SHARDED_VERSION}"
            )
        self.meta = meta
        self.latent_shape = tuple(int(s) for s in meta["latent_shape"])  # type: ignore[assignment]
        dtype = meta.get("dtype", "float32")
        if dtype not in LATENT_DTYPES:
            raise ValueError(f"{index_path}: dtype {dtype!r}, expected one of {LATENT_DTYPES}")
        self.scale = float(meta.get("scale", 1.0))
        self._latents: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._paths: list[Path] = []
        for shard in meta.get("shards", []):
            lat_path, lab_path, count = self.root / shard["latents"], self.root / shard["labels"], int(shard["count"])
            try:
                lat = np.load(lat_path, mmap_mode="r")
            except (OSError, ValueError) as exc:
                self.report.bad(lat_path, f"corrupt: {exc}")
                continue
            try:
                lab = np.load(lab_path, mmap_mode="r")
            except (OSError, ValueError) as exc:
                self.report.bad(lab_path, f"corrupt: {exc}")
                continue
            if lat.shape != (count, *self.latent_shape) or lat.dtype != np.dtype(dtype):
                self.report.bad(
                    lat_path,
                    f"wrong shape: {lat.shape} {lat.dtype}, index says ({count}, *{self.latent_shape}) {dtype}",
                )
                continue
            if lab.shape != (count,) or lab.dtype.kind not in "iu":
                self.report.bad(
                    lab_path, f"labels not matching latents: {lab.shape} {lab.dtype}, expected ({count},) int"
                )
                continue
            self._latents.append(lat)
            self._labels.append(lab)
            self._paths.append(lat_path)
        counts = [len(x) for x in self._latents]
        self._offsets = np.cumsum([0, *counts])
        if self._offsets[-1] == 0:
            raise ValueError(f"{self.root}: no usable latents ({self.report.summary()})")
        self.report.warn()

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, row) of sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} latents")
        shard = int(np.searchsorted(self._offsets, index, side="right")) - 1
        return shard, index - int(self._offsets[shard])

    def read(self, index: int) -> tuple[np.ndarray, int]:
        shard, row = self.locate(index)
        lat = np.array(self._latents[shard][row], dtype=np.float32)
        check_finite(lat[None], f"{self._paths[shard]} row {row}", offset=index)
        return lat, int(self._labels[shard][row])


def open_latents(root: str | os.PathLike, on_bad: str = "stop") -> LatentDataset:
    """Open a latent directory in either layout (detected from its contents)."""
    fmt = detect_latent_format(root)
    return ShardedLatents(root, on_bad) if fmt == "sharded" else FastDiTLatents(root, on_bad)


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


class FastDiTLatentWriter:
    """Writes the fast-DiT layout (``features/{i}.npy`` as (1, C, H, W) float32, ``labels/{i}.npy`` as (1,) int64).

    Resumable: ``num_written`` counts the leading complete pairs already on disk; ``write`` continues after them.
    """

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self.features_dir, self.labels_dir = self.out / "features", self.out / "labels"
        self.features_dir.mkdir(parents=True, exist_ok=True)
        self.labels_dir.mkdir(parents=True, exist_ok=True)
        n = 0
        while (self.features_dir / f"{n}.npy").is_file() and (self.labels_dir / f"{n}.npy").is_file():
            n += 1
        self.num_written = n

    def write(self, latents: np.ndarray, labels: np.ndarray) -> None:
        """Append a batch: ``latents`` (B, C, H, W), ``labels`` (B,)."""
        latents, labels = np.asarray(latents, dtype=np.float32), np.asarray(labels, dtype=np.int64)
        if latents.ndim != 4 or labels.shape != (latents.shape[0],):
            raise ValueError(f"expected latents (B, C, H, W) and labels (B,), got {latents.shape} and {labels.shape}")
        for lat, lab in zip(latents, labels):
            i = self.num_written
            # Label first, feature last: a feature file only exists once its label does.
            _atomic_save(self.labels_dir / f"{i}.npy", lab.reshape(1))
            _atomic_save(self.features_dir / f"{i}.npy", lat[None])
            self.num_written += 1

    def close(self) -> None:
        """Nothing is buffered; present for symmetry with ``ShardedLatentWriter``."""


class ShardedLatentWriter:
    """Writes the sharded layout; resumable (``num_written`` = samples in complete shards of ``index.json``).

    Args:
        out: output directory.
        latent_shape: (C, H, W).
        shard_size: samples per shard (the last shard may be shorter).
        dtype: ``"float16"`` or ``"float32"`` on disk.
        scale: latent scale factor recorded in the index (e.g. 0.18215 for the SD VAE).
    """

    def __init__(
        self,
        out: str | os.PathLike,
        latent_shape: tuple[int, int, int],
        shard_size: int = 4096,
        dtype: str = "float32",
        scale: float = 1.0,
    ) -> None:
        if dtype not in LATENT_DTYPES:
            raise ValueError(f"dtype must be one of {LATENT_DTYPES}, got {dtype!r}")
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.latent_shape, self.shard_size, self.dtype = tuple(int(s) for s in latent_shape), shard_size, dtype
        index = self.out / "index.json"
        if index.is_file():
            meta = json.loads(index.read_text(encoding="utf-8"))
            if tuple(meta["latent_shape"]) != self.latent_shape or meta["dtype"] != dtype:
                raise ValueError(
                    f"{index}: existing latents are {tuple(meta['latent_shape'])} {meta['dtype']}, "
                    f"cannot resume with {self.latent_shape} {dtype}"
                )
            self.meta = meta
        else:
            self.meta = {
                "format": SHARDED_FORMAT,
                "version": SHARDED_VERSION,
                "latent_shape": list(self.latent_shape),
                "dtype": dtype,
                "scale": float(scale),
                "shards": [],
            }
        self.num_written = sum(int(s["count"]) for s in self.meta["shards"])
        self._buf_lat: list[np.ndarray] = []
        self._buf_lab: list[np.ndarray] = []

    def write(self, latents: np.ndarray, labels: np.ndarray) -> None:
        """Append a batch: ``latents`` (B, C, H, W), ``labels`` (B,); full shards are flushed to disk."""
        latents, labels = np.asarray(latents), np.asarray(labels, dtype=np.int64)
        if latents.shape[1:] != self.latent_shape or labels.shape != (latents.shape[0],):
            raise ValueError(
                f"expected latents (B, *{self.latent_shape}) and labels (B,), got {latents.shape} and {labels.shape}"
            )
        self._buf_lat.extend(latents.astype(self.dtype))
        self._buf_lab.extend(labels)
        while len(self._buf_lat) >= self.shard_size:
            self._flush(self.shard_size)

    def _flush(self, n: int) -> None:
        k = len(self.meta["shards"])
        lat_name, lab_name = f"shard-{k:05d}.latents.npy", f"shard-{k:05d}.labels.npy"
        _atomic_save(self.out / lat_name, np.stack(self._buf_lat[:n]))
        _atomic_save(self.out / lab_name, np.asarray(self._buf_lab[:n], dtype=np.int64))
        del self._buf_lat[:n], self._buf_lab[:n]
        self.meta["shards"].append({"latents": lat_name, "labels": lab_name, "count": n})
        self.num_written += n
        write_json(self.meta, self.out / "index.json", indent=1)

    def close(self) -> None:
        """Flush the last (possibly short) shard."""
        if self._buf_lat:
            self._flush(len(self._buf_lat))

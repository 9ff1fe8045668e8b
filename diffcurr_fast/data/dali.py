"""NVIDIA DALI pipelines for latents and images, fed in the sample order of ``data.order``.

DALI is imported lazily: nothing here is needed unless ``backend="dali"`` is chosen. Pipelines run CPU-only
with ``device_id=None``; with a GPU ``device_id`` images can be decoded with ``decoder_device="mixed"``.

Both pipelines read exactly the dataset indices they are given (one pipeline per epoch), so they yield the
same samples as the torch DataLoader fallback for the same seed, epoch and shard:

* latents, fast-DiT layout: ``fn.readers.numpy`` over the feature/label file lists in that order;
* latents, sharded layout: ``fn.external_source`` reading rows of the memory-mapped shards in that order;
* images: ``fn.external_source`` supplies encoded bytes, label, flip decision and the ADM crop geometry
  (computed from the image header); DALI decodes, resizes (bicubic, antialiased), slices the centre crop,
  flips and normalises to [-1, 1] in CHW. Crop offsets and sizes equal ``center_crop_arr``'s exactly; the
  resampling filter is DALI's, so pixels of images that need resizing differ slightly from PIL's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from diffcurr_fast.data.images import ImageFolder, adm_crop_geometry
from diffcurr_fast.data.latents import FastDiTLatents, LatentDataset

DECODER_DEVICES = ("cpu", "mixed")


def dali_available() -> bool:
    """Whether ``nvidia.dali`` can be imported."""
    try:
        importlib.import_module("nvidia.dali")
    except ImportError:
        return False
    return True


def require_dali():
    """Import and return ``nvidia.dali``; raises ``ImportError`` with the install command when it is missing."""
    try:
        return importlib.import_module("nvidia.dali")
    except ImportError as exc:
        raise ImportError(
            "backend='dali' needs NVIDIA DALI: pip install nvidia-dali-cuda130 (or use backend='torch')"
        ) from exc


def _to_torch(out) -> torch.Tensor:
    """A DALI TensorList (uniform shape) as a torch tensor that owns its memory (DALI reuses its buffers)."""
    if type(out).__name__ == "TensorListGPU":
        return torch.from_dlpack(out.as_tensor()).clone()  # stays on the pipeline's GPU
    return torch.from_numpy(np.array(out.as_tensor()))


def latent_pipeline(
    dataset: LatentDataset,
    indices: Sequence[int],
    batch_size: int,
    num_threads: int = 2,
    device_id: int | None = None,
    prefetch_queue_depth: int = 2,
):
    """A built DALI pipeline yielding ``(latents (B, C, H, W) float32, labels (B,) int64)`` for ``indices``."""
    dali = require_dali()
    fn, types = dali.fn, dali.types
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) == 0:
        raise ValueError("latent_pipeline needs at least one index")
    shape = list(dataset.latent_shape)

    @dali.pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=prefetch_queue_depth,
    )
    def pipe():
        if isinstance(dataset, FastDiTLatents):
            feats = [str(dataset.feature_files[i]) for i in indices]
            labs = [str(dataset.label_files[i]) for i in indices]
            x = fn.readers.numpy(files=feats, random_shuffle=False, pad_last_batch=True, name="latents")
            y = fn.readers.numpy(files=labs, random_shuffle=False, pad_last_batch=True)
        else:

            def source(info):
                lat, label = dataset.read(int(indices[info.idx_in_epoch % len(indices)]))
                return lat, np.asarray(label, dtype=np.int64)

            x, y = fn.external_source(source=source, num_outputs=2, batch=False, dtype=[types.FLOAT, types.INT64])
        x = fn.reshape(fn.cast(x, dtype=types.FLOAT), shape=shape)  # (C, H, W)
        y = fn.reshape(fn.cast(y, dtype=types.INT64), shape=[])  # ()
        return x, y

    p = pipe()
    p.build()
    return p


class _ImageSource:
    """Per-sample callback of the image pipeline: encoded bytes, label, flip and ADM crop geometry."""

    def __init__(self, files: list[str], labels: list[int], indices: np.ndarray, flips: np.ndarray, size: int):
        self.files, self.labels, self.indices, self.flips, self.size = files, labels, indices, flips, size

    def __call__(self, info):
        pos = info.idx_in_epoch % len(self.indices)
        i = int(self.indices[pos])
        path = self.files[i]
        try:
            with Image.open(path) as img:
                width, height = img.size
        except (OSError, SyntaxError, ValueError) as exc:
            raise ValueError(f"{path}: corrupt image header ({exc})") from None
        geo = adm_crop_geometry(width, height, self.size)
        return (
            np.fromfile(path, dtype=np.uint8),
            np.asarray(self.labels[i], dtype=np.int64),
            np.asarray(self.flips[pos], dtype=np.int32),
            np.asarray(geo.resized[::-1], dtype=np.float32),  # (H, W)
            np.asarray(geo.offset[::-1], dtype=np.int32),  # (y, x)
        )


def py_start_method(device_id: int | None) -> str:
    """How DALI starts its Python workers: ``fork`` is refused once CUDA is initialised (a GPU pipeline, or the
    trainer's model on the GPU), so those use ``spawn``; CPU-only processes keep the quicker ``fork``."""
    return "spawn" if device_id is not None or torch.cuda.is_initialized() else "fork"


def image_pipeline(
    folder: ImageFolder,
    indices: Sequence[int],
    flips: Sequence[bool],
    image_size: int,
    batch_size: int,
    num_threads: int = 2,
    device_id: int | None = None,
    decoder_device: str = "cpu",
    prefetch_queue_depth: int = 2,
    py_workers: int = 0,
):
    """A built DALI pipeline yielding ``(images (B, 3, S, S) float32 in [-1, 1], labels (B,) int64)``.

    ``py_workers > 0`` reads files and headers in that many Python workers (DALI's parallel external source,
    started as ``py_start_method`` says; the pipeline is built per epoch, so are its workers); 0 reads them in
    the pipeline's own thread.
    """
    dali = require_dali()
    fn, types = dali.fn, dali.types
    if decoder_device not in DECODER_DEVICES:
        raise ValueError(f"decoder_device must be one of {DECODER_DEVICES}, got {decoder_device!r}")
    if decoder_device == "mixed" and device_id is None:
        raise ValueError("decoder_device='mixed' needs a GPU device_id (got None); use decoder_device='cpu'")
    indices = np.asarray(indices, dtype=np.int64)
    flips = np.asarray(flips, dtype=bool)
    if len(indices) == 0 or len(flips) != len(indices):
        raise ValueError(f"image_pipeline needs matching non-empty indices and flips, got {len(indices)}/{len(flips)}")
    source = _ImageSource([str(p) for p in folder.files], list(folder.labels), indices, flips, image_size)
    workers = max(0, int(py_workers))

    @dali.pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=prefetch_queue_depth,
        py_num_workers=max(1, workers),
        py_start_method=py_start_method(device_id),
    )
    def pipe():
        enc, y, flip, size, anchor = fn.external_source(
            source=source,
            num_outputs=5,
            batch=False,
            parallel=workers > 0,
            dtype=[types.UINT8, types.INT64, types.INT32, types.FLOAT, types.INT32],
        )
        img = fn.decoders.image(enc, device=decoder_device, output_type=types.RGB)  # (H0, W0, 3) uint8
        img = fn.resize(img, size=size, interp_type=types.INTERP_CUBIC, antialias=True)  # (h, w, 3)
        img = fn.slice(
            img,
            anchor,
            np.array([image_size, image_size], dtype=np.int32),
            axes=[0, 1],
            normalized_anchor=False,
            normalized_shape=False,
        )  # (S, S, 3)
        x = fn.crop_mirror_normalize(
            img, mirror=flip, mean=[127.5] * 3, std=[127.5] * 3, dtype=types.FLOAT, output_layout="CHW"
        )  # (3, S, S) in [-1, 1]
        return x, y

    p = pipe()
    p.build()
    return p


def iterate_pipeline(
    pipe, num_samples: int, batch_size: int, describe: Callable[[int, int], str] | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``pipe`` for ``ceil(num_samples / batch_size)`` batches, trimming the padded tail of the last one.

    ``describe(first, last)`` names the files of a failing batch in the error message.
    """
    done = 0
    while done < num_samples:
        try:
            x, y = pipe.run()
        except RuntimeError as exc:
            where = describe(done, min(done + batch_size, num_samples)) if describe is not None else ""
            first = str(exc).strip().splitlines()
            reason = next((line for line in first if "error" in line.lower()), first[0] if first else "")
            raise ValueError(f"DALI failed on a batch of {where}: {reason}") from exc
        take = min(batch_size, num_samples - done)
        xt, yt = _to_torch(x), _to_torch(y)
        yield xt[:take], yt[:take]
        done += take

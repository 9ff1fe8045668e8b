"""NVIDIA DALI pipelines for latents and images, fed in the sample order of ``data.order``.

DALI is imported lazily: nothing here is needed unless ``backend="dali"`` is chosen. Pipelines run CPU-only
with ``device_id=None``; with a GPU ``device_id`` images can be decoded with ``decoder_device="mixed"``.

A pipeline is built once and runs epoch after epoch: its external source maps DALI's running sample position
to a (dataset index, flip) through an ``EpochStream`` (the loader's order for each epoch in turn, every epoch
padded to whole batches), so it yields the same samples as the torch DataLoader fallback for the same seed,
epoch and shard, and the batches DALI prefetches past an epoch's end are already the next epoch's:

* latents, fast-DiT layout: ``fn.external_source`` names each sample's feature and label files,
  ``fn.io.file.read`` + ``fn.decoders.numpy`` read them in DALI's threads;
* latents, sharded layout: ``fn.external_source`` reading rows of the memory-mapped shards;
* images: ``fn.external_source`` supplies encoded bytes, label, flip decision and the ADM crop geometry
  (computed from the image header); DALI decodes, resizes (bicubic, antialiased), slices the centre crop,
  flips and normalises to [-1, 1] in CHW. Crop offsets and sizes equal ``center_crop_arr``'s exactly; the
  resampling filter is DALI's, so pixels of images that need resizing differ slightly from PIL's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

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


def _path_bytes(path) -> np.ndarray:
    """A file path as the 1-D uint8 array ``fn.io.file.read`` takes."""
    return np.frombuffer(str(path).encode(), dtype=np.uint8)


class EpochStream:
    """The samples of a pipeline that runs epochs back to back, by DALI's sample position.

    Epoch ``epoch`` from position ``start``, then every later epoch from 0; each epoch's samples
    (``keys(e, s)`` -> (dataset indices, flips)) are padded with its last sample to a whole number of batches,
    which ``iterate_pipeline`` trims. The external source never ends DALI's epoch, so ``SampleInfo.idx_in_epoch``
    counts samples from the build on and ``stream(pos)`` is a pure function of it: parallel workers hold a copy
    (``keys`` must pickle), each caching the keys of the epochs it is reading.
    """

    def __init__(
        self,
        keys: Callable[[int, int], tuple[np.ndarray, np.ndarray]],
        epoch: int,
        start: int,
        samples_per_epoch: int,
        batch_size: int,
    ) -> None:
        if not 0 <= start < samples_per_epoch:
            raise ValueError(f"EpochStream needs 0 <= start < samples_per_epoch ({samples_per_epoch}), got {start}")
        self.keys, self.epoch, self.start = keys, int(epoch), int(start)
        self.samples_per_epoch, self.batch_size = int(samples_per_epoch), int(batch_size)
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _padded(self, n: int) -> int:
        return -(-n // self.batch_size) * self.batch_size

    def locate(self, pos: int) -> tuple[int, int, int]:
        """(epoch, start of that epoch's keys, position within them) of stream position ``pos``."""
        first = self._padded(self.samples_per_epoch - self.start)
        if pos < first:
            return self.epoch, self.start, pos
        later, k = divmod(pos - first, self._padded(self.samples_per_epoch))
        return self.epoch + 1 + later, 0, k

    def __call__(self, pos: int) -> tuple[int, bool]:
        """(dataset index, flip) at stream position ``pos``."""
        epoch, start, k = self.locate(pos)
        key = (epoch, start)
        if key not in self._cache:
            if len(self._cache) >= 2:  # prefetching reads at most two epochs at a time
                self._cache.pop(min(self._cache))
            self._cache[key] = self.keys(epoch, start)
        idx, flips = self._cache[key]
        k = min(k, len(idx) - 1)  # the padding of the epoch's last batch
        return int(idx[k]), bool(flips[k])


def latent_pipeline(
    dataset: LatentDataset,
    stream: EpochStream,
    batch_size: int,
    num_threads: int = 2,
    device_id: int | None = None,
    prefetch_queue_depth: int = 2,
):
    """A built DALI pipeline yielding ``(latents (B, C, H, W) float32, labels (B,) int64)`` in ``stream``'s order."""
    dali = require_dali()
    fn, types = dali.fn, dali.types
    shape = list(dataset.latent_shape)

    @dali.pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=prefetch_queue_depth,
    )
    def pipe():
        if isinstance(dataset, FastDiTLatents):  # the source names the files; DALI's threads read and decode them

            def source(info):
                i = stream(info.idx_in_epoch)[0]
                return _path_bytes(dataset.feature_files[i]), _path_bytes(dataset.label_files[i])

            feat, lab = fn.external_source(source=source, num_outputs=2, batch=False, dtype=[types.UINT8] * 2)
            x = fn.decoders.numpy(fn.io.file.read(feat))
            y = fn.decoders.numpy(fn.io.file.read(lab))
        else:

            def source(info):
                lat, label = dataset.read(stream(info.idx_in_epoch)[0])
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

    def __init__(self, files: list[str], labels: list[int], stream: EpochStream, size: int):
        self.files, self.labels, self.stream, self.size = files, labels, stream, size

    def __call__(self, info):
        i, flip = self.stream(info.idx_in_epoch)
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
            np.asarray(flip, dtype=np.int32),
            np.asarray(geo.resized[::-1], dtype=np.float32),  # (H, W)
            np.asarray(geo.offset[::-1], dtype=np.int32),  # (y, x)
        )


def py_start_method(device_id: int | None) -> str:
    """How DALI starts its Python workers: ``fork`` is refused once CUDA is initialised (a GPU pipeline, or the
    trainer's model on the GPU), so those use ``spawn``; CPU-only processes keep the quicker ``fork``."""
    return "spawn" if device_id is not None or torch.cuda.is_initialized() else "fork"


def image_pipeline(
    folder: ImageFolder,
    stream: EpochStream,
    image_size: int,
    batch_size: int,
    num_threads: int = 2,
    device_id: int | None = None,
    decoder_device: str = "cpu",
    prefetch_queue_depth: int = 2,
    py_workers: int = 0,
):
    """A built DALI pipeline yielding ``(images (B, 3, S, S) float32 in [-1, 1], labels (B,) int64)`` in
    ``stream``'s order.

    ``py_workers > 0`` reads files and headers in that many Python workers (DALI's parallel external source,
    started as ``py_start_method`` says, once per pipeline); 0 reads them in the pipeline's own thread.
    """
    dali = require_dali()
    fn, types = dali.fn, dali.types
    if decoder_device not in DECODER_DEVICES:
        raise ValueError(f"decoder_device must be one of {DECODER_DEVICES}, got {decoder_device!r}")
    if decoder_device == "mixed" and device_id is None:
        raise ValueError("decoder_device='mixed' needs a GPU device_id (got None); use decoder_device='cpu'")
    source = _ImageSource([str(p) for p in folder.files], list(folder.labels), stream, image_size)
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

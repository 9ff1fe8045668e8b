"""One sample order shared by every loader: per-epoch permutation, rank sharding, resume position.

The DALI pipelines and the torch DataLoader fallback both read samples in the order computed here, so a
given ``(seed, epoch, shard_id, num_shards)`` yields the same samples whichever backend reads them.

Order of epoch ``e``: ``perm_e = permutation(num_samples, seed=(seed, e))`` (NumPy PCG64, identical on every
rank); rank ``r`` of ``R`` takes ``perm_e[r::R]`` (so the ranks together cover the data exactly once; the
first ``num_samples % R`` ranks get one sample more unless ``drop_last``/``pad`` make the counts equal); a
resumed run skips the first ``start`` samples of its rank's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Global order of sample indices for ``epoch``: a seeded permutation (or ``arange`` without shuffle)."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([int(seed) & 0xFFFFFFFF, int(epoch)]))
    return rng.permutation(num_samples).astype(np.int64)


def flip_decisions(indices: np.ndarray, num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Horizontal-flip decision (bool, p = 0.5) per sample index for ``epoch``; independent of sharding."""
    rng = np.random.Generator(np.random.PCG64([int(seed) & 0xFFFFFFFF, int(epoch), 0x0F11]))
    # One Bernoulli draw per dataset index (not per position), so a sample flips the same way on any rank.
    table = rng.random(num_samples) < 0.5
    return table[np.asarray(indices, dtype=np.int64)]


@dataclass(frozen=True)
class ShardedOrder:
    """The sample order of one rank: ``indices(epoch)`` gives the dataset indices it reads, in order.

    Args:
        num_samples: dataset size.
        seed: shuffling seed (the same on every rank).
        shard_id: this rank, in ``[0, num_shards)``.
        num_shards: number of ranks.
        shuffle: reshuffle every epoch (False: dataset order).
        drop_last: drop the trailing samples so every rank gets ``num_samples // num_shards``.
        pad: repeat samples from the start of the epoch order so every rank gets ``ceil(num_samples / num_shards)``
            (the ``DistributedSampler`` convention; then the ranks cover some samples twice).
    """

    num_samples: int
    seed: int = 0
    shard_id: int = 0
    num_shards: int = 1
    shuffle: bool = True
    drop_last: bool = False
    pad: bool = False

    def __post_init__(self) -> None:
        if self.num_samples <= 0:
            raise ValueError(f"num_samples must be > 0, got {self.num_samples} (empty dataset?)")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_id < self.num_shards:
            raise ValueError(f"shard_id must be in [0, {self.num_shards}), got {self.shard_id}")
        if self.drop_last and self.pad:
            raise ValueError("drop_last and pad are exclusive: choose one of drop_last=True or pad=True")
        if self.drop_last and self.num_samples < self.num_shards:
            raise ValueError(f"drop_last with {self.num_samples} samples over {self.num_shards} shards leaves none")

    def __len__(self) -> int:
        n, r = self.num_samples, self.num_shards
        if self.drop_last:
            return n // r
        if self.pad:
            return -(-n // r)
        return n // r + (1 if self.shard_id < n % r else 0)

    def global_order(self, epoch: int) -> np.ndarray:
        """The epoch's global order (after drop_last truncation or padding), before taking this rank's slice."""
        perm = epoch_permutation(self.num_samples, self.seed, epoch, self.shuffle)
        r = self.num_shards
        if self.drop_last:
            perm = perm[: (self.num_samples // r) * r]
        elif self.pad:
            total = -(-self.num_samples // r) * r
            reps = -(-total // self.num_samples)
            perm = np.tile(perm, reps)[:total]
        return perm

    def indices(self, epoch: int, start: int = 0) -> np.ndarray:
        """Dataset indices this rank reads in ``epoch``, skipping the first ``start`` (resume position)."""
        if not 0 <= start <= len(self):
            raise ValueError(f"start must be in [0, {len(self)}] for this shard, got {start}")
        return self.global_order(epoch)[self.shard_id :: self.num_shards][start:]

    def flips(self, epoch: int, start: int = 0) -> np.ndarray:
        """Horizontal-flip decisions aligned with ``indices(epoch, start)``."""
        return flip_decisions(self.indices(epoch, start), self.num_samples, self.seed, epoch)

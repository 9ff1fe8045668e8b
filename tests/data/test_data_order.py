import numpy as np
import pytest

from diffcurr_fast.data.order import ShardedOrder, epoch_permutation, flip_decisions


@pytest.mark.parametrize("n,shards", [(n, r) for n in (1, 3, 17, 100) for r in (1, 2, 3, 4) if r <= n])
def test_shards_cover_data_exactly_once(n, shards):
    for epoch in (0, 3):
        parts = [ShardedOrder(n, seed=5, shard_id=r, num_shards=shards).indices(epoch) for r in range(shards)]
        assert sorted(np.concatenate(parts).tolist()) == list(range(n))
        assert [len(p) for p in parts] == [len(ShardedOrder(n, 5, r, shards)) for r in range(shards)]


def test_drop_last_and_pad_equalise_shards():
    n, r = 17, 3
    dropped = [ShardedOrder(n, 1, s, r, drop_last=True).indices(0) for s in range(r)]
    assert {len(p) for p in dropped} == {5} and len(set(np.concatenate(dropped).tolist())) == 15
    padded = [ShardedOrder(n, 1, s, r, pad=True).indices(0) for s in range(r)]
    assert {len(p) for p in padded} == {6} and set(np.concatenate(padded).tolist()) == set(range(n))
    with pytest.raises(ValueError, match="exclusive"):
        ShardedOrder(n, drop_last=True, pad=True)


def test_reshuffle_per_epoch_deterministic():
    a0, a1 = epoch_permutation(17, 3, 0), epoch_permutation(17, 3, 1)
    assert not np.array_equal(a0, a1)
    np.testing.assert_array_equal(a0, epoch_permutation(17, 3, 0))
    assert not np.array_equal(a0, epoch_permutation(17, 4, 0))
    np.testing.assert_array_equal(epoch_permutation(5, 3, 2, shuffle=False), np.arange(5))


def test_resume_start_and_flips():
    order = ShardedOrder(17, seed=2, shard_id=1, num_shards=2)
    full = order.indices(4)
    np.testing.assert_array_equal(order.indices(4, start=3), full[3:])
    np.testing.assert_array_equal(order.flips(4, start=3), order.flips(4)[3:])
    # a sample's flip does not depend on which rank reads it
    table = flip_decisions(np.arange(17), 17, 2, 4)
    np.testing.assert_array_equal(order.flips(4), table[full])
    assert 0 < table.sum() < 17
    with pytest.raises(ValueError, match="start must be in"):
        order.indices(0, start=len(order) + 1)


def test_bad_order_arguments():
    with pytest.raises(ValueError, match="empty dataset"):
        ShardedOrder(0)
    with pytest.raises(ValueError, match="shard_id"):
        ShardedOrder(5, shard_id=2, num_shards=2)
    with pytest.raises(ValueError, match="num_shards"):
        ShardedOrder(5, num_shards=0)

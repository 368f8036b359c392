"""The packed int4 layout and exact grid recovery from 16-bit values."""

import pytest
import torch

from qat4.checkpoint.packing import PackedTensor, dequantize, pack_levels, recover_grid, unpack_levels
from qat4.errors import Qat4Error


def on_grid(rows, cols, generator, dtype=torch.bfloat16):
    """Random levels in -8..7 and steps with four significant bits: step x level is exact in bf16."""
    levels = torch.randint(-8, 8, (rows, cols), generator=generator)
    mantissa = torch.randint(8, 16, (rows, cols // 32, 1), generator=generator).float()
    exponent = torch.randint(-12, -6, (rows, cols // 32, 1), generator=generator).float()
    steps = mantissa * 2.0 ** (exponent - 3)
    dense = (levels.view(rows, -1, 32).float() * steps).view(rows, cols)
    return levels, steps.view(rows, -1), dense.to(dtype)


def test_pack_matches_compressed_tensors_bit_order():
    levels = torch.tensor([[-8, -7, 0, 1, 2, 3, 7, -1] * 4])
    word = pack_levels(levels)[0, 0].item() & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 1, 8, 9, 10, 11, 15, 7]


def test_pack_unpack_roundtrip_covers_every_code():
    g = torch.Generator().manual_seed(0)
    levels = torch.randint(-8, 8, (37, 96), generator=g)
    levels[0, :16] = torch.arange(-8, 8)
    packed = pack_levels(levels)
    assert packed.dtype == torch.int32 and packed.shape == (37, 12)
    assert torch.equal(unpack_levels(packed).long(), levels)


def test_dequantize_is_scale_times_level():
    g = torch.Generator().manual_seed(1)
    levels, steps, dense = on_grid(5, 64, g, torch.float32)
    got = dequantize(pack_levels(levels), steps.half())
    assert torch.equal(got, (levels.view(5, 2, 32).float() * steps.half().float().unsqueeze(-1)).view(5, 64))


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_recover_grid_is_exact(scale_dtype):
    g = torch.Generator().manual_seed(2)
    levels, steps, dense = on_grid(64, 256, g)
    packed, report = recover_grid(dense, "t", scale_dtype)
    assert torch.equal(packed.levels().long(), levels)
    assert torch.equal(packed.scales.float(), steps)
    assert report.exact == report.elements == 64 * 256 and report.worst_ulp_steps == 0


def test_recover_grid_does_not_assume_peak_at_level_8():
    # A group whose largest magnitude is level 5: amax / 8 would re-quantise it.
    levels = torch.tensor([[5, -3, 1, 0, 2, -4, 3, -1] * 4])
    dense = (levels.float() * 0.0078125).bfloat16()
    packed, report = recover_grid(dense, "t")
    assert torch.equal(packed.levels().long(), levels)
    assert packed.scales.float().item() == 0.0078125
    assert report.exact == 32


def test_recover_grid_zero_group():
    packed, report = recover_grid(torch.zeros(2, 32, dtype=torch.bfloat16), "z")
    assert torch.equal(packed.dequantize(), torch.zeros(2, 32)) and report.exact == 64


def test_off_grid_group_is_refused_with_tensor_and_group():
    g = torch.Generator().manual_seed(3)
    _, steps, dense = on_grid(4, 128, g, torch.float32)
    dense[2, 70] += 0.45 * steps[2, 2]  # half a step off: no level fits
    with pytest.raises(Qat4Error, match=r"tensor layers\.0\.mlp\.up_proj .*row 2, group 2"):
        recover_grid(dense, "layers.0.mlp.up_proj")


def test_cat_rows_fuses_without_repacking():
    g = torch.Generator().manual_seed(4)
    a = PackedTensor(pack_levels(torch.randint(-8, 8, (3, 64), generator=g)), torch.rand(3, 2).half())
    b = PackedTensor(pack_levels(torch.randint(-8, 8, (5, 64), generator=g)), torch.rand(5, 2).half())
    fused = a.cat_rows(b)
    assert fused.shape == (8, 64)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_a_bf16_source_whose_steps_are_fp16_values_is_recovered_whole():
    """bf16 values of trained fp16 steps: the least-squares step rounded to fp16 reproduced 96.3 %
    of them; the fp16 step next to it that reproduces the most gives back every value and level."""
    g = torch.Generator().manual_seed(0)
    levels = torch.randint(-8, 8, (256, 1024), generator=g)
    steps = (torch.rand(256, 32, generator=g) * 0.02 + 0.001).half().float()
    dense = (levels.view(256, 32, 32).float() * steps[..., None]).view(256, 1024).bfloat16()
    packed, report = recover_grid(dense, "t", torch.float16)
    assert report.exact == report.elements and torch.equal(packed.levels().long(), levels)
    assert torch.equal(packed.dequantize().bfloat16(), dense)

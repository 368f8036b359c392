"""Counter-based uniform draws for sampling: one number in [0, 1) per row, a pure function of the
row's (seed, position), so a seeded request draws the same numbers whoever shares its batch, eagerly
or replayed from a graph, on any device.

A draw hashes the position's low 32 bits with the seed's low half, then its high half, through
lowbias32 (a 32-bit integer hash), then takes 27 and 26 bits of two further hashes of the result
as the 53 bits of a float64. The reference is some seventy elementwise torch ops on int64 tensors
(launches, on a GPU, in every sampled step); the Triton kernel is one launch. Both compute the same
integers, so their draws are equal bit for bit.

- :func:`uniforms_reference`, :func:`uniforms_triton`: seeds [R] int64 in [0, 2^63), positions [R]
  int64 >= 0 -> float64 [R]; :func:`uniforms` picks one with :func:`qat4.ops.use_triton`.
"""

import torch

from qat4.ops import use_triton
from qat4.ops._triton import tl, triton

_MASK32 = 0xFFFFFFFF
_BLOCK = 128  # rows per program


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32), in halves so that no product leaves int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms_reference(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1) as float64 [R] of (seed [R] int64, position [R] int64)."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    h = _hash32(_hash32(_hash32(positions & _MASK32) ^ lo) ^ hi)
    top = _hash32(h ^ 0x68E31DA4) >> 5  # 27 bits
    low = _hash32(h ^ 0xB5297A4D) >> 6  # 26 bits
    return ((top << 26) | low).double() * 2.0**-53


@triton.jit
def _hash32_tl(x):
    """lowbias32 of int64 values in [0, 2^32): an int64 product wraps modulo 2^64, whose low 32 bits
    are the product modulo 2^32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["Seeds", "Positions", "Out", "n"])
def _uniforms_kernel(Seeds, Positions, Out, n, BLOCK: tl.constexpr):
    """Rows [pid * BLOCK, (pid + 1) * BLOCK) of n: Seeds, Positions [n] int64 -> Out [n] float64."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    seed = tl.load(Seeds + rows, mask=ok, other=0)
    position = tl.load(Positions + rows, mask=ok, other=0)
    h = _hash32_tl(_hash32_tl(_hash32_tl(position & 0xFFFFFFFF) ^ (seed & 0xFFFFFFFF)) ^ ((seed >> 32) & 0xFFFFFFFF))
    top = _hash32_tl(h ^ 0x68E31DA4) >> 5
    low = _hash32_tl(h ^ 0xB5297A4D) >> 6
    tl.store(Out + rows, ((top << 26) | low).to(tl.float64) * 1.1102230246251565e-16, mask=ok)  # 2^-53


def uniforms_triton(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`uniforms_reference` in one launch (:func:`_uniforms_kernel`)."""
    n = seeds.shape[0]
    out = torch.empty(n, dtype=torch.float64, device=seeds.device)
    if n:
        _uniforms_kernel[(triton.cdiv(n, _BLOCK),)](seeds.contiguous(), positions.contiguous(), out, n, BLOCK=_BLOCK)
    return out


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1) as float64 [R], a pure function of (seed [R] int64, position [R]
    int64): the Triton kernel or the reference (:func:`qat4.ops.use_triton`)."""
    return (uniforms_triton if use_triton(seeds) else uniforms_reference)(seeds, positions)

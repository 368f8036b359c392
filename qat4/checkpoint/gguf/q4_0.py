"""Q4_0 blocks <-> qat4's packed form, exactly.

Q4_0 holds exactly what qat4 keeps: a block of 32 weights along a row is one fp16 step `d` and 32
4-bit codes, value `(code - 8) * d`. Only the nibble order differs: in a block's 16 bytes, element
j (j < 16) is the low nibble of byte j and element j + 16 its high nibble, while qat4 (the
compressed-tensors order) keeps elements 2b and 2b + 1 in the low and high nibble of byte b. So
transcoding is a nibble shuffle plus a step-dtype change (fp16 in GGUF; bf16 steps convert exactly
while fp16 can hold them, and anything else is refused). GGUF lists shapes innermost first
(`ne = [in, out]`); blocks run along `in`, so they cover the same 32 weights as qat4's groups.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from qat4.checkpoint.packing import GROUP, PER_WORD, PackedTensor, require_exact_steps

Q4_0_BLOCK_BYTES = 18  # fp16 step + 16 bytes of nibbles
_CHUNK_BLOCKS = 1 << 20  # blocks transcoded at once (32 Mi weights)


def q4_0_to_packed(blocks: np.ndarray, rows: int, cols: int, consumed: Callable[[int], None] | None = None) -> PackedTensor:
    """Q4_0 bytes of a [rows, cols] matrix (rows x cols/32 blocks of 18 bytes) -> PackedTensor, exactly.

    `consumed(n)` is told after each slice that the first n bytes of `blocks` are no longer needed.
    """
    n = rows * cols // GROUP
    blocks = blocks.reshape(n, Q4_0_BLOCK_BYTES)
    words = np.empty((n, 16), np.uint8)
    steps = np.empty((n, 2), np.uint8)
    for s in range(0, n, _CHUNK_BLOCKS):
        part = blocks[s : s + _CHUNK_BLOCKS]
        steps[s : s + len(part)] = part[:, :2]
        qs = part[:, 2:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # element order 0..31
        words[s : s + len(part)] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        if consumed is not None:
            consumed((s + len(part)) * Q4_0_BLOCK_BYTES)
    packed = torch.from_numpy(words.view(np.int32).reshape(rows, cols // PER_WORD))
    scales = torch.from_numpy(steps.view(np.float16).reshape(rows, cols // GROUP))
    return PackedTensor(packed, scales)


def packed_to_q4_0(tensor: PackedTensor, name: str, row0: int = 0) -> Iterator[np.ndarray]:
    """The Q4_0 bytes of a PackedTensor, row-major, in slices of whole blocks.

    Steps are stored as fp16; a step fp16 cannot hold exactly raises Qat4Error naming the tensor,
    row and group, since Q4_0 would then change the weights.
    """
    require_exact_steps(tensor.scales, torch.float16, name, "Q4_0 stores fp16 steps", row0)
    n = tensor.rows * tensor.cols // GROUP
    words = tensor.packed.contiguous().numpy().reshape(n, 4).view(np.uint8)  # [n, 16]
    steps = tensor.scales.reshape(n)
    for s in range(0, n, _CHUNK_BLOCKS):
        part = words[s : s + _CHUNK_BLOCKS]
        codes = np.empty((len(part), GROUP), np.uint8)
        codes[:, 0::2] = part & 0xF
        codes[:, 1::2] = part >> 4
        out = np.empty((len(part), Q4_0_BLOCK_BYTES), np.uint8)
        out[:, :2] = steps[s : s + len(part)].to(torch.float16).numpy().view(np.uint8).reshape(-1, 2)
        out[:, 2:] = codes[:, :16] | (codes[:, 16:] << 4)
        yield out.reshape(-1)

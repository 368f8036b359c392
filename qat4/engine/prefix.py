"""The prompt cache's names for KV blocks: a hash of every token from position 0 to a block's end.

A block of K/V depends on the tokens at and before its positions and on nothing else, so two
sequences whose first ``(i + 1) * block_size`` tokens agree can share their first i + 1 blocks. Block
i of a sequence is named ``H_i = blake2b(H_{i-1} || tokens of block i)`` (16 bytes, H_{-1} empty):
equal names mean equal prefixes (a collision would need 2^64 work), and the name of block i
also fixes every block before it, so a lookup walks the chain from block 0 and stops at the first
miss.

Restart points and the sliding window (the choice, and its cost). A sequence restarts after a hit
at a block boundary R: full-attention layers need every block before R, sliding layers only the
blocks the window of the query at R sees (``ceil(W / block_size)`` of them, 32 for E2B), since a
sliding layer's K/V at any position is a function of the tokens alone, like a full layer's. The
pool keeps sliding layers in the same blocks as full ones, so a sliding block that leaves a
sequence's window, or that a finished or preempted sequence lets go, stays cached under its name
rather than being freed, and any block boundary whose last window is still cached is a restart
point: the end of every prompt and reply, and any point in between where a later request
diverges (an edited message, a re-rendered turn without its thinking). No snapshot is copied:
keeping a restart window costs what the blocks held anyway, 6 MiB of sliding blocks (E2B, bf16)
beside 96 KiB of full-attention blocks per 16 tokens of history, and is paid only while the pool
has room: the running sequences take cached blocks back (oldest first, and within a sequence its
last blocks first, so a chain loses its tail before its head) whenever free blocks run out.
``prompt_cache_mib`` adds that much room to the sliding pool, so that restart windows survive
beside a full batch of running sequences.
"""

from __future__ import annotations

import hashlib
from array import array

DIGEST_BYTES = 16
TOKEN_BYTES = array("q").itemsize  # a token id as hashed: int64
_EMPTY = hashlib.blake2b(digest_size=DIGEST_BYTES)  # copied for each name: cheaper than a new hasher


def extend_block_hashes(hashes: list[bytes], tokens: list[int], block_size: int, n_blocks: int) -> list[bytes]:
    """Extend ``hashes`` (the names of the first len(hashes) blocks of ``tokens``) in place to the
    first ``n_blocks`` blocks; returns it. The new blocks' tokens become bytes in one conversion,
    and each name hashes a slice of them: an 8,000-token prompt is named in a third of the time
    that converting and hashing block by block took."""
    first = len(hashes)
    data = array("q", tokens[first * block_size : n_blocks * block_size]).tobytes()
    step = block_size * TOKEN_BYTES
    name = hashes[-1] if hashes else b""
    for start in range(0, (n_blocks - first) * step, step):
        h = _EMPTY.copy()
        h.update(name)
        h.update(data[start : start + step])
        name = h.digest()
        hashes.append(name)
    return hashes

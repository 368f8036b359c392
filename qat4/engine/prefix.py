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

Naming a chat's next turn. Its prompt is the last turn's tokens and a few new ones, and hashing
all of it again costs a few µs a block (1.1 ms for 8,000 tokens on a slow host). :class:`RecentChains`
keeps the tokens and names of the latest finished sequences under their first block's tokens: a
prompt that starts like one of them takes the names of the blocks they share (found by comparing
the token lists, in C) and hashes only the blocks after those. Conversations that open alike (one
system prompt for every user) share that key, and the latest of them is the one compared: names
stay exact whichever it is, only fewer come for free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

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


def shared_blocks(a: list[int], b: list[int], block_size: int, limit: int) -> int:
    """How many leading blocks of block_size tokens a and b have alike, at most ``limit`` (no more
    than both hold in full). A binary search whose every comparison covers only the blocks not yet
    known alike, so the tokens are compared about twice over at most."""
    lo, hi = 0, limit  # blocks before lo are alike; the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo * block_size : mid * block_size] == b[lo * block_size : mid * block_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RecentChains:
    """The tokens and block names of the latest finished sequences (module docstring), each under
    its first block's tokens (the latest of those that start alike), ``max_tokens`` of them at most."""

    def __init__(self, block_size: int, max_tokens: int = 1 << 18):
        self.block_size, self.max_tokens = block_size, max_tokens
        self._chains: OrderedDict[tuple[int, ...], tuple[list[int], list[bytes]]] = OrderedDict()
        self._held = 0  # tokens named by the chains kept

    def remember(self, tokens: list[int], names: list[bytes]) -> None:
        """A finished sequence's tokens and the names of its first len(names) blocks (the tokens
        of those blocks are kept)."""
        if not names:
            return
        key = tuple(tokens[: self.block_size])
        old = self._chains.pop(key, None)
        self._held += (len(names) - (len(old[1]) if old else 0)) * self.block_size
        self._chains[key] = (tokens[: len(names) * self.block_size], names)
        while self._held > self.max_tokens and len(self._chains) > 1:
            _, (_, dropped) = self._chains.popitem(last=False)
            self._held -= len(dropped) * self.block_size

    def names(self, tokens: list[int], n_blocks: int) -> list[bytes]:
        """The names of the first n_blocks blocks of tokens: those it shares with the chain that
        starts like it taken from there, the rest hashed."""
        bs = self.block_size
        chain = self._chains.get(tuple(tokens[:bs])) if n_blocks else None
        names: list[bytes] = []
        if chain is not None:
            theirs, their_names = chain
            names = their_names[: shared_blocks(tokens, theirs, bs, min(n_blocks, len(their_names)))]
        return extend_block_hashes(names, tokens, bs, n_blocks)

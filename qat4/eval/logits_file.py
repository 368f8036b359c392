"""llama.cpp's logits file, which `llama-perplexity -f TEXT --kl-divergence-base FILE` writes and
`llama-perplexity --kl-divergence-base FILE --kl-divergence` reads, read and written here so qat4
and llama.cpp can each be the other's base.

Layout (little-endian): the 8 bytes `_logits_`; int32 n_ctx, n_vocab, n_chunk; the n_chunk * n_ctx
int32 token ids of the chunks (each chunk is read with its first token replaced by BOS); then, chunk
by chunk, one record for each position from n_ctx / 2 to n_ctx - 2 (the distribution of the next
token): two float32, a scale and the smallest log-probability, then n_vocab uint16 q (padded to an
even count), log p = scale * q + smallest. Logits more than 16 below the largest are stored as the
smallest, which the KL divergence leaves out (log p <= -16).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from qat4.errors import Qat4Error

MAGIC = b"_logits_"
LOG_PROB_RANGE = 16.0  # nats below the largest logit that are kept
LEVELS = 65535
HEADER_INTS = 3


def record_width(n_vocab: int) -> int:
    """uint16 words per position: two float32, then the vocabulary padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def first_scored(n_ctx: int) -> int:
    """The first position of a chunk whose next-token distribution is kept (the second half is scored)."""
    return n_ctx // 2


def encode(logits: torch.Tensor) -> np.ndarray:
    """Logits [n, V] as records [n, record_width(V)] of uint16."""
    logits = logits.float()
    n, vocab = logits.shape
    top = logits.max(dim=-1, keepdim=True).values
    bottom = torch.maximum(logits.min(dim=-1, keepdim=True).values, top - LOG_PROB_RANGE)
    log_sum_exp = torch.log(torch.exp(logits - top).sum(dim=-1, keepdim=True))
    smallest = bottom - top - log_sum_exp
    scale = (top - bottom) / LEVELS
    levels = torch.where(logits > bottom, torch.round((logits - bottom) / torch.where(scale > 0, scale, 1)), 0)
    records = np.zeros((n, record_width(vocab)), dtype=np.uint16)
    records[:, :4] = np.concatenate([scale.numpy(), smallest.numpy()], axis=1).astype(np.float32).view(np.uint16)
    records[:, 4:4 + vocab] = levels.to(torch.int32).numpy().astype(np.uint16)
    return records


def decode(records: np.ndarray, n_vocab: int) -> torch.Tensor:
    """Records [n, record_width(V)] back to log-probabilities [n, V] (float32)."""
    header = np.ascontiguousarray(records[:, :4]).view(np.float32)
    scale, smallest = torch.from_numpy(header[:, :1].copy()), torch.from_numpy(header[:, 1:2].copy())
    return scale * torch.from_numpy(records[:, 4:4 + n_vocab].astype(np.float32)) + smallest


class LogitsWriter:
    """Writes a logits file: the header and token ids first, then `add_chunk` once per chunk."""

    def __init__(self, path: str | Path, n_ctx: int, n_vocab: int, chunks: list[list[int]]):
        self.path, self.n_ctx, self.n_vocab = Path(path), n_ctx, n_vocab
        try:
            self._out: BinaryIO = open(self.path, "wb")
        except OSError as exc:
            raise Qat4Error(f"cannot write {path}: {exc.strerror or exc}") from None
        self._out.write(MAGIC + np.array([n_ctx, n_vocab, len(chunks)], dtype="<i4").tobytes())
        self._out.write(np.asarray(chunks, dtype="<i4").tobytes())

    def add_chunk(self, logits: torch.Tensor) -> None:
        """The logits [n_ctx, V] of one chunk; the scored positions' records are written."""
        self._out.write(encode(logits[first_scored(self.n_ctx):self.n_ctx - 1]).astype("<u2").tobytes())

    def close(self) -> None:
        self._out.close()

    def __enter__(self) -> LogitsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class LogitsFile:
    """A logits file opened for reading (mapped, not read into memory)."""

    path: Path
    n_ctx: int
    n_vocab: int
    chunks: list[list[int]]
    _records: np.ndarray  # [n_chunk, positions, record_width] uint16

    @classmethod
    def open(cls, path: str | Path) -> LogitsFile:
        """Qat4Error with one sentence when `path` is missing or is not a whole logits file."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + 4 * HEADER_INTS)
            size = path.stat().st_size
        except OSError as exc:
            raise Qat4Error(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(head) < len(MAGIC) + 4 * HEADER_INTS or not head.startswith(MAGIC):
            raise Qat4Error(f"{path} is not a llama.cpp logits file (it does not start with {MAGIC.decode()})")
        n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(head[len(MAGIC):], dtype="<i4"))
        positions = n_ctx - 1 - first_scored(n_ctx)
        tokens_at = len(head)
        records_at = tokens_at + 4 * n_chunk * n_ctx
        expected = records_at + 2 * n_chunk * positions * record_width(n_vocab)
        if min(n_ctx, n_vocab, n_chunk) < 1 or positions < 1 or size != expected:
            raise Qat4Error(f"{path} is not a whole llama.cpp logits file ({size:,} bytes where its header "
                            f"of {n_chunk} chunks of {n_ctx} tokens over {n_vocab} says {expected:,})")
        tokens = np.fromfile(path, dtype="<i4", count=n_chunk * n_ctx, offset=tokens_at).reshape(n_chunk, n_ctx)
        records = np.memmap(path, dtype="<u2", mode="r", offset=records_at,
                            shape=(n_chunk, positions, record_width(n_vocab)))
        return cls(path, n_ctx, n_vocab, tokens.tolist(), records)

    def log_probs(self, chunk: int) -> torch.Tensor:
        """Chunk `chunk`'s stored log-probabilities [positions, V]."""
        return decode(np.asarray(self._records[chunk]), self.n_vocab)

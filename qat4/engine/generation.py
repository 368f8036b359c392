"""One request at a time over the engine's steps: what :meth:`Engine.stream
<qat4.engine.Engine.stream>` yields and :meth:`Engine.generate <qat4.engine.Engine.generate>`
returns.

:func:`tokens_of` steps the engine until one sequence ends (whatever else is in the batch steps
along) and yields that sequence's tokens; :func:`generation_of` reads them to a stop token, a stop
string or the token limit and returns the :class:`Generation`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qat4.engine.sequence import Sequence

if TYPE_CHECKING:
    from qat4.engine.engine import Engine


@dataclass
class Generation:
    """One finished generation. ``tokens`` excludes a stop token; after a stop string it ends
    with the token that completed it, and ``text`` is cut before the stop string."""

    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    prefill_ms: float  # from the request to its first token on the host
    decode_ms: float  # first token to last token
    decode_steps: int  # tokens produced by decode steps (every token after the first)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache
    drafted: int = 0  # draft tokens verified (speculative decoding)
    accepted: int = 0  # of those, the ones kept

    @property
    def decode_tok_s(self) -> float | None:
        """Decode speed, or None with fewer than two decode steps: the first decode step was
        enqueued before the first token came back, so one interval says nothing about the rate."""
        return self.decode_steps / self.decode_ms * 1e3 if self.decode_steps >= 2 and self.decode_ms > 0 else None


def tokens_of(engine: Engine, seq: Sequence, should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
    """Step the engine until ``seq`` ends, yielding its tokens; leaving early aborts it."""
    try:
        while not seq.finished:
            for out in engine.step():
                if out.seq is seq:
                    yield out.token
                    if not out.finished and should_stop is not None and should_stop():
                        engine.abort(seq)
                        break  # a speculating step may have more of its tokens
    finally:
        engine.abort(seq)


def generation_of(engine: Engine, seq: Sequence, stop: list[str]) -> Generation:
    """Step the engine until ``seq`` ends or its decoded text contains one of the (non-empty)
    ``stop`` strings, which needs the engine's tokenizer."""
    tokens: list[int] = []
    reason = "length"
    tail = max((len(s) for s in stop), default=0) + 8  # tokens enough to hold any stop string
    produced = 0  # tokens read, the stop token included (a step may bring more after it)
    for token in tokens_of(engine, seq):
        produced += 1
        if token in seq.stop_ids:
            reason = "stop"
            break
        tokens.append(token)
        if stop and any(s in engine.tokenizer.decode(tokens[-tail:]) for s in stop):
            reason = "stop"
            break
    text = engine.tokenizer.decode(tokens) if engine.tokenizer is not None else ""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return Generation(
        tokens=tokens,
        text=text if cut < 0 else text[:cut],
        finish_reason=reason,
        prompt_tokens=len(seq.prompt),
        prefill_ms=(seq.first_token_at - seq.arrived) * 1e3,
        decode_ms=(seq.last_token_at - seq.first_token_at) * 1e3,
        decode_steps=produced - 1,
        cached_tokens=seq.cached_tokens,
        drafted=seq.drafted,
        accepted=seq.accepted,
    )

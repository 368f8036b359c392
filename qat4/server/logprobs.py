"""Logprobs in OpenAI's two shapes, from the engine's TokenLogprobs (:mod:`qat4.engine.logprobs`).

- Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...], "refusal": null}``, as many top entries as `top_logprobs` asks.
- Text completions, OpenAI's legacy shape: ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, each `top_logprobs` entry a dict from the text of the `logprobs` most likely
  tokens to their logprobs, the token taken added when it is not among them (so up to `logprobs` + 1
  entries, as OpenAI's); an echoed prompt's first token, which nothing predicts, has null for both.
  `text_offset` counts the characters of the tokens' texts before each token, across the chunks of a
  stream.

A token's text is its bytes (:meth:`qat4.tokenizer.Tokenizer.token_bytes`) read as UTF-8, a byte of
a longer character as U+FFFD. JSON has no -Infinity: a logprob below LOGPROB_FLOOR is sent as it,
as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qat4.engine.logprobs import TokenLogprobs

LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class TokenTexts:
    """Each token's text and bytes, as logprobs show them."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def bytes(self, token: int) -> bytes:
        return self._tokenizer.token_bytes(token)

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")

    def _chat_entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token), "logprob": _logprob(logprob), "bytes": list(self.bytes(token))}

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The `logprobs` of a chat choice or chunk whose tokens have these logprobs."""
        return {"content": [{**self._chat_entry(e.token, e.logprob),
                             "top_logprobs": [self._chat_entry(t, lp) for t, lp in e.top]} for e in entries],
                "refusal": None}


class CompletionLogprobs:
    """The legacy `logprobs` objects of one text completion's tokens, chunk after chunk: the first
    ``unseen`` tokens are not in the text (the <bos> the server put before a text prompt) and take
    none of its characters."""

    def __init__(self, texts: TokenTexts, unseen: int = 0):
        self.texts, self._unseen, self._offset = texts, unseen, 0

    def of(self, tokens: Sequence[int], entries: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        """The object of the next ``tokens`` and their logprobs (None: a token nothing predicts)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(tokens, entries, strict=True):
            text = self.texts.text(token)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            if self._unseen:
                self._unseen -= 1
            else:
                self._offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {self.texts.text(t): _logprob(lp) for t, lp in entry.top}
            top.setdefault(text, _logprob(entry.logprob))
            out["token_logprobs"].append(_logprob(entry.logprob))
            out["top_logprobs"].append(top)
        return out

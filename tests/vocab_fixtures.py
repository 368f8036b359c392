"""The real Gemma 4 vocabulary and its reference encodings, shipped with the tests.

`fixtures/gemma4-tokenizer/` holds llama.cpp's vocab-only GGUF of Gemma 4 (262,144 tokens and
514,906 merges, no weights) and llama.cpp's 46 test strings with the ids Google's tokenizer gives
for them (see that folder's SOURCES.md). The canonical chat template is the one qat4 ships in
`qat4/data/`; its SHA-256 pins it to Google's published file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

VOCAB_FOLDER = Path(__file__).resolve().parent / "fixtures" / "gemma4-tokenizer"
VOCAB_GGUF = VOCAB_FOLDER / "ggml-vocab-gemma-4.gguf"
SEPARATOR = "\n__ggml_vocab_test__\n"

# SHA-256 of Google's Gemma 4 E2B-it chat_template.jinja ("Published: 2026-07-09").
CANONICAL_TEMPLATE_SHA256 = "3beb16a140a78c7bf71cd86609f58e56f1594e670e95fe58bd6022f941d1cb1e"


def official_vectors() -> list[tuple[str, list[int]]]:
    """The 46 official (text, ids) pairs: texts separated by a marker line, one line of ids each."""
    texts = VOCAB_GGUF.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    lines = VOCAB_GGUF.with_suffix(".gguf.out").read_text(encoding="utf-8").removesuffix("\n").split("\n")
    assert len(texts) == len(lines) == 46
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


def sha256_of(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()

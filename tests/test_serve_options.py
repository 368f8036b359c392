"""What qat4 serve offers benchmarks: --model synthetic:PRESET, built in memory with the shipped tokenizer."""

from __future__ import annotations

from qat4.commands.model_args import load_engine
from qat4.config import TINY


def test_serve_builds_a_synthetic_model_with_the_shipped_tokenizer():
    engine = load_engine("synthetic:tiny", "cpu", max_ctx=64)
    assert engine.config == TINY and engine.max_ctx == 64
    assert engine.tokenizer.encode("Hello world") == [9259, 1902]
    assert "<|turn>" in engine.tokenizer.chat_template

"""What qat4 serve offers benchmarks: --model synthetic:PRESET, built in memory with the shipped
tokenizer, and the `ignore_eos` request field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from server_harness import ScriptedEngine

from qat4.commands.model_args import load_engine
from qat4.config import TINY
from qat4.server import completions as completions_module
from qat4.server.completions import Completions
from qat4.server.errors import APIError
from qat4.server.generation import GenerationParams
from qat4.server.schemas import CompletionRequest, parse_body


def test_serve_builds_a_synthetic_model_with_the_shipped_tokenizer():
    engine = load_engine("serve", "synthetic:tiny", "cpu", max_ctx=64)
    assert engine.config == TINY and engine.max_ctx == 64
    assert engine.tokenizer.encode("Hello world") == [9259, 1902]
    assert "<|turn>" in engine.tokenizer.chat_template


def test_requests_take_ignore_eos_as_a_strict_bool():
    assert parse_body(CompletionRequest, b'{"prompt": [5], "ignore_eos": true}').ignore_eos is True
    assert parse_body(CompletionRequest, b'{"prompt": [5]}').ignore_eos is False
    with pytest.raises(APIError, match="Invalid value for 'ignore_eos'"):
        parse_body(CompletionRequest, b'{"prompt": [5], "ignore_eos": "yes"}')


def test_ignore_eos_reaches_generation_params_once_they_have_the_field(monkeypatch):
    request = CompletionRequest.model_validate({"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})
    assert Completions(ScriptedEngine(), None, "m").prepare_text(request).params.max_tokens == 3  # accepted today

    @dataclass(frozen=True)
    class ParamsWithIgnoreEos(GenerationParams):
        ignore_eos: bool = False

    monkeypatch.setattr(completions_module, "GenerationParams", ParamsWithIgnoreEos)
    assert Completions(ScriptedEngine(), None, "m").prepare_text(request).params.ignore_eos is True

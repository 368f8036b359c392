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


def test_serve_shortens_the_switch_interval_before_it_listens(monkeypatch):
    """The engine thread waits for the GIL at most half a millisecond of the event loop's work,
    not Python's default 5 ms (longer than a decode step)."""
    import sys

    from qat4.cli import main
    from qat4.commands import serve

    set_to, listening_at = [], []
    monkeypatch.setattr(sys, "setswitchinterval", set_to.append)  # the test process keeps its own
    monkeypatch.setattr(serve._Server, "run", lambda self: listening_at.append(list(set_to)))
    assert main(["serve", "--model", "synthetic:tiny", "--device", "cpu", "--max-ctx", "64"]) == 0
    assert listening_at == [[serve.SWITCH_INTERVAL_S]] and serve.SWITCH_INTERVAL_S < 0.001


def test_serve_freezes_the_loaded_objects_before_it_listens(monkeypatch):
    """The garbage collector's full passes skip what loading made (the engine's, the tokenizer's
    objects), so they no longer hold the GIL for a pass over the whole heap while tokens stream."""
    import gc

    from qat4.cli import main
    from qat4.commands import serve

    frozen_at_listen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen_at_listen.append("frozen"))  # the test process keeps its heap
    monkeypatch.setattr(serve._Server, "run", lambda self: frozen_at_listen.append("listening"))
    assert main(["serve", "--model", "synthetic:tiny", "--device", "cpu", "--max-ctx", "64"]) == 0
    assert frozen_at_listen == ["frozen", "listening"]


def test_a_detached_server_gets_the_flags_that_differ_from_their_defaults():
    """`qat4 serve --detach` hands the server it starts the flags given, --no-X included."""
    from qat4.commands import serve

    parser = serve._serve_parser()
    assert serve._forwarded_flags(parser.parse_args(["--model", "m"])) == []
    assert serve._forwarded_flags(parser.parse_args(["--model", "m", "--no-dense-weights"])) == ["--no-dense-weights"]
    assert serve._forwarded_flags(parser.parse_args(["--model", "m", "--dense-weights", "--max-ctx", "64"])) == [
        "--max-ctx=64", "--dense-weights"]


def test_serve_reads_prompts_in_the_chunks_asked_for(monkeypatch, capsys):
    """--prefill-chunk sets the prompt tokens a step reads (the engine's and the start line's);
    below 1 it is refused before anything loads."""
    from qat4.cli import main
    from qat4.commands import serve

    chunks = []
    monkeypatch.setattr(serve._Server, "run",
                        lambda self: chunks.append(self.config.app.state.engine_loop.engine.prefill_chunk))
    tiny = ["serve", "--model", "synthetic:tiny", "--device", "cpu", "--max-ctx", "64"]
    assert main([*tiny, "--prefill-chunk", "48"]) == 0
    assert chunks == [48] and "prompts read 48 tokens a step" in capsys.readouterr().err
    assert main([*tiny, "--prefill-chunk", "0"]) == 1
    assert capsys.readouterr().err.strip() == "qat4 serve: --prefill-chunk must be at least 1, got 0"
    parser = serve._serve_parser()
    assert serve._forwarded_flags(parser.parse_args(["--model", "m", "--prefill-chunk", "512"])) == [
        "--prefill-chunk=512"]

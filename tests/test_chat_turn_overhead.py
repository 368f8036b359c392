"""tools/chat_turn_overhead.py: a chat turn over a cached history against its new tokens alone, on the real app."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))

import chat_turn_overhead  # noqa: E402


def test_a_chat_turn_reads_only_its_new_tokens_and_every_stage_is_timed(tmp_path):
    out = tmp_path / "turn.json"
    assert chat_turn_overhead.main(["--history", "600", "--turn", "16", "--repeat", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # the history came from the prompt cache, to the last whole block before the new message
    assert 600 < result["cached_tokens"] < result["chat_prompt_tokens"]
    assert result["new_tokens"] == result["chat_prompt_tokens"] - result["cached_tokens"]
    assert result["new_tokens"] < 16 * 3 + 32
    assert result["chat_ttft_ms"] > 0 and result["new_only_ttft_ms"] > 0
    stages = result["stages_ms"]
    assert {"json.loads", "chat template", "tokenizer.encode", "block hashes", "attach_prefix",
            "engine to first token"} <= set(stages)
    assert all(ms["chat"] > 0 for ms in stages.values())
    assert stages["chat template"]["new_only"] is None  # a completion of ids has no template to render


def test_a_later_turn_finds_every_turn_before_it_in_the_prompt_cache(tmp_path):
    out = tmp_path / "turn.json"
    assert chat_turn_overhead.main(["--history", "300", "--turn", "40", "--at-turn", "4", "--repeat", "2",
                                    "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # three turns before it: 300 + 2 * 40 words and three replies of 64 tokens, all cached
    assert result["cached_tokens"] > 300 + 2 * 40 + 3 * 64
    assert result["new_tokens"] < 40 + 32

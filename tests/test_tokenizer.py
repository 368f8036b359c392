"""The Gemma 4 tokenizer from GGUF metadata and from the tokenizer.json built from it.

Acceptance: the 46 official test strings of the real vocabulary encode to the ids Google's
tokenizer gives. Parsing the GGUF takes about a minute on a small CPU; it happens once per session.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qat4.chat import render_prompt
from qat4.errors import Qat4Error
from qat4.tokenizer import Tokenizer, build_tokenizer_json, find_tokenizer, load_tokenizer
from vocab_fixtures import VOCAB_GGUF as GGUF
from vocab_fixtures import official_vectors

# §7.1 / §12 of the spec: token -> id in the real vocabulary.
SPECIAL_IDS = {
    "<pad>": 0, "<eos>": 1, "<bos>": 2, "<|tool>": 46, "<tool|>": 47, "<|tool_call>": 48, "<tool_call|>": 49,
    "<|tool_response>": 50, "<tool_response|>": 51, '<|"|>': 52, "<|think|>": 98, "<|channel>": 100,
    "<channel|>": 101, "<|turn>": 105, "<turn|>": 106, "\n": 107, "\n\n": 108, "<|image>": 255999,
    "<|audio>": 256000, "<|image|>": 258880, "<|audio|>": 258881, "<|video|>": 258884,
}
USER_DEFINED = ("<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>",
                "<channel|>")


VECTORS = official_vectors()


@pytest.fixture(scope="session")
def gguf_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUF)


@pytest.fixture(scope="session")
def json_folder(tmp_path_factory) -> Path:
    """A checkpoint-like folder holding the tokenizer.json built from the GGUF."""
    folder = tmp_path_factory.mktemp("tokenizer")
    (folder / "tokenizer.json").write_text(build_tokenizer_json(GGUF), encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def json_tokenizer(json_folder) -> Tokenizer:
    return Tokenizer.from_file(json_folder / "tokenizer.json")


@pytest.fixture(params=["gguf", "json"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.mark.parametrize("text,ids", VECTORS, ids=[f"v{i:02d}" for i in range(len(VECTORS))])
def test_official_vectors(tokenizer, text, ids):
    assert tokenizer.encode(text) == ids


def test_round_trip(tokenizer):
    for text, ids in VECTORS:
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_ids_and_sizes(tokenizer):
    assert {token: tokenizer.token_to_id(token) for token in SPECIAL_IDS} == SPECIAL_IDS
    assert (tokenizer.bos_id, tokenizer.eos_id) == (2, 1)
    assert tokenizer.vocab_size == 262144


def test_unknown_token_raises(tokenizer):
    with pytest.raises(Qat4Error, match="<end_of_turn>"):
        tokenizer.token_to_id("<end_of_turn>")


def test_bos_only_when_asked(tokenizer):
    assert tokenizer.encode("hello") == [23391]
    assert tokenizer.encode("hello", add_bos=True) == [2, 23391]


def test_chat_prompt_markers_are_single_tokens(tokenizer):
    text = "<bos><|turn>user\nHello<turn|>\n<|turn>model\n"
    ids = tokenizer.encode(text)
    assert ids == [2, 105, tokenizer.encode("user")[0], 107, 9259, 106, 107, 105, tokenizer.encode("model")[0], 107]
    assert tokenizer.decode(ids) == text


def test_decode_keeps_user_defined_tokens(tokenizer):
    text = '<bos><|turn>model\n<|channel>thought\n<channel|><|tool_call>call:f{a:<|"|>x y<|"|>}<tool_call|><turn|>'
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    kept = 'model\n<|channel>thought\n<channel|><|tool_call>call:f{a:<|"|>x y<|"|>}<tool_call|>'
    assert tokenizer.decode(ids, skip_special=True) == kept


def test_spec_tool_request_token_counts(tokenizer):
    """§7.8 B: 65 prompt tokens; the expected completion is 15 tokens."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    prompt = render_prompt([{"role": "user", "content": "What is the weather in Paris right now?"}], tools=tools)
    assert len(tokenizer.encode(prompt)) == 65
    completion = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
    assert len(tokenizer.encode(completion)) == 15


def test_byte_fallback_decodes_partial_utf8_as_replacement(tokenizer):
    ids = tokenizer.encode("\U000e0100")  # a character with no token: four <0xNN> byte tokens
    assert all(238 <= i <= 493 for i in ids) and len(ids) == 4
    assert tokenizer.decode(ids) == "\U000e0100"
    assert tokenizer.decode(ids[:2]) == "\ufffd\ufffd"


def test_built_json_flags(json_folder):
    data = json.loads((json_folder / "tokenizer.json").read_text(encoding="utf-8"))
    added = {t["content"]: t for t in data["added_tokens"]}
    assert all(not added[t]["special"] for t in USER_DEFINED)
    assert all(added[t]["special"] for t in ("<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|think|>"))
    assert all(added[t]["id"] == SPECIAL_IDS[t] and not added[t]["normalized"] for t in added if t in SPECIAL_IDS)
    assert data["pre_tokenizer"] is None
    assert data["model"]["type"] == "BPE" and data["model"]["byte_fallback"]
    assert len(data["model"]["merges"]) == 514906


def test_gguf_chat_template(gguf_tokenizer):
    assert "<|turn>" in gguf_tokenizer.chat_template
    assert Tokenizer.from_gguf(GGUF, chat_template="T").chat_template == "T"


def test_gguf_template_renders_tool_round_trip(gguf_tokenizer):
    """The older template embedded in the GGUF reads tool results only as `tool_responses`."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [
                    {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    text = render_prompt(messages, template=gguf_tokenizer.chat_template)
    assert ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
            '<|tool_response>response:get_weather{value:<|"|>18 C<|"|>}<tool_response|>') in text
    assert "<|turn>tool" not in text


def _checkpoint(folder: Path, json_folder: Path, files: dict[str, str]) -> Path:
    """A folder linking the built tokenizer.json (a cache hit) beside the given small files."""
    folder.mkdir()
    os.symlink(json_folder / "tokenizer.json", folder / "tokenizer.json")
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def test_load_tokenizer_template_sources(tmp_path, json_folder):
    config = json.dumps({"chat_template": "from config"})
    both = _checkpoint(tmp_path / "both", json_folder,
                       {"chat_template.jinja": "from jinja", "tokenizer_config.json": config})
    config_only = _checkpoint(tmp_path / "config", json_folder, {"tokenizer_config.json": config})
    named = _checkpoint(tmp_path / "named", json_folder, {"tokenizer_config.json": json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "from list"}]})})
    bare = _checkpoint(tmp_path / "bare", json_folder, {})
    assert load_tokenizer(both).chat_template == "from jinja"
    assert load_tokenizer(config_only).chat_template == "from config"
    assert load_tokenizer(named).chat_template == "from list"
    assert load_tokenizer(bare).chat_template is None
    assert load_tokenizer(bare).encode(VECTORS[-1][0]) == VECTORS[-1][1]


def test_load_tokenizer_from_gguf_folder(tmp_path, gguf_tokenizer):
    os.symlink(GGUF, tmp_path / "model.gguf")
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template == gguf_tokenizer.chat_template
    (tmp_path / "chat_template.jinja").write_text("mine", encoding="utf-8")
    assert load_tokenizer(tmp_path).chat_template == "mine"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(Qat4Error, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(Qat4Error, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(Qat4Error, match="missing.json"):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(Qat4Error, match="broken.gguf"):
        Tokenizer.from_gguf(tmp_path / "broken.gguf")



def test_find_tokenizer_of_a_checkpoint_folder_or_file(tmp_path, json_folder):
    assert find_tokenizer(json_folder).encode(VECTORS[-1][0]) == VECTORS[-1][1]
    assert find_tokenizer(GGUF).encode(VECTORS[-1][0]) == VECTORS[-1][1]
    assert find_tokenizer(tmp_path) is None  # a checkpoint without a tokenizer
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    assert find_tokenizer(tmp_path / "broken.gguf") is None

# A tiny vocabulary in GGUF metadata form, given as plain values: types 1 normal, 3 control,
# 4 user-defined, 6 byte.
TINY_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<turn|>", "<|tool_response>", "<|\"|>", "a", "b", "ab", "\u2581",
               "\u2581ab", *(f"<0x{b:02X}>" for b in range(256))]
TINY = {
    "tokenizer.ggml.model": "gemma4",
    "tokenizer.ggml.tokens": TINY_TOKENS,
    "tokenizer.ggml.token_type": [3, 3, 3, 3, 3, 4, 4, 1, 1, 1, 1, 1, *([6] * 256)],
    "tokenizer.ggml.merges": ["a b", "\u2581 ab"],
    "tokenizer.ggml.bos_token_id": 2,
    "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.unknown_token_id": 3,
    "tokenizer.chat_template": "{{ bos_token }}",
}


def _check_tiny(tok: Tokenizer) -> None:
    assert tok.encode("ab ab", add_bos=True) == [2, 9, 11]
    assert tok.encode('c<|"|>') == [12 + ord("c"), 6]
    assert tok.decode([9, 11, 4, 6]) == 'ab ab<turn|><|"|>'
    assert tok.decode([9, 4, 6], skip_special=True) == 'ab<|"|>'
    assert (tok.bos_id, tok.eos_id, tok.chat_template, tok.vocab_size) == (2, 1, "{{ bos_token }}", len(TINY_TOKENS))


def test_from_plain_metadata():
    _check_tiny(Tokenizer.from_gguf_metadata(TINY))


def test_from_gguf_reader_fields_and_file(tmp_path):
    """The same tiny vocabulary written as a GGUF: read by the gguf package's reader and by qat4's."""
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "gemma4")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(TINY["tokenizer.ggml.tokens"])
    writer.add_token_types(TINY["tokenizer.ggml.token_type"])
    writer.add_token_merges(TINY["tokenizer.ggml.merges"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_chat_template(TINY["tokenizer.chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _check_tiny(Tokenizer.from_gguf_metadata(gguf.GGUFReader(path).fields))
    _check_tiny(Tokenizer.from_gguf(path))
    first = json.loads(build_tokenizer_json(path))["post_processor"]["single"][0]
    assert first == {"SpecialToken": {"id": "<bos>", "type_id": 0}}


def test_metadata_without_merges_is_rejected():
    with pytest.raises(Qat4Error, match="merges"):
        Tokenizer.from_gguf_metadata({k: v for k, v in TINY.items() if k != "tokenizer.ggml.merges"})


def _random_chat_text(rng, words):
    """Long and short runs of words, whitespace and special tokens (and '<' that starts none) mixed."""
    marks = ["<|turn>", "<turn|>", "<bos>", "<|tool_call>", '<|"|>', "<|channel>", "<", "<|", "<turn", "<<|turn>>", "\n"]
    parts = []
    for _ in range(rng.randint(1, 10)):
        parts.append(" ".join(rng.choices(words, k=rng.choice([0, 3, 40, 400]))) + rng.choice(["", " ", "\n", "  "]))
        parts.append(rng.choice(marks))
    return "".join(parts)


def test_encoding_piece_by_piece_with_the_cache_gives_the_whole_encode(json_tokenizer):
    """Pieces between added tokens are encoded alone and long ones cached; the ids are those of one
    encode of the whole text, the first time and from the cache."""
    import random

    from qat4.bench_serve.workload import WORDS

    hf = json_tokenizer._hf
    assert json_tokenizer._pieces is not None
    rng = random.Random(0)
    texts = [_random_chat_text(rng, WORDS) for _ in range(60)] + ["<" * 2000, "<|" * 1000, "a<bos>" * 300]
    for text in texts:
        want = hf.encode(text, add_special_tokens=False).ids
        assert json_tokenizer.encode(text) == want and json_tokenizer.encode(text) == want, text[:120]


def test_the_encode_cache_keeps_a_bounded_number_of_characters(json_tokenizer, monkeypatch):
    from qat4 import tokenizer

    monkeypatch.setattr(tokenizer, "CACHE_CHARS", 5000)
    pieces = tokenizer._PieceCache.of(json_tokenizer._hf)
    texts = [("word%d " % i) * 300 for i in range(10)]  # 2,100+ characters each
    for text in texts:
        assert pieces.encode(text) == json_tokenizer._hf.encode(text, add_special_tokens=False).ids
    assert pieces._chars <= 5000 and list(pieces._ids) == texts[-2:]


def test_a_tokenizer_with_an_added_token_not_starting_with_a_bracket_encodes_whole():
    import tokenizers
    from tokenizers import AddedToken, models

    hf = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "[x]": 2}, merges=[]))
    hf.add_tokens([AddedToken("[x]", normalized=False)])
    tok = Tokenizer(hf, bos_id=0, eos_id=1)
    assert tok._pieces is None and tok.encode("ab[x]ba") == hf.encode("ab[x]ba", add_special_tokens=False).ids


def test_the_id_limit_is_one_past_the_largest_id_even_with_gaps():
    """Engine.encode trusts a text prompt's ids when the tokenizer's id limit fits the model's
    vocabulary; a vocabulary with gaps has fewer tokens than its largest id."""
    import tokenizers
    from tokenizers import models

    hf = tokenizers.Tokenizer(models.WordLevel({"<bos>": 2, "<eos>": 1, "a": 0, "b": 9}, unk_token="a"))
    tokenizer = Tokenizer(hf)
    assert tokenizer.vocab_size == 4 and tokenizer.id_limit == 10

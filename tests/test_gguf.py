"""llama.cpp GGUF: exact Q4_0 transcoding both ways, refused tensor types, metadata round trip, the
gguf package's own reader and writer as independent references, and the tokenizer of a written file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, TokenType, quants

from checkpoint_fixtures import CHAT_TEMPLATE, CONTROL, SMALL, USER_DEFINED, small_aux, write_small
from qat4.checkpoint.gguf.container import GGUFFile
from qat4.checkpoint.gguf.names import canonical_name, gguf_name
from qat4.checkpoint.gguf.q4_0 import packed_to_q4_0, q4_0_to_packed
from qat4.checkpoint.gguf.reader import GGUFSource
from qat4.checkpoint.gguf.writer import write_gguf
from qat4.checkpoint.packed_model import expected_tensors
from qat4.checkpoint.packing import PackedTensor, pack_levels
from qat4.checkpoint.synth import synthetic_aux, synthetic_tensors
from qat4.config import E2B, TINY
from qat4.errors import Qat4Error
from qat4.tokenizer import Tokenizer
from vocab_fixtures import VOCAB_GGUF, official_vectors

Q4_0 = GGMLQuantizationType.Q4_0


def random_packed(rows: int, cols: int, seed: int, step_dtype=torch.float16) -> tuple[torch.Tensor, PackedTensor]:
    """Random levels in -8..7 (every code present) and random fp16-exact steps of any magnitude."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(-8, 8, (rows, cols), generator=g)
    levels.view(-1)[:16] = torch.arange(-8, 8)
    steps = torch.ldexp(torch.rand(rows, cols // 32, generator=g) + 0.5, torch.randint(-14, 8, (rows, cols // 32), generator=g))
    steps = steps.to(torch.float16).to(step_dtype)
    return levels, PackedTensor(pack_levels(levels), steps)


# ---- Q4_0 blocks ---------------------------------------------------------------------------------


def test_q4_0_block_layout_is_split_planes():
    levels = torch.arange(32).remainder(16).sub(8).view(1, 32)  # element j has code j % 16
    block = np.concatenate(list(packed_to_q4_0(PackedTensor(pack_levels(levels), torch.tensor([[0.5]]).half()), "t")))
    assert block[:2].view(np.float16)[0] == 0.5
    assert [b & 0xF for b in block[2:]] == list(range(16))  # low nibbles: elements 0..15
    assert [b >> 4 for b in block[2:]] == list(range(16))  # high nibbles: elements 16..31


@pytest.mark.parametrize("step_dtype", [torch.float16, torch.bfloat16])
def test_q4_0_transcoding_is_exact_both_ways(step_dtype):
    levels, packed = random_packed(24, 256, seed=3, step_dtype=step_dtype)
    packed.scales = packed.scales.clamp(min=2.0**-14)  # bf16 steps convert exactly inside fp16's normal range
    blocks = np.concatenate(list(packed_to_q4_0(packed, "t")))
    assert blocks.nbytes == 24 * 256 // 32 * 18
    # The gguf package's own Q4_0 decoder is the reference for the block layout.
    reference = quants.dequantize(blocks.reshape(24, -1), Q4_0)
    assert torch.equal(torch.from_numpy(reference), packed.dequantize(torch.float32))
    back = q4_0_to_packed(blocks, 24, 256)
    assert torch.equal(back.packed, packed.packed)
    assert torch.equal(back.levels().long(), levels)
    assert back.scales.dtype == torch.float16 and torch.equal(back.scales.float(), packed.scales.float())


def test_step_that_fp16_cannot_hold_is_refused():
    _, packed = random_packed(4, 64, seed=4, step_dtype=torch.bfloat16)
    packed.scales[2, 1] = 2.0**17  # a bf16 value above fp16's range
    with pytest.raises(Qat4Error, match=r"tensor layers\.0\.mlp\.up_proj .* row 2, group 1"):
        list(packed_to_q4_0(packed, "layers.0.mlp.up_proj"))


# ---- names ---------------------------------------------------------------------------------------


def test_every_e2b_tensor_has_a_llama_cpp_name_and_back():
    names = [*expected_tensors(E2B), "lm_head"]
    mapped = [gguf_name(n) for n in names]
    assert len(set(mapped)) == len(names)
    assert [canonical_name(m) for m in mapped] == names
    assert gguf_name("layers.34.layer_scalar") == "blk.34.layer_output_scale.weight"
    assert gguf_name("embed_tokens_per_layer") == "per_layer_token_embd.weight"
    assert canonical_name("rope_freqs.weight") is None and canonical_name("v.blk.0.attn_q.weight") is None


# ---- a file written by the gguf package ----------------------------------------------------------


def reference_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> Path:
    """A SMALL gemma4 GGUF written with the gguf package's GGUFWriter (tensors: GGUF name -> data, type)."""
    config = SMALL
    spec = json.loads(small_aux().tokenizer_json)
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    w = GGUFWriter(path, "gemma4")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length([config.mlp_width(i) for i in range(config.num_hidden_layers)])
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.global_head_dim)
    w.add_value_length(config.global_head_dim)
    w.add_key_length_swa(config.head_dim)
    w.add_value_length_swa(config.head_dim)
    w.add_sliding_window(config.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    w.add_shared_kv_layers(config.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    w.add_rope_freq_base(1e6)
    w.add_rope_freq_base_swa(1e4)
    w.add_final_logit_softcapping(30.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    w.add_token_types([TokenType.NORMAL] * len(tokens))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    freqs = np.full(config.global_head_dim // 2, 1e30, np.float32)
    freqs[: config.global_head_dim // 8] = 1.0
    w.add_tensor("rope_freqs.weight", freqs)
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def synthetic_gguf_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    out = {}
    for name, tensor in synthetic_tensors(SMALL, seed):
        if isinstance(tensor, PackedTensor):
            blocks = np.concatenate(list(packed_to_q4_0(tensor, name))).reshape(tensor.rows, -1)
            out[gguf_name(name)] = (blocks, Q4_0)
        else:
            out[gguf_name(name)] = (tensor.float().numpy(), GGMLQuantizationType.F32)
    return out


def test_reads_a_file_written_by_the_gguf_package(tmp_path):
    tensors = synthetic_gguf_tensors()
    # One matrix as F16 and one as BF16 values on the grid: recovered onto it on read.
    for name, kind in (("blk.1.attn_q.weight", GGMLQuantizationType.F16), ("blk.2.ffn_up.weight", GGMLQuantizationType.BF16)):
        dense = quants.dequantize(tensors[name][0], Q4_0)
        tensors[name] = (quants.quantize(dense, kind), kind)
    source = GGUFSource(reference_gguf(tmp_path / "ref.gguf", tensors))
    assert source.config == SMALL
    expected = dict(synthetic_tensors(SMALL, 0))
    assert source.names() == list(expected)
    for name, tensor in source.iter_tensors():
        ref = expected[name]
        if isinstance(ref, PackedTensor):
            assert torch.equal(tensor.packed, ref.packed), name
            assert torch.equal(tensor.scales.float(), ref.scales.float()), name
        else:
            assert torch.equal(tensor, ref.float()), name
    assert set(source.grid_reports()) == {"layers.1.self_attn.q_proj", "layers.2.mlp.up_proj"}
    assert all(r.exact_share == 1.0 for r in source.grid_reports().values())


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K], ids=lambda k: k.name)
def test_other_quantisations_are_refused_naming_tensor_and_type(tmp_path, kind):
    tensors = synthetic_gguf_tensors()
    blocks, _ = tensors["token_embd.weight"]
    dense = quants.dequantize(blocks, Q4_0)
    if kind == GGMLQuantizationType.Q8_0:
        data = quants.quantize(dense, kind)
    else:  # the gguf package cannot quantise Q6_K; the bytes are never decoded
        block, size = GGML_QUANT_SIZES[kind]
        data = np.zeros((dense.shape[0], dense.shape[1] // block * size), np.uint8)
    tensors["token_embd.weight"] = (data, kind)
    path = reference_gguf(tmp_path / "mixed.gguf", tensors)
    with pytest.raises(Qat4Error, match=rf"tensor token_embd\.weight in .*mixed\.gguf is stored as {kind.name}"):
        GGUFSource(path)


def test_other_architectures_and_missing_keys_are_named(tmp_path):
    w = GGUFWriter(tmp_path / "llama.gguf", "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(Qat4Error, match="architecture 'llama'"):
        GGUFSource(tmp_path / "llama.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(Qat4Error, match="junk.gguf is not a readable GGUF"):
        GGUFSource(tmp_path / "junk.gguf")


# ---- a file written by qat4 ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    return write_small(tmp_path_factory.mktemp("gguf") / "small.gguf", "gguf")


def test_metadata_round_trip(written, tmp_path):
    source = GGUFSource(written.parent)  # a folder holding one .gguf file opens that file
    assert source.config == SMALL
    aux = source.aux()
    assert aux.chat_template == CHAT_TEMPLATE
    assert aux.generation_config == {"bos_token_id": 2, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
                                     "do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95}
    # The tokenizer read back writes the same vocabulary again.
    again = write_gguf(tmp_path / "again.gguf", source.config, source.iter_tensors(), aux)
    a, b = GGUFFile(written), GGUFFile(again)
    assert a.keys() == b.keys() and all(a.get(k) == b.get(k) for k in a.keys())
    assert {k: (v.type, v.shape) for k, v in a.tensors.items()} == {k: (v.type, v.shape) for k, v in b.tensors.items()}


def test_the_gguf_package_reads_what_qat4_writes(written):
    reader = GGUFReader(written)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "gemma4"
    assert field("gemma4.block_count") == SMALL.num_hidden_layers
    assert field("gemma4.feed_forward_length") == [128] * 6 + [256] * 4
    assert field("gemma4.attention.sliding_window_pattern") == [True] * 4 + [False] + [True] * 4 + [False]
    assert field("gemma4.attention.key_length") == 64 and field("gemma4.attention.key_length_swa") == 32
    assert field("gemma4.attention.shared_kv_layers") == 4
    assert field("tokenizer.ggml.model") == "gemma4" and field("tokenizer.ggml.add_bos_token") is True
    types, tokens = field("tokenizer.ggml.token_type"), field("tokenizer.ggml.tokens")
    assert all(types[i] == TokenType.CONTROL for i in CONTROL) and all(types[i] == TokenType.USER_DEFINED for i in USER_DEFINED)
    byte_ids = [i for i, t in enumerate(tokens) if t.startswith("<0x")]
    assert len(byte_ids) == 256 and all(types[i] == TokenType.BYTE for i in byte_ids)
    tensors = {t.name: t for t in reader.tensors}
    freqs = tensors["rope_freqs.weight"]
    assert freqs.tensor_type == GGMLQuantizationType.F32 and list(freqs.data[:8]) == [1.0] * 8 and freqs.data[8] == np.float32(1e30)
    assert tensors["blk.0.ffn_up.weight"].tensor_type == Q4_0 and list(tensors["blk.0.ffn_up.weight"].shape) == [128, 128]
    assert list(tensors["per_layer_token_embd.weight"].shape) == [SMALL.per_layer_width, SMALL.vocab_size]
    assert tensors["blk.0.attn_norm.weight"].tensor_type == GGMLQuantizationType.F32
    assert "output.weight" not in tensors and "blk.6.attn_k.weight" not in tensors
    up = dict(synthetic_tensors(SMALL, 0))["layers.0.mlp.up_proj"]
    dense = quants.dequantize(np.asarray(tensors["blk.0.ffn_up.weight"].data), Q4_0)
    assert torch.equal(torch.from_numpy(dense), up.dequantize(torch.float32))


def test_untied_output_layer_round_trips_as_output_weight(tmp_path):
    tensors = dict(synthetic_tensors(SMALL, 0))
    tensors["lm_head"] = next(synthetic_tensors(SMALL, 1))[1]  # another embed_tokens-shaped matrix
    source = GGUFSource(write_small(tmp_path / "untied.gguf", "gguf", tensors=tensors))
    assert "output.weight" in source.file.tensors and source.config.tie_word_embeddings is False
    assert source.names()[-1] == "lm_head"
    assert torch.equal(source.read("lm_head").packed, tensors["lm_head"].packed)


# ---- the real vocabulary -------------------------------------------------------------------------


def test_tokenizer_of_a_written_gguf_matches_llama_cpp_vocabulary(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", TINY, synthetic_tensors(TINY, 0), synthetic_aux())
    mine, theirs = GGUFFile(path), GGUFFile(VOCAB_GGUF)
    for key in ("tokens", "merges", "token_type", "scores", "bos_token_id", "eos_token_id", "unknown_token_id",
                "padding_token_id", "mask_token_id", "add_bos_token", "add_space_prefix", "model"):
        assert mine.get(f"tokenizer.ggml.{key}") == theirs.get(f"tokenizer.ggml.{key}"), key
    metadata = {k: mine.get(k) for k in mine.keys() if k.startswith("tokenizer.")}
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    vectors = official_vectors()
    for i in (0, 5, 11, 23, 37, 45):
        text, ids = vectors[i]
        assert tokenizer.encode(text) == ids, text


def test_a_gguf_whose_end_tokens_differ_stops_on_its_own(tmp_path, monkeypatch):
    """A GGUF's end tokens come from its metadata (eos, eot, then <turn|> and <|tool_response> by
    name): the engine, and the server through it, stop on those, not on Gemma 4's usual ids, and a
    constrained reply may end on exactly those once its grammar is complete."""
    import xgrammar

    from qat4.checkpoint.gguf import writer
    from qat4.checkpoint.loader import load_packed
    from qat4.engine import Engine

    eot = 900
    plain = writer.tokenizer_metadata
    monkeypatch.setattr(writer, "tokenizer_metadata", lambda *args: {
        **plain(*args), "tokenizer.ggml.eot_token_id": (GGUFValueType.UINT32, eot)})
    path = tmp_path / "other-eos.gguf"
    write_gguf(path, SMALL.replace(eos_token_id=(7,)), synthetic_tensors(SMALL, 0), small_aux())
    engine = Engine.from_packed(load_packed(str(path)), "cpu", max_ctx=64)
    assert engine.stop_token_ids == (7, eot, 106, 50)
    seq = engine.add_request([2, 10, 11], 8)
    assert seq.stop_ids == frozenset({7, eot, 106, 50})
    engine.abort(seq)

    constraint = engine.json_constraint({"type": "object"})
    for token in engine.tokenizer.encode("{}"):
        constraint.accept(token)
    bitmasks = xgrammar.allocate_token_bitmask(1, SMALL.vocab_size)
    constraint.fill(bitmasks, 0)
    allowed = [t for t in range(SMALL.vocab_size) if (bitmasks[0, t // 32] >> (t % 32)) & 1]
    assert allowed == sorted(engine.stop_token_ids)

"""Small synthetic checkpoints for the format tests, and the model of the engine tests on token ids.

`SMALL` is the tiny preset with a 1,024-token vocabulary, so that recovering the vocabulary tables
from 16-bit values and parsing a GGUF's tokenizer take a moment instead of minutes; its tokenizer
is a byte-fallback BPE laid out like Gemma 4's (specials at their Gemma 4 ids, `<0xNN>` byte
tokens, user-defined tool tokens, merges). Engine tests that feed token ids and read token ids
(batching, the prompt cache, speculative decoding) run on it too: on the CPU the real vocabulary's
output layer (262,144 rows) is most of a tiny model's step, and none of them reads text.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from qat4.checkpoint.compressed_tensors import write_ct
from qat4.checkpoint.gguf.writer import write_gguf
from qat4.checkpoint.qat_bf16 import write_qat_bf16
from qat4.checkpoint.source import AuxFiles
from qat4.checkpoint.synth import GENERATION_CONFIG, synthetic_tensors
from qat4.config import TINY

VOCAB = 1024
SMALL = TINY.replace(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB)
CONTROL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 105: "<|turn>", 106: "<turn|>"}
USER_DEFINED = {48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>", 52: '<|"|>'}
MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("▁", "in")]
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}<turn|>\n{% endfor %}"


def small_tokenizer_json() -> str:
    """A `VOCAB`-token BPE tokenizer.json with Gemma 4's special-token ids."""
    fixed = {**CONTROL, **USER_DEFINED}
    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["".join(pair) for pair in MERGES]
    free = (i for i in range(VOCAB) if i not in fixed)
    vocab = {token: i for token, i in zip(pieces, free)}
    vocab.update((f"<filler{i}>", i) for i in free)
    vocab.update((token, i) for i, token in fixed.items())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL.values()])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_DEFINED.values()])
    return tok.to_str()


def small_aux() -> AuxFiles:
    return AuxFiles(tokenizer_json=small_tokenizer_json(), chat_template=CHAT_TEMPLATE,
                    generation_config=dict(GENERATION_CONFIG))


def write_small(path: Path, fmt: str, seed: int = 0, tensors=None) -> Path:
    """A SMALL checkpoint in `fmt` at `path` (a .gguf file or a folder); `tensors` overrides the
    synthetic ones (a mapping of canonical names in writing order)."""
    tensors = synthetic_tensors(SMALL, seed) if tensors is None else tensors
    if fmt == "qat-bf16":
        write_qat_bf16(path, SMALL, tensors, small_aux())
    elif fmt in ("ct", "ct-emb4"):
        write_ct(path, SMALL, tensors, small_aux(), emb4=fmt == "ct-emb4")
    else:
        write_gguf(path, SMALL, tensors, small_aux())
    return path

"""Synthetic Gemma 4 checkpoints: random weights exactly on the 4-bit grid, in any format.

Every matrix gets random levels in -8..7 and one random step per group of 32 with at most four
significant bits, so `step x level` is exact in bf16 and fp16 and every format holds the same
values. The first level of each group is +1 or -1, which makes the recovery from dense 16-bit
values give back exactly these levels and steps. Steps are sized like trained
weights (linears about 0.004-0.015, tables about twice that); norms are random around a random
per-tensor mean (never all ones, which would hide a misplaced norm); `layer_scalar` is uniform in
0.02-0.8.

Each tensor draws from its own generator seeded from (seed, name), so a tensor does not depend on
which others are generated, and generation streams tensor by tensor. The vocabulary is the real
Gemma 4 one, shipped as `qat4/data/tokenizer.json.gz`; rebuild that file after a tokenizer change
with `write_tokenizer_data(<path to ggml-vocab-gemma-4.gguf>)`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Iterator

import torch

from qat4.checkpoint.compressed_tensors import TABLES, write_ct
from qat4.checkpoint.packed_model import PackedModel, Tensor, expected_tensors
from qat4.checkpoint.packing import GROUP, PER_WORD, PackedTensor
from qat4.checkpoint.qat_bf16 import write_qat_bf16
from qat4.checkpoint.source import FORMATS, AuxFiles
from qat4.config import Gemma4Config
from qat4.errors import Qat4Error

LINEAR_STEP_EXPONENTS = (-8, -7)  # step = (8..15)/8 x 2^e
TABLE_STEP_EXPONENTS = (-7, -6)
NORM_MEAN = (0.5, 1.5)  # per-tensor mean; values are mean x uniform(0.5, 2)
LAYER_SCALAR = (0.02, 0.8)

GENERATION_CONFIG = {
    "bos_token_id": 2,
    "eos_token_id": [1, 106, 50],
    "pad_token_id": 0,
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
}
TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "padding_side": "left",
    "clean_up_tokenization_spaces": False,
    "tokenizer_class": "GemmaTokenizer",
}
DATA = resources.files("qat4") / "data"
TOKENIZER_DATA = "tokenizer.json.gz"
CHAT_TEMPLATE_DATA = "chat_template.jinja"


def tensor_generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one tensor, seeded from (seed, name)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def synthetic_packed(rows: int, cols: int, exponents: tuple[int, int], g: torch.Generator) -> PackedTensor:
    """Random levels (each group's first one +-1) and 4-significant-bit steps 2^lo..2^(hi+1)."""
    device = g.device
    groups = (rows, cols // GROUP)
    mantissa = torch.randint(8, 16, groups, dtype=torch.int16, generator=g, device=device)
    exponent = torch.randint(exponents[0] - 3, exponents[1] - 2, groups, dtype=torch.int16, generator=g, device=device)
    steps = torch.ldexp(mantissa.to(torch.float16), exponent.to(torch.float16))  # exact: powers of two in range
    del mantissa, exponent  # keep peak memory near the size of the result (the PLE table is 1.3 GB)
    words = torch.randint(-(2**31), 2**31, (rows, cols // PER_WORD), dtype=torch.int32, generator=g, device=device)
    first = words[:, :: GROUP // PER_WORD]  # word 0 of each group: its nibble 0 is the group's first level
    code = (first & 1).mul_(2).add_(7)  # 7 or 9: level -1 or +1
    first.bitwise_and_(-16).bitwise_or_(code)  # in place, through the view
    return PackedTensor(words, steps)


def _uniform(shape: tuple[int, ...], low: float, high: float, g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g, device=g.device) * (high - low) + low


def synthetic_tensors(config: Gemma4Config, seed: int = 0, device: torch.device | str = "cpu") -> Iterator[tuple[str, Tensor]]:
    """Every text tensor of `config` in checkpoint order, generated one at a time.

    Deterministic for (seed, device); the same seed gives the same values on every CPU.
    """
    for name, spec in expected_tensors(config).items():
        g = tensor_generator(seed, name, device)
        if spec.packed:
            exponents = TABLE_STEP_EXPONENTS if name in TABLES else LINEAR_STEP_EXPONENTS
            yield name, synthetic_packed(*spec.shape, exponents, g)
        elif name.endswith("layer_scalar"):
            yield name, _uniform(spec.shape, *LAYER_SCALAR, g).to(torch.bfloat16)
        else:
            mean = _uniform((1,), *NORM_MEAN, g)
            yield name, (mean * _uniform(spec.shape, 0.5, 2.0, g)).to(torch.bfloat16)


def synthetic_model(config: Gemma4Config, seed: int = 0, device: torch.device | str = "cpu") -> PackedModel:
    """A PackedModel of synthetic tensors, built directly in memory."""
    model = PackedModel(config, dict(synthetic_tensors(config, seed, device)), generation_config=dict(GENERATION_CONFIG))
    model.validate("the synthetic model")
    return model


def _data_file(name: str) -> bytes:
    try:
        return (DATA / name).read_bytes()
    except FileNotFoundError:
        raise Qat4Error(f"package data file qat4/data/{name} is missing; reinstall qat4") from None


def synthetic_aux() -> AuxFiles:
    """The real Gemma 4 tokenizer and chat template, and the published generation settings."""
    return AuxFiles(
        tokenizer_json=gzip.decompress(_data_file(TOKENIZER_DATA)).decode(),
        chat_template=_data_file(CHAT_TEMPLATE_DATA).decode(),
        generation_config=dict(GENERATION_CONFIG),
        extra={"tokenizer_config.json": (json.dumps(TOKENIZER_CONFIG, indent=2, sort_keys=True) + "\n").encode()},
    )


def write_tokenizer_data(gguf_path: str | Path, out: str | Path | None = None) -> Path:
    """Rebuild the shipped `tokenizer.json.gz` from a vocabulary GGUF (reproducible bytes)."""
    from qat4.tokenizer import build_tokenizer_json

    out = Path(out) if out is not None else Path(str(DATA / TOKENIZER_DATA))
    out.write_bytes(gzip.compress(build_tokenizer_json(gguf_path).encode(), compresslevel=9, mtime=0))
    return out


def write_synthetic(out: str | Path, config: Gemma4Config, fmt: str, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a synthetic checkpoint of `config` in `fmt` (one of FORMATS) to `out`.

    For `gguf`, `out` names the .gguf file; for the other formats it is a folder.
    """
    out = Path(out)
    tensors = synthetic_tensors(config, seed)
    aux = synthetic_aux()
    if fmt in ("ct", "ct-emb4"):
        write_ct(out, config, tensors, aux, emb4=fmt == "ct-emb4", overwrite=overwrite)
    elif fmt == "qat-bf16":
        write_qat_bf16(out, config, tensors, aux, overwrite=overwrite)
    elif fmt == "gguf":
        if out.suffix != ".gguf":
            raise Qat4Error(f"{out} does not end in .gguf; for --format gguf, --out names the file to write")
        if out.exists() and not overwrite:
            raise Qat4Error(f"{out} already exists; pass --force to replace it")
        from qat4.checkpoint.gguf.writer import write_gguf

        write_gguf(out, config, tensors, aux)
    else:
        raise Qat4Error(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    return out

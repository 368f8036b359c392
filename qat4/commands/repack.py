"""`qat4 repack`: rewrite a checkpoint in another format without touching a single 4-bit code."""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from qat4.checkpoint import REPACK_TARGETS
from qat4.commands.progress import ProgressLine

SCALE_DTYPES = ("bf16", "fp16")
GB = 1e9


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "repack", help="rewrite a checkpoint as compressed-tensors or an exact Q4_0 GGUF",
        description="Rewrite a checkpoint of any format (a path or a Hugging Face model id) as ct (int4 linears, "
                    "16-bit tables dequantised exactly from levels x steps in bf16, like the published -text), "
                    "ct-emb4 (int4 tables too, with the untied lm_head copy) or gguf (every matrix exact Q4_0). "
                    "Codes and steps pass through unchanged; a 16-bit source is recovered onto the 4-bit grid and "
                    "the first off-grid group aborts the run. Tensors stream one at a time; the output is written "
                    "beside OUT under a temporary name, read back and checked, then renamed, so a failed or "
                    "interrupted run leaves nothing.")
    p.add_argument("src", metavar="SRC", help="checkpoint to read: a folder, a .gguf file or a Hub model id")
    p.add_argument("out", metavar="OUT", type=Path, help="folder to write (for --to gguf: the .gguf file)")
    p.add_argument("--to", choices=REPACK_TARGETS, required=True, help="output format")
    p.add_argument("--text-only", action="store_true",
                   help="write the text-only config layout (Gemma4ForCausalLM, as the published -text repacks) even "
                        "when SRC has Google's multimodal layout; vision and audio towers are never carried")
    p.add_argument("--scale-dtype", choices=SCALE_DTYPES,
                   help="dtype of the stored steps for ct and ct-emb4 (default: keep the source's steps exactly: "
                        "bf16 linears and fp16 emb4 tables when the source's linears have bf16 steps, fp16 "
                        "otherwise); a step the chosen dtype cannot hold aborts the run; gguf always stores fp16")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from qat4.checkpoint.repack import repack

    line = ProgressLine()
    start = time.monotonic()

    def progress(done: int, total: int, name: str, written: int) -> None:
        line.update(f"repack: tensor {done}/{total}, {written / GB:.2f} GB written ({name})")

    try:
        result = repack(args.src, args.out, args.to, text_only=args.text_only,
                        scale_dtype={"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.scale_dtype), force=args.force, progress=progress)
    finally:
        line.done()
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
    print(f"wrote {result.out}: {result.format}, {result.tensors} tensors, {result.bytes / GB:.2f} GB "
          f"in {time.monotonic() - start:.1f} s, peak RSS {peak_gb:.2f} GB")
    if result.recovered is not None:
        print(f"recovered from 16-bit values: {result.recovered.exact_share:.2%} of {result.recovered.elements:,} "
              f"values reproduce bit-identically, worst {result.recovered.worst_ulp_steps:.4f} steps off")
    return 0

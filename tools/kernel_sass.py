"""Compile the decode-batch kernel (qat4.ops.w4.batch) for a GPU without one, and count what its K
loop runs: the installed Triton's compiler, ptxas and nvdisasm, for an sm_90a target by default.

    python tools/kernel_sass.py [--tile 64 128 4 8] [--one-dot] [--prefetch 0] [--stages 1] [--x-dtype bf16]
                                [--arch 90] [--fp32-unpack] [--l2-prefetch]

Prints per tile (BLOCK_M BLOCK_N BLOCK_G num_warps) the registers and shared memory a program
takes and the instructions of the loop's body by class (HGMMA, WARPGROUP, BAR, LDG, STS, ...), so
that two variants of the kernel can be compared before a GPU times them. The pointers are taken as
16-byte aligned and N, G and the strides as multiples of 16, as Triton specializes them at E2B's
shapes; the split is 4 and the epilogue plain. A count is a hint, not a timing: what the GPU
overlaps is not in it.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qat4.ops.w4.batch import _batch_kernel  # noqa: E402
from qat4.ops.w4.batch_tiling import _TILES  # noqa: E402

ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "idx_ptr", "u_ptr", "part_ptr", "lock_ptr", "N", "G", "stride_xm",
           "stride_om", "stride_um")
TABLE_TILES = tuple(dict.fromkeys((bm, bn, bg, warps) for bm, _, (bn, bg, warps, *_), _ in _TILES))  # (BM, BN, BG, warps)


def steps_dtype(x_dtype: str) -> str:
    """The steps' dtype the kernel is compiled for: x's, or bf16 under fp32 x."""
    return "fp16" if x_dtype == "fp16" else "bf16"


def compile_tile(tile, one_dot: bool, x_dtype: str, arch: int, prefetch: int = 0, stages: int = 1,
                 pair_unpack: bool = True, l2_prefetch: bool = False):
    """The compiled kernel for one tile (BLOCK_M, BLOCK_N, BLOCK_G, num_warps)."""
    fn = _batch_kernel.fn  # under the heuristics decorator
    signature = {name: "i32" for name in fn.arg_names}
    signature.update({"x_ptr": f"*{x_dtype}", "w_ptr": "*i32", "s_ptr": f"*{steps_dtype(x_dtype)}", "out_ptr": f"*{x_dtype}",
                      "idx_ptr": "*i32", "u_ptr": f"*{x_dtype}", "part_ptr": "*fp32", "lock_ptr": "*i32",
                      "softcap": "fp32"})
    block_m, block_n, block_g, warps = tile
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g, SPLIT_K=4, PREFETCH=prefetch, ONE_DOT=int(one_dot),
                     EPILOGUE=0, SOFTCAP=False, ARGMAX=False, DOT_F32=x_dtype == "fp32",
                     PAIR_UNPACK=pair_unpack and x_dtype != "fp32", L2_PREFETCH=l2_prefetch, EVEN=True,
                     USE_PDL=False)
    signature.update({name: "constexpr" for name in constants})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    source = ASTSource(fn, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def nvidia_tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_counts(sass: str) -> collections.Counter:
    """Instruction classes of the longest loop body (the instructions up to a branch back)."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if found:
            instructions.append(found.group(1).strip())
    longest = []
    for i, text in enumerate(instructions):
        branch = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if branch and labels.get(branch.group(1), i + 1) <= i and i + 1 - labels[branch.group(1)] > len(longest):
            longest = instructions[labels[branch.group(1)] : i + 1]
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in longest)


def describe(tile, one_dot: bool, x_dtype: str, arch: int, prefetch: int = 0, stages: int = 1,
             pair_unpack: bool = True, l2_prefetch: bool = False) -> str:
    kernel = compile_tile(tile, one_dot, x_dtype, arch, prefetch, stages, pair_unpack, l2_prefetch)
    with tempfile.TemporaryDirectory() as scratch:
        cubin = os.path.join(scratch, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([nvidia_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([nvidia_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", usage).group(1)
    counts = loop_counts(sass)
    top = ", ".join(f"{name} {n}" for name, n in counts.most_common(14))
    prefetches = len(re.findall(r"CCTL\S*\.PF2", sass))  # L2 prefetches anywhere in the kernel
    return (f"{'x'.join(map(str, tile))} {'one dot' if one_dot else 'eight dots'}: {registers} registers, "
            f"{kernel.metadata.shared / 1024:.0f} KiB shared, {prefetches} L2 prefetch instructions; "
            f"loop {sum(counts.values())} instructions: {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", type=int, nargs=4, metavar=("BLOCK_M", "BLOCK_N", "BLOCK_G", "WARPS"),
                        help="one tile (default: the table's tiles)")
    parser.add_argument("--one-dot", action="store_true", help="only ONE_DOT=1 (default: both ways)")
    parser.add_argument("--prefetch", type=int, choices=(0, 1, 2), default=0, help="steps of words loaded ahead")
    parser.add_argument("--stages", type=int, default=1, help="num_stages (Triton's software pipelining)")
    parser.add_argument("--x-dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for sm_90a")
    parser.add_argument("--fp32-unpack", action="store_true",
                        help="unpack each weight in fp32 (PAIR_UNPACK=0) instead of two at a time in x's dtype")
    parser.add_argument("--l2-prefetch", action="store_true", help="prefetch each program's slice of W into L2 first")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_{args.arch}, x {args.x_dtype} (steps {steps_dtype(args.x_dtype)}), PREFETCH {args.prefetch}, "
          f"num_stages {args.stages}, {'fp32' if args.fp32_unpack else 'pair'} unpacking"
          f"{', L2 prefetch' if args.l2_prefetch else ''}")
    for tile in [tuple(args.tile)] if args.tile else TABLE_TILES:
        for one_dot in (True,) if args.one_dot else (False, True):
            print(describe(tile, one_dot, args.x_dtype, args.arch, args.prefetch, args.stages, not args.fp32_unpack,
                           args.l2_prefetch), flush=True)


if __name__ == "__main__":
    main()

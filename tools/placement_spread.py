"""How much one decode step's time depends on where the weights sit in GPU memory.

    python tools/placement_spread.py [--draws 6] [--replays 300] [--arena]

Builds the E2B-shaped synthetic engine once (pinning the tilings of ``$QAT4_TILINGS`` when set).
Then, per draw, every packed matrix (words and group steps) moves to new memory, in a shuffled
order: its own allocation each, or with ``--arena`` a slice of one contiguous buffer at a random
offset. The greedy decode step is then captured anew and its graph replays timed (best of three
runs, see qat4.decode_tuning.step_time_us). Same code, same tilings, same weights: the spread
between draws is what placement alone is worth.
"""

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qat4.checkpoint.packing import PackedTensor  # noqa: E402
from qat4.commands.bench import load_packed_for_bench  # noqa: E402
from qat4.decode_tuning import step_time_us  # noqa: E402
from qat4.engine import GREEDY, Engine  # noqa: E402

ALIGN = 256  # bytes: the alignment of a fresh CUDA allocation


def packed_matrices(model) -> list[PackedTensor]:
    """Every PackedTensor the model holds, each once (the output layer may be the embedding table)."""
    found = {}
    for owner in (model, *model.layers):
        for value in vars(owner).values():
            if isinstance(value, PackedTensor):
                found[id(value)] = value
    return list(found.values())


def move(matrices: list[PackedTensor], rng: random.Random, arena: bool) -> None:
    """Give every matrix's words and steps new memory in a shuffled order (the old is freed)."""
    parts = [(m, name) for m in matrices for name in ("packed", "scales")]
    rng.shuffle(parts)
    if not arena:
        for m, name in parts:
            setattr(m, name, getattr(m, name).clone())
        return
    sizes = [-(-getattr(m, name).nbytes // ALIGN) * ALIGN for m, name in parts]
    offset = rng.randrange(0, 1 << 21, ALIGN)  # where in a 2 MiB page the first matrix starts
    buffer = torch.empty(offset + sum(sizes), dtype=torch.uint8, device=parts[0][0].packed.device)
    for (m, name), size in zip(parts, sizes):
        old = getattr(m, name)
        new = buffer[offset : offset + old.nbytes].view(old.dtype).view(old.shape)
        new.copy_(old)
        setattr(m, name, new)
        offset += size


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=6)
    parser.add_argument("--replays", type=int, default=300)
    parser.add_argument("--arena", action="store_true", help="all matrices in one contiguous buffer")
    args = parser.parse_args()
    packed = load_packed_for_bench("synthetic:e2b", torch.device("cuda"), seed=0)
    engine = Engine.from_packed(packed, "cuda", max_ctx=1024)
    matrices = packed_matrices(engine.model)
    rng = random.Random(0)
    print(f"as loaded: {step_time_us(engine.step, GREEDY, args.replays):7.1f} µs per step", flush=True)
    for draw in range(args.draws):
        move(matrices, rng, args.arena)
        torch.cuda.empty_cache()
        us = step_time_us(engine.step, GREEDY, args.replays)
        print(f"draw {draw} ({'one buffer' if args.arena else 'own allocations'}): {us:7.1f} µs per step", flush=True)


if __name__ == "__main__":
    main()

"""Where the period of a speculating step goes, one stream: the device's share and the host's, by phase.

    python tools/spec_step.py [--acceptance 0,0.7,0.9] [--k 3] [--repeat 2] [--new 256] [--context 512] [--profile N]

A step that verifies drafts waits for the step before it (its drafts follow the newest tokens), so
the host's work between that read and the next graph replay is time the GPU idles
(:mod:`qat4.engine.speculation`). This builds the engine as ``qat4 bench speculative`` does, decodes
one greedy stream with drafts replayed from its plain continuation at each acceptance (k drafts
every step, then the engine's adaptive choice), ``--repeat`` times each, and times every engine
step that speculates (``whole step``, one :meth:`Engine.step` call: a step launching drafts, or
reading the last step that did) and the engine's calls in it:

- ``device wait``: the read's wait for the step's tokens (the GPU's share of the period);
- ``host``: the rest of the step (``whole step`` less ``device wait``), and in it ``schedule``,
  ``propose``, ``launch`` with its parts ``flush`` (block-table entries), ``run_decode`` (the rows'
  upload, or a verifying step's rows into the buffer its graph copies in, and the graph's replay,
  ``replay`` alone) and ``send back`` (the tokens' copy to the host and its event), ``reserve``
  (after the launch, while the GPU runs: the next step's blocks held ahead, their entries'
  ``flush`` counted in both) and ``tolist`` (the tokens read into Python).

Each phase is printed as mean / median µs per speculating step. Running an acceptance twice shows
how much the host's own speed moves between runs. ``--profile N`` adds one run under cProfile and
its N functions of most own time per step, the CUDA calls behind a phase among them.
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.bench_speculative import build_engine, plain_continuations, timed_decode, use_replay  # noqa: E402
from qat4.commands.bench import load_packed_for_bench  # noqa: E402
from qat4.commands.model_args import DEVICES, resolve_device  # noqa: E402
from qat4.engine import Engine  # noqa: E402
from qat4.engine import model_runner  # noqa: E402


@contextmanager
def timed_phases(engine: Engine, spans: dict[str, list[float]]):
    """Within it, every engine step that speculates appends its seconds to ``spans["whole step"]``
    (the whole :meth:`Engine.step` call), its wait for the device to ``spans["device wait"]``, the
    rest to ``spans["host"]``, and to ``spans[phase]`` the seconds of each phase's calls in it
    (0 for a phase it did not run). Steps that do not speculate leave no trace."""
    step: dict[str, float] = defaultdict(float)  # the step being run: seconds per phase, and a flag
    restore = []

    def timed(original, phase: str):
        def call(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            step[phase] += time.perf_counter() - start
            return result
        return call

    def speculating(original):
        def call(*args, **kwargs):
            step["speculated"] = 1.0
            return original(*args, **kwargs)
        return call

    def whole(original):
        def call(*args, **kwargs):
            step.clear()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            seconds = time.perf_counter() - start
            if step.pop("speculated", 0.0):
                step["whole step"], step["host"] = seconds, seconds - step["device wait"]
                for phase in PHASES:
                    spans[phase].append(step[phase])
            return result
        return call

    def read(original):
        def call(self):
            start = time.perf_counter()
            if self.event is not None:
                self.event.synchronize()
            waited = time.perf_counter()
            tokens = original(self)
            step["device wait"] += waited - start
            step["tolist"] += time.perf_counter() - waited
            return tokens
        return call

    def wrap(owner, name: str, wrapper) -> None:
        restore.append((owner, name, owner.__dict__.get(name)))  # None: the method is the class's
        setattr(owner, name, wrapper(getattr(owner, name)))

    runner = engine.runner
    wrap(engine, "step", whole)
    wrap(engine, "_speculative_step", speculating)
    wrap(model_runner.StepTokens, "read", read)
    for owner, name, phase in [(engine.scheduler, "schedule", "schedule"), (engine.speculator, "propose", "propose"),
                               (engine, "_launch", "launch"), (engine.scheduler, "reserve", "reserve"),
                               (runner.pool, "flush", "flush"),
                               (runner, "run_decode", "run_decode"), (runner, "replay", "replay"),
                               (runner, "_send", "send back")]:
        wrap(owner, name, lambda original, phase=phase: timed(original, phase))
    try:
        yield
    finally:
        for owner, name, own in reversed(restore):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


PHASES = ["whole step", "device wait", "host", "schedule", "propose", "launch", "flush", "run_decode", "replay",
          "send back", "reserve", "tolist"]


def summary(spans: dict[str, list[float]]) -> dict[str, list[float]]:
    """Mean and median µs per speculating step of each phase, in PHASES' order."""
    return {phase: [statistics.mean(spans[phase]) * 1e6, statistics.median(spans[phase]) * 1e6]
            for phase in PHASES if spans.get(phase)}


def profile_run(engine: Engine, prompts: list[list[int]], new: int, futures: dict, top: int) -> str:
    """One more run with the speculator as set, under cProfile: the ``top`` functions by own
    time, in µs per speculating step (the profiler's own cost inflates them all)."""
    spans: dict[str, list[float]] = defaultdict(list)
    profiler = cProfile.Profile()
    with timed_phases(engine, spans):
        profiler.enable()
        timed_decode(engine, prompts, new, futures)
        profiler.disable()
    steps = max(1, len(spans["whole step"]))
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    lines = [f"under cProfile, {steps} speculating steps: own µs a step, calls a step, function"]
    for (file, line, name), (_, calls, own, _, _) in rows:
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        lines.append(f"  {own / steps * 1e6:8.1f} {calls / steps:6.1f}  {where}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic:e2b", help="as for qat4 bench (default: %(default)s)")
    p.add_argument("--device", choices=DEVICES, help="default: cuda when a GPU is visible, else cpu")
    p.add_argument("--acceptance", default="0,0.7,0.9", help="replayed drafts' acceptance rates (default: %(default)s)")
    p.add_argument("--k", type=int, default=3, help="drafts a step (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each acceptance (default: %(default)s)")
    p.add_argument("--new", type=int, default=256, help="tokens decoded a run (default: %(default)s)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens (default: %(default)s)")
    p.add_argument("--json", help="write the runs here as JSON")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then one more run at the last acceptance, k drafts a step, under cProfile: its N functions "
                        "of most own time, µs per speculating step (C calls such as a tensor's copy_ included)")
    args = p.parse_args(argv)
    device = torch.device(resolve_device(args.device))
    engine = build_engine(load_packed_for_bench(args.model, device, 0), device, 1, args.context, args.new, args.k)
    speculator = engine.speculator
    prompt = torch.randint(3, engine.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    prompts = [prompt.tolist()]
    plain, futures = plain_continuations(engine, prompts, args.new)
    print(f"{args.model} on {device}: plain decoding {plain:,.1f} tok/s; a step verifying k drafts, µs: "
          + ", ".join(f"k={q - 1} {speculator.costs[(1, q)] * 1e6:,.0f}" for q in range(1, args.k + 2)))
    runs = []
    for a in [float(x) for x in args.acceptance.split(",")]:
        for _ in range(args.repeat):
            for k in [args.k, None]:
                use_replay(engine, a, k)
                spans: dict[str, list[float]] = defaultdict(list)
                verified, kept = speculator.verified, speculator.accepted
                with timed_phases(engine, spans):
                    tok_s, _ = timed_decode(engine, prompts, args.new, futures)
                phases = summary(spans) if spans["whole step"] else {}
                run = {"acceptance": a, "k": k, "tok_s": tok_s, "speedup": tok_s / plain,
                       "verified": speculator.verified - verified, "kept": speculator.accepted - kept,
                       "speculating_steps": len(spans["whole step"]), "phases_us": phases}
                runs.append(run)
                shown = " ".join(f"{name} {m:,.0f}/{md:,.0f}" for name, (m, md) in phases.items())
                print(f"a={a} k={k or 'adaptive'}: {tok_s:,.1f} tok/s ({tok_s / plain:.2f}x), {run['verified']} "
                      f"verifications keeping {run['kept']} drafts; µs per step, mean/median: {shown}")
    if args.profile:
        use_replay(engine, a, args.k)
        print(profile_run(engine, prompts, args.new, futures, args.profile))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "device": str(device), "plain_tok_s": plain,
                                               "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

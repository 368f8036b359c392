"""Decode GEMV tilings chosen by the time of the whole captured decode step, kept per GPU.

The GEMV autotuner times each tiling of a shape alone (L2 flushed, nothing before it to overlap
with). In a decode step some 200 GEMVs run chained under programmatic dependent launch, and those
isolated timings do not rank tilings for it: on an H200 the same code decodes in 1,595 to 1,758 µs
per step depending on the picks (BENCHMARKS.md). :func:`tune_decode_tilings` starts from the
tilings in use and, shape by shape (the most weight bytes first), tries each candidate tiling by
capturing the step anew and timing its graph replays; a candidate replaces the current tiling only
when the step gets faster by more than ``margin``. The winners are pinned in the model's tilings
(:meth:`qat4.ops.w4.tiling.MatvecTilings.pin`) and can be saved per GPU, dtype and Triton version
(:func:`save_tilings`) and pinned again at the next load (:func:`load_tilings`). Shapes a machine
has no tilings of its own for take those qat4 ships for its GPU, dtype and Triton version, if any
(``qat4/data/decode_tilings.json``, found by this descent on E2B's shapes: the tilings depend on
the shapes, never on the weights' values); :func:`tilings_for` merges them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from qat4.ops._triton import TRITON_VERSION
from qat4.ops.w4.tiling import TILING_KEYS, matvec_tiling_candidates

Tilings = dict[tuple, dict]
SHIPPED_TILINGS = Path(__file__).resolve().parent.parent / "data" / "decode_tilings.json"


def descend(start: Tilings, candidates: dict[tuple, list[dict]], measure: Callable[[Tilings], float],
            margin: float = 0.01) -> tuple[Tilings, float, float]:
    """Coordinate descent: for each key of `candidates` in order, try each of its tilings in place of
    the current one; keep it when ``measure`` (lower is better) drops below (1 - margin) x the best so
    far. Returns (best tilings, their measure, the start's measure)."""
    best, best_value = dict(start), measure(start)
    start_value = best_value
    for key, options in candidates.items():
        for tiling in options:
            if tiling == best[key]:
                continue
            trial = {**best, key: tiling}
            value = measure(trial)
            if value < best_value * (1 - margin):
                best, best_value = trial, value
    return best, best_value, start_value


def step_time_us(runner, key: tuple[int, int, int, bool, bool], replays: int) -> float:
    """Capture the runner's decode graph for `key` (batch size, rows per sequence, keep, masked,
    scored) anew with the tilings its model pins now and return µs per replay (:func:`replay_us`). A capture writes only the
    pool's scratch row, so the replays do too."""
    runner.graphs.pop(key, None)
    runner.capture(*key)
    return replay_us(runner.graphs[key], replays)


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """µs per replay of a captured graph: the best of three runs of `replays`, after ten."""
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / replays)
    return best


def best_seconds(run: Callable[[], None], device: torch.device, tries: int = 3) -> float:
    """Seconds of the fastest of ``tries`` calls of ``run`` (synchronised on CUDA), after one that warms caches."""
    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    run()
    return min(timed() for _ in range(tries))


def tune_decode_tilings(runner, key: tuple[int, int, int, bool, bool], replays: int = 50,
                        margin: float = 0.01) -> tuple[Tilings, float, float]:
    """Pick every GEMV tiling of the decode graph `key` (batch size, rows per sequence, keep, masked,
    scored) by whole-step replay time (module docstring) and pin them in the runner's model's tilings.

    Starts from the tilings in use (the autotuner's picks, or those pinned at load). Drops the
    graph for `key` (captured last with a trial tiling): the next capture uses the tilings found.
    Returns (tilings, µs per step with the starting tilings, µs per step with the tilings found).
    """
    in_use = runner.model.tilings
    runner.graphs.pop(key, None)
    in_use.forget()
    runner.capture(*key)  # eager warm-up steps launch (and autotune) every GEMV shape of the step
    start = in_use.launched()
    device = runner.device
    by_bytes = sorted(start, key=lambda shape: shape[0] * shape[1], reverse=True)
    candidates = {shape: matvec_tiling_candidates(shape, device) for shape in by_bytes}

    def measure(tilings: Tilings) -> float:
        in_use.pin(tilings)
        return step_time_us(runner, key, replays)

    best, after, before = descend(start, candidates, measure, margin)
    in_use.pin(best)
    runner.graphs.pop(key, None)
    return best, before, after


def describe_tilings(tilings: Tilings) -> list[str]:
    """Lines that show a table of tilings: a header, then one line per GEMV shape key in order."""
    lines = [f"(N, K/32, rows of x, epilogue, residual, dtype) -> ({', '.join(TILING_KEYS)})"]
    for key, tiling in sorted(tilings.items(), key=lambda item: str(item[0])):
        lines.append(f"{key} -> {tuple(tiling[k] for k in TILING_KEYS)}")
    return lines


def tilings_path() -> Path:
    """Where tuned tilings are kept: ``$QAT4_TILINGS``, else ~/.cache/qat4/decode_tilings.json."""
    return Path(os.environ.get("QAT4_TILINGS") or Path.home() / ".cache" / "qat4" / "decode_tilings.json")


def pinned_tilings_note(pinned: int, shapes: int, sources: tuple[Path, ...] = ()) -> str:
    """What an engine took from the saved tilings (:attr:`qat4.engine.Engine.pinned_tilings`: from
    the files ``sources``, by default :func:`tilings_path`), and what to do when it did not cover
    the decode steps."""
    files = " and ".join(map(str, sources or (tilings_path(),)))
    note = f"decode GEMV tilings: {pinned} of {shapes} shapes pinned from {files}"
    if pinned < shapes:
        note += ", the rest autotuned (step times then vary from run to run; `qat4 bench --tune` saves tilings for every shape)"
    return note


def _machine_key(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name} | {str(dtype).removeprefix('torch.')} | triton {TRITON_VERSION}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_tilings(tilings: Tilings, device: torch.device, dtype: torch.dtype, path: Path | None = None) -> Path:
    """Store `tilings` for this GPU, dtype and Triton version beside those of other machines
    (written to a temporary file, then renamed over the old one)."""
    path = path or tilings_path()
    table = _read(path)
    table[_machine_key(device, dtype)] = {json.dumps(list(shape)): tiling for shape, tiling in tilings.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load_tilings(device: torch.device, dtype: torch.dtype, path: Path | None = None) -> Tilings:
    """The tilings saved for this GPU, dtype and Triton version ({} when none, or when the file
    cannot be read)."""
    saved = _read(path or tilings_path()).get(_machine_key(device, dtype), {})
    return {tuple(json.loads(shape)): tiling for shape, tiling in saved.items()}


def tilings_for(device: torch.device, dtype: torch.dtype) -> tuple[Tilings, tuple[Path, ...]]:
    """The tilings an engine pins and the files they come from: this machine's own
    (:func:`tilings_path`), and for shapes it has none of, those qat4 ships for the same GPU, dtype
    and Triton version (module docstring)."""
    paths = (tilings_path(), SHIPPED_TILINGS)
    own, shipped = (load_tilings(device, dtype, path) for path in paths)
    return {**shipped, **own}, tuple(path for path, table in zip(paths, (own, shipped)) if table)

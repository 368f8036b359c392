"""What the HTTP server costs beside a paced engine, with no model and no GPU.

`qat4 serve` runs the engine's step loop in a thread beside the event loop that parses requests
and streams tokens, in one interpreter. This tool serves `qat4 bench serve`'s load from the real
server app over a *paced* engine: each step holds the GIL for ``--host-ms`` (the engine's Python:
scheduling, launching, reading back) and a simulated device runs it in ``--step-ms`` (a step
already in flight delays the next, as a CUDA stream does); like the engine, a step launches the
next batch and then waits, without the GIL, for the previous one's tokens. Prompts cost the device
``--prompt-us`` a token. What the engine alone would give under the same load is the device's
pace; the table puts the server's output tok/s beside it, per level, engine host time and
Python switch interval (``sys.setswitchinterval``: Python's default is 5 ms, qat4 serve's 0.5 ms),
so the cost of the server sharing one interpreter with the engine can be studied on any machine.

    python tools/serve_overhead.py --concurrency 16,64 --host-ms 0,1 --switch-interval-ms 5,0.5

The server (with the paced engine in its thread) and the client (`qat4 bench serve --url`) run in
separate processes; each row also gives the server process's CPU time per output token (the
engine's simulated host time included, ``--host-ms`` a step). The
client needs about a core of its own at a few thousand tok/s, so on a machine of two cores the
client and the server contend for them: compare runs of one machine, and study the server's
share on a machine with cores to spare.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from qat4.commands.model_args import synthetic_tokenizer  # noqa: E402
from qat4.commands.serve import SWITCH_INTERVAL_S, freeze_loaded_objects  # noqa: E402
from qat4.config import E2B, PRESETS  # noqa: E402
from qat4.engine import Engine, SamplingParams, StepOutput  # noqa: E402
from qat4.engine.sequence import Sequence, State  # noqa: E402
from qat4.errors import Qat4Error  # noqa: E402
from qat4.serve_process import ServerProcess, free_port  # noqa: E402


def parse_steps(text: str) -> dict[int, float]:
    """--step-ms "1:1.8,64:4.69": device ms per decode step by rows (linear in between)."""
    points = {}
    for part in text.split(","):
        rows, ms = part.split(":")
        points[int(rows)] = float(ms)
    return dict(sorted(points.items()))


def step_ms(points: dict[int, float], rows: int) -> float:
    """The device time of a step of ``rows`` decode rows, interpolated between the given points."""
    keys = list(points)
    if rows <= keys[0]:
        return points[keys[0]]
    for lo, hi in zip(keys, keys[1:]):
        if rows <= hi:
            return points[lo] + (points[hi] - points[lo]) * (rows - lo) / (hi - lo)
    return points[keys[-1]] * rows / keys[-1]


def hold_gil(seconds: float) -> None:
    """Python work for ``seconds``: the engine's host side, holding the GIL as it does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class PacedEngine:
    """The Engine surface the server uses, stepping on a simulated device: ``step`` spends
    ``host_s`` in Python, launches the batch on the device timeline, then sleeps (the GIL free)
    until the step launched before it has finished and returns that step's tokens."""

    def __init__(self, steps: dict[int, float], host_ms: float, prompt_us: float, max_num_seqs: int):
        self.tokenizer = synthetic_tokenizer()
        self.config = PRESETS["tiny"]
        self.stop_token_ids = self.config.eos_token_id
        self.max_ctx, self.max_num_seqs = E2B.max_position_embeddings, max_num_seqs
        self.device = torch.device("cpu")
        self.steps, self.host_s, self.prompt_s = steps, host_ms / 1e3, prompt_us / 1e6
        self.filler = self.tokenizer.encode(" more")[-1]
        self.scheduler = types.SimpleNamespace(running=[], waiting=collections.deque())
        self.pool = types.SimpleNamespace(usage=lambda: {"full_attention": 0.0},
                                          cached_blocks=lambda: {"full_attention": 0})
        self._device_free = 0.0  # when the simulated device finishes what was launched
        self._in_flight: tuple[float, list[Sequence]] | None = None

    def encode(self, prompt):
        return Engine.encode(self, prompt)

    def check_request(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if prompt_tokens + max_new_tokens > self.max_ctx:
            raise Qat4Error(f"{prompt_tokens} + {max_new_tokens} tokens are more than the context of {self.max_ctx}")

    def add_request(self, prompt, max_new_tokens=256, temperature=None, top_k=None, top_p=None, seed=None,
                    stop_token_ids=None, constraint=None, logprobs=None) -> Sequence:
        seq = Sequence(self.encode(prompt), SamplingParams(), 0, max_new_tokens, frozenset())
        self.scheduler.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq``; the next step drops it from the batch (its tokens in flight are not read)."""
        if seq.state is State.WAITING and seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        seq.state, seq.finish_reason = State.FINISHED, seq.finish_reason or "abort"

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._in_flight)

    def drain(self) -> None:
        while self.has_work:
            self.step()

    def step(self) -> list[StepOutput]:
        self.scheduler.running[:] = [s for s in self.scheduler.running if s.state is not State.FINISHED]
        running, waiting = self.scheduler.running, self.scheduler.waiting
        admitted = []
        while waiting and len(running) < self.max_num_seqs:
            seq = waiting.popleft()
            seq.state, seq.started = State.RUNNING, time.perf_counter()
            running.append(seq)
            admitted.append(seq)
        hold_gil(self.host_s)
        launched = None
        # every running sequence that still wants tokens, its last one in flight or not (the engine
        # feeds a row the token the step before it samples, on the device)
        batch = [s for s in running if len(s.output) + s.pending < s.max_new_tokens]
        if batch:
            busy = step_ms(self.steps, len(batch)) / 1e3 + self.prompt_s * sum(len(s.prompt) for s in admitted)
            self._device_free = max(time.perf_counter(), self._device_free) + busy
            for seq in batch:
                seq.pending += 1
            launched = (self._device_free, batch)
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return []
        done_at, seqs = previous
        time.sleep(max(0.0, done_at - time.perf_counter()))
        outputs, now = [], time.perf_counter()
        for seq in seqs:
            if seq.state is State.FINISHED:
                continue
            finished = seq.accept(self.filler, now)
            if finished:
                self.abort(seq)
            outputs.append(StepOutput(seq, self.filler, finished))
        return outputs


def serve(args: argparse.Namespace) -> None:
    """The server process: the app over a paced engine, as `qat4 serve` runs it."""
    import uvicorn

    from qat4.server.app import create_app
    from qat4.server.protocol import HeaderTimeoutProtocol

    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    engine = PacedEngine(parse_steps(args.step_ms), args.host_ms, args.prompt_us, args.max_num_seqs)
    app = create_app(engine, max_queue=256)
    freeze_loaded_objects()
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                  http=HeaderTimeoutProtocol)).run()


def engine_pace(steps: dict[int, float], host_ms: float, concurrency: int, input_len: int, output_len: int,
                prompt_us: float) -> float:
    """Output tok/s of the paced engine alone under a closed loop of ``concurrency`` requests: each
    request's tokens cost a step of ``concurrency`` rows each (the device's time, or the host's
    where that is longer), its prompt ``prompt_us`` a token."""
    step_s = max(step_ms(steps, concurrency), host_ms) / 1e3
    per_request = output_len * step_s / concurrency + input_len * prompt_us / 1e6
    return 1.0 / per_request * output_len


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args: argparse.Namespace, host_ms: float, switch_ms: float) -> list[dict]:
    """Start the server at one engine host time and switch interval, run the client at each level, return its rows,
    each with the server process's CPU seconds over the level (its warm-up requests included)."""
    url = f"http://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, __file__, "--serve", "--port", url.rpartition(":")[2], "--switch-interval-ms",
               str(switch_ms), "--step-ms", args.step_ms, "--host-ms", str(host_ms), "--prompt-us", str(args.prompt_us),
               "--max-num-seqs", str(args.max_num_seqs)]
    levels = []
    with ServerProcess(command, url, env=env, startup_timeout_s=60) as server:
        for concurrency in args.concurrency.split(","):
            with tempfile.TemporaryDirectory() as scratch:
                out = Path(scratch) / "serve.json"
                client = [sys.executable, "-m", "qat4.cli", "bench", "serve", "--url", url, "--concurrency", concurrency,
                          "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--json", str(out)]
                before = cpu_seconds(server.process.pid)
                done = subprocess.run(client, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise SystemExit(f"qat4 bench serve failed: {done.stderr.strip()[-2000:]}")
                level = json.loads(out.read_text())["levels"][0]
                levels.append(dict(level, server_cpu_s=cpu_seconds(server.process.pid) - before))
    return levels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="16,64", help="client levels (default: %(default)s)")
    p.add_argument("--step-ms", default="1:1.8,4:2.2,16:2.55,64:4.69",
                   help="device ms per decode step by rows, ROWS:MS,... (default: the H200's engine figures)")
    p.add_argument("--host-ms", default="0",
                   help="ms of Python the engine runs per step, holding the GIL, to compare (default: %(default)s, "
                        "the server's cost alone)")
    p.add_argument("--prompt-us", type=float, default=7.7, help="device µs per prompt token (default: %(default)s)")
    p.add_argument("--switch-interval-ms", default=f"{SWITCH_INTERVAL_S * 1e3:g}",
                   help="Python switch intervals to compare (default: %(default)s, qat4 serve's; Python's own is 5)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences the engine runs at once (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        args.host_ms, args.switch_interval_ms = float(args.host_ms), float(args.switch_interval_ms)
        serve(args)
        return 0
    steps = parse_steps(args.step_ms)
    rows = []
    print(f"{'host ms':>7} {'switch ms':>9} {'clients':>7} {'engine pace tok/s':>17} {'served tok/s':>12} {'share':>6} "
          f"{'TPOT p50 ms':>11} {'server CPU µs/token':>19}")
    settings = [(float(h), float(s)) for h in args.host_ms.split(",") for s in args.switch_interval_ms.split(",")]
    for host_ms, switch_ms in settings:
        for level in measure(args, host_ms, switch_ms):
            c = level["concurrency"]
            pace = engine_pace(steps, host_ms, c, args.input_len, args.output_len, args.prompt_us)
            served = level["output_tok_s"]
            tokens = level["output_tokens"]
            row = {"host_ms": host_ms, "switch_interval_ms": switch_ms, "concurrency": c, "engine_pace_tok_s": round(pace),
                   "served_tok_s": round(served), "share": round(served / pace, 3), "tpot_p50_ms": level["tpot_ms"]["p50"],
                   "server_cpu_us_per_token": round(level["server_cpu_s"] / tokens * 1e6, 1)}
            rows.append(row)
            print(f"{host_ms:7g} {switch_ms:9g} {c:7d} {pace:17,.0f} {served:12,.0f} {served / pace:6.1%} {row['tpot_p50_ms']:11.2f} "
                  f"{row['server_cpu_us_per_token']:19.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

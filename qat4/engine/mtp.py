"""The MTP drafter in the engine: Gemma 4's assistant drafting for a batch of decoding sequences.

A speculating step reads the step before it back first (:mod:`qat4.engine.speculation`), so when
:meth:`MTPDrafter.propose_all` runs, every decoding sequence's newest token is on the host, its
K/V up to the position before it is in the pool, and the model runner holds the target's hidden
state that picked it (``ModelRunner.last_hidden``, kept when the runner is built with
``keep_hidden``). The drafter runs k steps of :class:`qat4.assistant.Gemma4Assistant` for all of
them at once, on CUDA as a graph captured per padded batch size and k (at load, over the pool's
scratch row), and reads the drafts back: one more wait for the device per speculating step, of the
drafter's own time. What k drafts cost (:meth:`MTPDrafter.cost`, measured at load like the
target's step costs) is weighed by the speculator beside the verification they save.
"""

from __future__ import annotations

import torch

from qat4.assistant import Gemma4Assistant
from qat4.engine.graphs import capture_graph
from qat4.engine.model_runner import ModelRunner
from qat4.engine.sequence import Sequence
from qat4.engine.speculation import COST_DEPTH
from qat4.engine.tuning import best_seconds, replay_us

class MTPDrafter:
    """Drafts of ``assistant`` for the decoding sequences of ``runner``'s engine (module docstring).

    ``sizes``: the padded batch sizes a speculating step may have; ``max_tokens``: the most drafts
    per step. Graphs and costs for every (size, k) are made by :meth:`prepare`.
    """

    def __init__(self, assistant: Gemma4Assistant, runner: ModelRunner, sizes: list[int], max_tokens: int):
        if runner.last_hidden is None:
            raise ValueError("the MTP drafter needs a model runner built with keep_hidden")
        self.assistant, self.runner, self.sizes, self.max_tokens = assistant, runner, sizes, max_tokens
        dev = runner.device
        rows = max(sizes)
        self._meta = torch.zeros(3, rows, dtype=torch.int64, device=dev)  # newest ids, their positions, slots
        self._drafts = torch.zeros(rows, max_tokens, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        self.costs: dict[tuple[int, int], float] = {}

    # ---- the drafts of a batch -----------------------------------------------------------------

    def _draft(self, b: int, k: int) -> None:
        """k drafts for the b sequences in ``_meta[:, :b]`` into ``_drafts[:b, :k]`` (what a graph captures)."""
        ids, positions, slots = self._meta[:, :b]
        runner = self.runner
        drafts = self.assistant.draft(ids, runner.last_hidden[slots], positions, runner.pool, slots, k, runner.max_ctx)
        self._drafts[:b, :k].copy_(drafts)

    def _run(self, b: int, k: int) -> None:
        if self.runner.use_graph:
            self.graphs[(b, k)].replay()
        else:
            self._draft(b, k)

    def _place_scratch(self, b: int, position: int) -> None:
        """Every row of a b-batch on the pool's scratch row, drafting at ``position``."""
        self._meta[:, :b] = torch.tensor([[0], [position], [self.runner.pool.scratch_row]], device=self.runner.device)

    def propose_all(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """k drafts for each sequence, from its newest token (read back: none pending)."""
        n = len(seqs)
        b = self.runner.padded(n)
        pad = b - n
        rows = [[s.newest_known for s in seqs] + [0] * pad, [s.length - 1 for s in seqs] + [1] * pad,
                [s.slot for s in seqs] + [self.runner.pool.scratch_row] * pad]
        self.runner.pool.uploads.send(rows, self._meta)
        self._run(b, k)
        return self._drafts[:n, :k].tolist()

    def cost(self, b: int, k: int) -> float:
        """Seconds the drafts of a padded batch of b sequences take, k of them each (0 for k = 0)."""
        return self.costs[(b, k)] if k else 0.0

    # ---- at load -------------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self) -> None:
        """Capture the graph of every (size, k) on the scratch row (CUDA) and measure the costs."""
        depth = max(1, min(COST_DEPTH, self.runner.max_ctx - 1))
        if not self.runner.use_graph:
            self._measure_eager(depth)
            return
        for b in self.sizes:
            for k in range(1, self.max_tokens + 1):
                self._capture(b, k)
        for (b, k), graph in self.graphs.items():
            self._place_scratch(b, depth)
            self.costs[(b, k)] = replay_us(graph, 3) * 1e-6

    def _capture(self, b: int, k: int) -> None:
        self._place_scratch(b, 1)
        graph = capture_graph(lambda: self._draft(b, k), self.runner.device, self._graph_pool)
        self._graph_pool = graph.pool()
        self.graphs[(b, k)] = graph

    def _measure_eager(self, depth: int) -> None:
        """Without graphs: the best of three one-token drafts at the smallest and largest size,
        a straight line between them over b, k times that for k drafts."""
        def one(b: int) -> float:
            self._place_scratch(b, depth)
            return best_seconds(lambda: self._draft(b, 1), self.runner.device)

        lo, hi = min(self.sizes), max(self.sizes)
        at_lo = one(lo)
        at_hi = one(hi) if hi > lo else at_lo
        for b in self.sizes:
            per_draft = max(at_lo, at_lo + (at_hi - at_lo) * (b - lo) / max(1, hi - lo))
            for k in range(1, self.max_tokens + 1):
                self.costs[(b, k)] = k * per_draft

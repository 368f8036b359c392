"""tools/placement_spread.py's weight move on the CPU: every matrix of the tiny engine gets new
memory (own allocations, or slices of one buffer) and keeps its values, and decoding is unchanged."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from qat4.checkpoint.synth import synthetic_model
from qat4.config import TINY
from qat4.engine import Engine

TOOL = Path(__file__).resolve().parent.parent / "tools" / "placement_spread.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("placement_spread", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arena", [False, True])
def test_move_gives_every_matrix_new_memory_and_keeps_its_values(arena):
    tool = load_tool()
    engine = Engine.from_packed(synthetic_model(TINY, seed=0), "cpu", max_ctx=64)
    matrices = tool.packed_matrices(engine.model)
    assert len(matrices) == 3 + 6 * TINY.num_hidden_layers  # embeddings (tied output), per-layer table and projection
    before = [(m.packed.clone(), m.scales.clone(), m.packed.data_ptr(), m.scales.data_ptr()) for m in matrices]
    ids, pos = torch.tensor([5]), torch.tensor([0])
    with torch.no_grad():
        h_before = engine.model.decode(ids, pos, engine.cache)
        tool.move(matrices, random.Random(1), arena)
        engine.cache.reset()
        h_after = engine.model.decode(ids, pos, engine.cache)
    for m, (packed, scales, p_ptr, s_ptr) in zip(matrices, before):
        assert torch.equal(m.packed, packed) and torch.equal(m.scales, scales)
        assert m.packed.data_ptr() != p_ptr and m.scales.data_ptr() != s_ptr
    assert torch.equal(h_before, h_after)
    if arena:  # one buffer, every slice starting a multiple of ALIGN bytes into it
        base = matrices[0].packed.untyped_storage().data_ptr()
        for m in matrices:
            for t in (m.packed, m.scales):
                assert t.untyped_storage().data_ptr() == base and (t.data_ptr() - base) % tool.ALIGN == 0

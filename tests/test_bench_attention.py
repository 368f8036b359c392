"""tools/bench_attention.py: its cases lay keys out as the engine's pool does, and it runs end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from kernel_harness import KERNEL_DEVICE, kernel_test, run_interpreted

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))

import bench_attention  # noqa: E402


def test_a_case_scatters_each_sequences_pages_and_its_copies_hold_other_keys():
    torch.manual_seed(0)
    case = bench_attention.Case(3, 40, 2, 32, torch.float32, "cpu", max_keys=40, block_size=8, copies=2)
    assert case.seqs.positions.tolist() == [38, 39] * 3 and case.seqs.cu_q.tolist() == [0, 2, 4, 6]
    for copy, table in enumerate(case.tables):
        assert sorted(table.flatten().tolist()) == list(range(copy * 15, (copy + 1) * 15))  # 3 x 5 blocks each
    got = case.run(1, window=16, reference=True)
    for s in range(3):  # the same attention over the sequence's keys laid end to end
        rows = (case.tables[1][s].long()[:, None] * 8 + torch.arange(8)).flatten()[:40]
        k, v = case.k[rows], case.v[rows]
        for t, p in enumerate((38, 39)):
            seen = slice(p - 15, p + 1)
            probs = torch.softmax(case.q[2 * s + t] @ k[seen].T, dim=-1)
            torch.testing.assert_close(got[2 * s + t], probs @ v[seen])


def test_the_sweep_scales_the_key_splits_by_the_batch():
    one = bench_attention.decode_configs("full", 512, 1, True, [])
    sixteen = bench_attention.decode_configs("full", 512, 16, True, [])
    assert one[0] == (None, None) and [s for s, t in one if s] == [33, 66, 132, 256, 384, 512]
    assert [s for s, t in sixteen if s] == [2, 4, 8, 16, 24, 32]
    assert len([t for s, t in one if t]) == len(bench_attention.DECODE_TILES[512])
    assert bench_attention.decode_configs("sliding", 256, 4, False, []) == [(None, None)]


def test_asked_splits_are_timed_beside_the_default_with_or_without_the_sweep():
    assert bench_attention.decode_configs("sliding", 256, 64, False, [2, 1]) == [(None, None), (1, None), (2, None)]
    swept = bench_attention.decode_configs("full", 512, 64, True, [2, 3])
    assert [s for s, t in swept if s] == [1, 2, 3, 4, 6, 8]


def test_kernel_tests_interpreted(request):
    run_interpreted(__file__, request)


@kernel_test
def test_kernel_decode_and_prefill_cases_match_the_reference(capsys):
    assert bench_attention.main(["--device", KERNEL_DEVICE, "--dtype", "fp32", "--batch", "2", "--lengths", "48",
                                 "--chunk", "17", "--max-ctx", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    names = [line.split("  ")[0] for line in lines]
    assert [n.split()[0:2] for n in names] == [["decode", "sliding"], ["decode", "full"], ["prefill", "D=256"],
                                               ["prefill", "D=512"]]
    assert all(float(line.rsplit("err ", 1)[1]) < 1e-4 for line in lines)
    assert "TFLOP/s" in lines[-1] and "TFLOP/s" not in lines[0]


@kernel_test
def test_kernel_prefill_of_several_prompts_in_one_call_matches_the_reference(capsys):
    assert bench_attention.main(["--device", KERNEL_DEVICE, "--dtype", "fp32", "--only", "prefill", "--prompts", "3",
                                 "--chunk", "17", "--lengths", "0,24", "--max-ctx", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[:5] for line in lines] == [["prefill", "D=256", "P=3", "T=17", "keys=17"],
                                                    ["prefill", "D=512", "P=3", "T=17", "keys=24"]]
    assert all(float(line.rsplit("err ", 1)[1]) < 1e-4 for line in lines)

"""tools/serve_overhead.py: the server app over a paced engine, measured by `qat4 bench serve`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))

import serve_overhead  # noqa: E402


def test_step_times_interpolate_between_the_given_rows_and_scale_past_the_last():
    steps = serve_overhead.parse_steps("16:2.5,1:1.5,64:4.5")
    assert list(steps) == [1, 16, 64]
    assert serve_overhead.step_ms(steps, 1) == 1.5
    assert serve_overhead.step_ms(steps, 40) == 3.5
    assert serve_overhead.step_ms(steps, 128) == 9.0


def test_the_server_over_a_paced_engine_serves_at_most_the_engine_pace(tmp_path):
    out = tmp_path / "overhead.json"
    assert serve_overhead.main(["--concurrency", "1,4", "--step-ms", "1:3,4:3", "--input-len", "32",
                                "--output-len", "12", "--switch-interval-ms", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for row in rows:
        # the device's pace bounds what the server can stream; a paced engine that ran ahead would exceed it
        assert 0 < row["served_tok_s"] <= 1.05 * row["engine_pace_tok_s"]
        assert row["server_cpu_us_per_token"] > 0
    # four sequences share each paced step: 4x one client's at best, 1.96x on a 2-core machine busy
    # with other tests; a server that ran one request at a time would stay at 1x
    assert rows[1]["served_tok_s"] > 1.3 * rows[0]["served_tok_s"]

"""tools/bench_grammar.py --engine end to end on the tiny synthetic model on the CPU: the decode
step with every row constrained by a JSON schema against the same rows unconstrained."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_grammar.py"


def test_engine_mode_reports_both_cases_at_each_batch(tmp_path):
    out = tmp_path / "grammar.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--engine", "--model", "synthetic:tiny", "--device", "cpu", "--rows", "1", "2",
         "--prompt", "4", "--new", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("grammar overhead at batch")]
    assert [line.split()[4].rstrip(":") for line in summaries] == ["1", "2"]
    report = json.loads(out.read_text())
    assert (report["model"], report["device"], report["new_tokens"]) == ("synthetic:tiny", "cpu", 3)
    assert [r["rows"] for r in report["results"]] == [1, 2]
    for result in report["results"]:
        assert isinstance(result["overhead_pct"], float)
        for case in ("constrained", "unconstrained"):
            numbers = result[case]
            # 3 tokens a reply: the first comes with the prompt's step, the other two from decode steps
            assert numbers["decode_steps"] == 2 and numbers["captures"] == 0
            assert numbers["median_ms"] > 0 and numbers["tok_s"] > 0
            assert 1 <= numbers["reply_tokens"] <= 3
        assert result["unconstrained"]["reply_tokens"] == 3

"""tools/spec_step.py: a speculating step's period split into the device's wait and the host's phases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))

import spec_step  # noqa: E402


def test_every_speculating_step_is_split_into_the_devices_wait_and_the_hosts_phases(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert spec_step.main(["--model", "synthetic:tiny", "--device", "cpu", "--new", "12", "--context", "16",
                           "--acceptance", "0,1", "--repeat", "1", "--json", str(out), "--profile", "5"]) == 0
    profile = capsys.readouterr().out.split("under cProfile, ")[1].splitlines()
    # the last acceptance, a = 1: 12 tokens, 4 a step, so 3 verifying steps and the one reading the last
    assert profile[0].startswith("4 speculating steps") and len(profile) == 6
    result = json.loads(out.read_text())
    runs = {(r["acceptance"], r["k"]): r for r in result["runs"]}
    assert set(runs) == {(0.0, 3), (0.0, None), (1.0, 3), (1.0, None)}
    never, always = runs[(0.0, 3)], runs[(1.0, 3)]
    assert never["kept"] == 0 and never["verified"] >= 10  # a token a step, every step verifying
    assert always["kept"] == 3 * always["verified"] and always["verified"] <= 4  # 12 tokens, 4 a step
    for run in runs.values():
        # timed: the steps that launch drafts and the one that reads the last of them, never plain steps
        verified = run["verified"]
        assert verified + (verified > 0) <= run["speculating_steps"] <= 2 * verified
    for run in (never, always):
        phases = {name: mean for name, (mean, _) in run["phases_us"].items()}
        assert list(phases) == spec_step.PHASES  # every phase timed, in order
        assert (phases["schedule"] + phases["propose"] + phases["launch"] + phases["reserve"] + phases["tolist"]
                <= phases["host"])
        assert phases["launch"] + phases["reserve"] >= phases["flush"] + phases["run_decode"] + phases["send back"]
        assert phases["reserve"] > 0
        assert phases["run_decode"] >= phases["replay"] > 0


def test_the_timing_wrappers_go_once_the_timed_block_ends():
    from checkpoint_fixtures import SMALL
    from qat4.checkpoint.synth import synthetic_model
    from qat4.engine.model_runner import StepTokens

    engine = spec_step.Engine.from_packed(synthetic_model(SMALL, seed=0), "cpu", max_ctx=64, speculative="ngram",
                                          spec_tokens=2)
    wrapped = [(engine, "step"), (engine, "_speculative_step"), (engine.scheduler, "schedule"),
               (engine.speculator, "propose"), (engine, "_launch"), (engine.scheduler, "reserve"),
               (engine.runner.pool, "flush"), (engine.runner, "run_decode"),
               (engine.runner, "replay"), (engine.runner, "_send")]
    read = StepTokens.read
    with spec_step.timed_phases(engine, {}):
        assert StepTokens.read is not read
        assert all(not hasattr(getattr(owner, name), "__func__") for owner, name in wrapped)  # timers, not methods
    assert StepTokens.read is read
    for owner, name in wrapped:
        assert name not in vars(owner) and getattr(owner, name).__func__ is getattr(type(owner), name), name

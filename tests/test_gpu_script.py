"""The GPU check's script (benchmarks/gpu.py) rehearsed on CPU at toy sizes, every part, so that
a GPU session spends its time measuring, not debugging the script."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared (the real data the check reads)")
def test_the_gpu_check_rehearses_every_part(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "rehearse", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    report = json.loads((out / "gpu.json").read_text())
    errors = {p: rows["error"][-1500:] for p, rows in report["parts"].items() if isinstance(rows, dict)}
    assert proc.returncode == 0 and not errors, (errors, proc.stdout[-2000:], proc.stderr[-2000:])
    parts = report["parts"]
    assert set(parts) == {"parity", "speed", "trl", "real"} and report["rehearse"]
    # parity: blockwise and pallas (interpret mode) measured against the dense reference; cudnn not on CPU
    measured = {(r["attention"], r["dtype"]): r for r in parts["parity"] if "error" not in r}
    assert measured[("blockwise", "float32")]["out_max_abs"] < 1e-5
    assert measured[("pallas", "float32")]["grad_max_rel"] < 1e-5
    assert any(r["attention"] == "cudnn" and "error" in r for r in parts["parity"])
    # speed: pack against bucket, with a ratio
    (summary,) = [r for r in parts["speed"] if r.get("summary") == "pack / bucket"]
    assert summary["ratio"] > 0 and {r.get("packing") for r in parts["speed"]} >= {"pack", "bucket"}
    # trl: both trainers measured, the ratios computed
    trainers = [r for r in parts["trl"] if "trainer" in r]
    assert {r["trainer"] for r in trainers} == {"TRL RewardTrainer", "rmflow"}
    assert all(r["tokens_per_s"] > 0 and r["peak_mib"] > 0 for r in trainers)
    # real: both trained, evaluated on the held-out split and LLMBar, beside the length baseline; the export agrees
    rows = {r.get("trainer") or r.get("summary"): r for r in parts["real"]}
    for name in ("TRL RewardTrainer", "rmflow"):
        assert 0 <= rows[name]["eval_accuracy"] <= 1 and 0 <= rows[name]["eval_sets"]["llmbar"] <= 1
    assert "llmbar" in rows["length-only baseline"]["eval_sets"]
    assert rows["export in transformers"]["max_abs_diff"] < rows["export in transformers"]["limit"]
    md = (out / "gpu.md").read_text()
    assert "## parity" in md and "## real" in md and "| rmflow |" in md

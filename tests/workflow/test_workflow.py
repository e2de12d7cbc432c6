"""The chained workflow: stages skip when done with the same config, resume where they
stopped, rerun from a changed stage onwards; and the embedded demo runs end to end."""

import gzip
import json
import pathlib
import subprocess
import sys

import pytest
import yaml

from rmflow.workflow import Workflow, run
from tests.conftest import xla_defaults_env

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"


def small(tmp_path, **train):
    lines = gzip.open(DEMO / "hh_rlhf_helpful_sample.jsonl.gz", "rt").read().splitlines()[:80]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return {
        "output": str(tmp_path / "out"),
        "preprocess": {"inputs": [str(tmp_path / "pairs.jsonl")], "tokenizer": str(DEMO / "tokenizer"),
                       "max_length": 128, "eval_fraction": 0.25, "max_bad_fraction": 1.0},
        "train": {"model": "micro", "max_steps": 3, "batch_size": 4, "logging": {"steps": 1}, **train},
        "eval": {"split": "eval"},
    }


@pytest.mark.slow
def test_skip_resume_and_rerun_from_a_changed_stage(tmp_path):
    spec = small(tmp_path)
    wf = Workflow.from_dict(spec)
    assert run(wf, log=lambda m: None) == {"preprocess": "ran", "train": "ran", "eval": "ran", "export": "off"}
    assert run(wf, log=lambda m: None) == {"preprocess": "skipped", "train": "skipped", "eval": "skipped",
                                           "export": "off"}
    out = tmp_path / "out"
    # Interrupted after train: eval never finished.
    (out / "eval.done.json").unlink()
    assert run(wf, log=lambda m: None) == {"preprocess": "skipped", "train": "skipped", "eval": "ran",
                                           "export": "off"}
    # Interrupted during train (checkpoints kept, no done marker): it resumes, not restarts.
    (out / "train.done.json").unlink()
    logs = []
    assert run(wf, log=logs.append)["train"] == "ran"
    assert any("resuming" in m for m in logs)
    # A changed train config reruns train and eval, not preprocess; the replaced run is kept, and
    # the log says what changed and where the old run went.
    spec["train"]["max_steps"] = 4
    changed = Workflow.from_dict(spec)
    logs = []
    assert run(changed, log=logs.append) == {"preprocess": "skipped", "train": "ran", "eval": "ran",
                                             "export": "off"}
    history = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4]  # a fresh run for the new config
    (note,) = [m for m in logs if "train config changed" in m]
    assert "max_steps: 3 -> 4" in note and "previous run (step 3)" in note
    (kept,) = (out / "previous").iterdir()
    assert kept.name.startswith("run-") and (kept / "checkpoints").is_dir()


@pytest.mark.slow
def test_an_input_changed_in_place_reruns_preprocess(tmp_path):
    """Same path, new content: the stage hash covers each input's size and modification time."""
    spec = small(tmp_path)
    wf = Workflow.from_dict(spec)
    logs = []
    assert run(wf, log=logs.append)["preprocess"] == "ran"
    assert any("80 records read" in m for m in logs)  # the preprocess summary is shown
    assert run(wf, log=lambda m: None)["preprocess"] == "skipped"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(pairs.read_text().splitlines(keepends=True)[:60]))
    assert run(wf, log=lambda m: None) == {"preprocess": "ran", "train": "ran", "eval": "ran", "export": "off"}
    manifest = json.loads((tmp_path / "out" / "shards" / "manifest.json").read_text())
    assert sum(s["records"] for s in manifest["splits"].values()) <= 60
    # A held-out raw file as the eval's data: evaluated there, and rerun when that file changes.
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(pairs.read_text().splitlines(keepends=True)[:10]))
    spec["eval"] = {"data": "heldout.jsonl", "format": "hh-rlhf"}
    wf = Workflow.from_dict(spec, base_dir=str(tmp_path))
    assert run(wf, log=lambda m: None)["eval"] == "ran"
    written = json.loads((tmp_path / "out" / "eval" / "eval.json").read_text())
    assert written["config"]["data"] == [str(heldout)] and written["metrics"]["input"]["counts"]["records_read"] == 10
    assert run(wf, log=lambda m: None)["eval"] == "skipped"
    heldout.write_text("".join(pairs.read_text().splitlines(keepends=True)[:12]))
    assert run(wf, log=lambda m: None) == {"preprocess": "skipped", "train": "skipped", "eval": "ran", "export": "off"}


# Make torch unfindable, as if not installed (transformers imports it whenever it can).
HIDE_TORCH = """import sys
class _Hide:
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None
    def __getattr__(self, attr):
        return getattr(self.inner, attr)
sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
"""


@pytest.mark.slow
def test_the_embedded_demo_runs_without_torch_and_shows_its_summary(tmp_path):
    """`rmflow run` on the demo, in a fresh process: it completes, prints the preprocess summary
    (nothing dropped silently) and keeps nearly every pair at its max_length; PyTorch is hidden
    from the process, as in the demo's install (tests/project/test_packaging.py checks that install has
    neither PyTorch nor the Google Cloud extras), and with XLA's default optimisation, as `make
    demo` runs (tests/conftest.py: xla_defaults_env)."""
    spec = yaml.safe_load((DEMO / "workflow.yaml").read_text())
    spec["output"] = str(tmp_path / "demo")
    spec["preprocess"]["inputs"] = [str(DEMO / p) for p in spec["preprocess"]["inputs"]]
    spec["preprocess"]["tokenizer"] = str(DEMO / spec["preprocess"]["tokenizer"])
    (tmp_path / "workflow.yaml").write_text(yaml.safe_dump(spec))
    code = HIDE_TORCH + (
        "import json\nfrom rmflow.cli import app\n"
        "try:\n    app(['run', sys.argv[1]], standalone_mode=False)\n"
        "finally:\n    print('MODULES', json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
        "    import os; print('XLA_FLAGS', repr(os.environ.get('XLA_FLAGS', '')))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "workflow.yaml")], capture_output=True,
                          text=True, timeout=900, env={**xla_defaults_env(), "COLUMNS": "200"})  # as `make demo`
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "MODULES []" in out
    assert "XLA_FLAGS" in out and "optimization_level" not in out  # XLA's own optimisation, as users run it
    assert "500 records read, 477 pairs written" in out  # the summary; max_length 512 keeps 95% of pairs
    assert "not written: 22 longer than max_length 512 (4.4%)" in out and "not written: 1 errors" in out
    report = json.loads((tmp_path / "demo" / "eval" / "eval.json").read_text())["metrics"]
    assert report["pairs"] > 20 and (tmp_path / "demo" / "eval" / "report.md").exists()
    assert (tmp_path / "demo" / "export" / "model.safetensors").exists()
    md = (tmp_path / "demo" / "eval" / "report.md").read_text()
    assert "checkpoint step 40" in md and "95% confidence interval" in md and "split eval" in md

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    written = [p for p in (tmp_path / "demo").rglob("*") if p.suffix in (".json", ".jsonl")]
    assert len(written) > 10
    for path in written:  # every JSON text the workflow wrote, read as strict readers do: no NaN, no Infinity
        text = path.read_text()
        for doc in (text.splitlines() if path.suffix == ".jsonl" else [text]):
            if doc.strip():
                json.loads(doc, parse_constant=refuse)


def test_the_export_stage_takes_the_options_of_rmflow_export(tmp_path):
    """``export: true`` exports the newest checkpoint; a mapping of export options (every
    ``rmflow export`` option but the run and output, the workflow's) is checked like the other
    stages' keys, and a changed export option reruns the export alone."""
    from rmflow.schemas.config import ConfigError

    spec = small(tmp_path)
    for bad, said in (({"bogus": 1}, r"unknown export keys \['bogus'\]"), ("no", "true or false"),
                      ({"step": "latest"}, "step 'latest'"), ({"max_shard_gb": 0}, "max_shard_gb 0")):
        with pytest.raises(ConfigError, match=said):
            Workflow.from_dict({**spec, "export": bad})
    assert run(Workflow.from_dict({**spec, "export": True}), log=lambda m: None)["export"] == "ran"
    info = json.loads((tmp_path / "out" / "export" / "rmflow_export.json").read_text())
    assert info["step"] == 3 and info["format"] == "checkpoint"
    status = run(Workflow.from_dict({**spec, "export": {"step": 3, "max_shard_gb": 0.001}}), log=lambda m: None)
    assert status == {"preprocess": "skipped", "train": "skipped", "eval": "skipped", "export": "ran"}
    assert len(list((tmp_path / "out" / "export").glob("model-*.safetensors"))) > 1  # 1 MiB shards
    # an eval that normalizes writes the run's reward statistics, which the export carries: turning it
    # on reruns the eval and then the export, whose config.json then holds them (OpenRLHF's mean, std)
    status = run(Workflow.from_dict({**spec, "eval": {"split": "eval", "normalize": True},
                                     "export": {"step": 3, "max_shard_gb": 0.001}}), log=lambda m: None)
    assert status == {"preprocess": "skipped", "train": "skipped", "eval": "ran", "export": "ran"}
    stats = json.loads((tmp_path / "out" / "run" / "reward_normalization.json").read_text())
    config = json.loads((tmp_path / "out" / "export" / "config.json").read_text())
    assert (config["mean"], config["std"]) == (stats["mean"], stats["std"])


def test_an_eval_that_names_no_data_evaluates_the_workflow_s_shards(tmp_path):
    spec = small(tmp_path)
    for ev in ({"split": "eval"}, {"data": []}, {"data": ""}):
        wf = Workflow.from_dict({**spec, "eval": ev})
        assert wf.eval.data == (wf.preprocess.output,) and wf.eval.model == wf.train.output, ev

"""No silent wrong results in what the commands write: values no model should see refused,
output folders locked and written whole, a stop never lost nor followed by a publication."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from rmflow.rendering.formats import BadRecord, normalize
from rmflow.schemas.config import ConfigError, EvalConfig
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.outputs import OutputBusy, output_lock, staged_output
from rmflow.schemas.train_config import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = ROOT / "rmflow" / "demo"

# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("overrides, message", [
    ({"optimizer.adam_b1": 1.5}, "optimizer.adam_b1 1.5: must be in"),
    ({"optimizer.adam_b2": -0.1}, "adam_b2"),
    ({"optimizer.adam_eps": 0.0}, "adam_eps"),
    ({"optimizer.learning_rate": "1e-5"}, "optimizer.learning_rate '1e-5': must be a finite number"),
    ({"optimizer.learning_rate": float("nan")}, "learning_rate nan"),
    ({"max_steps": 10, "optimizer.warmup_steps": 10}, "warmup_steps 10 >= max_steps 10"),
    ({"model.gradient_checkpointing": "no"}, "model.gradient_checkpointing 'no': must be true or false"),
    ({"batch_size": True}, "batch_size True: must be an integer"),
])
def test_values_no_model_should_see_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict({"data": "d", "model": "micro", "output": "o", **overrides})


def test_margins_beyond_reward_units_are_refused():
    for margin in (1.2e29, 1e39, -5000.0):
        with pytest.raises(BadRecord, match="beyond") as e:
            normalize({"prompt": "p", "chosen": "c", "rejected": "r", "margin": margin}, "text", source="s", line=1)
        assert e.value.code == "bad_value"


def test_workflow_values_are_checked_where_defined(tmp_path):
    from rmflow.workflow import Workflow

    base = {"output": str(tmp_path / "wf"), "train": {"model": "micro"},
            "preprocess": {"inputs": ["x.jsonl"], "tokenizer": "t"}}
    with pytest.raises(ConfigError, match="'export' 'no': must be true or false"):
        Workflow.from_dict({**base, "export": "no"})
    with pytest.raises(ConfigError, match="mode 'best-of-4'"):
        Workflow.from_dict({**base, "eval": {"mode": "best-of-4"}})
    wf = Workflow.from_dict({**base, "eval": {"mode": "rewardbench-v1", "data": "heldout.jsonl", "step": 4,
                                              "format": "text"}}, base_dir=str(tmp_path))
    assert wf.eval.data == (str(tmp_path / "heldout.jsonl"),) and wf.eval.mode == "rewardbench-v1"
    with pytest.raises(ConfigError, match="split 'dev'"):
        EvalConfig(model="m", data=("d",), output="o", split="dev")
    # a value of the wrong type is named before (and with) what is missing
    with pytest.raises(ConfigError, match=r"'preprocess' must be a mapping of option: value, not a list \[1, 2\]; "
                                          r"it needs 'train'"):
        Workflow.from_dict({"output": "o", "preprocess": [1, 2]})


def test_workflow_lists_only_real_config_changes(tmp_path):
    from rmflow.workflow import changed_keys

    cfg = TrainConfig(data="d", model="micro", output=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(cfg.to_json())  # tuples stored as lists
    assert changed_keys(str(tmp_path / "run"), cfg) == []
    assert changed_keys(str(tmp_path / "run"), TrainConfig.from_dict({**cfg.to_dict(), "seed": 3})) == ["seed: 0 -> 3"]


# --------------------------------------------------------------------------- output folders

HOLD = """
import sys, time
from rmflow.schemas.outputs import output_lock
with output_lock(sys.argv[1], "rmflow train"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(output: pathlib.Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_ones_lock_recovered(tmp_path):
    out = tmp_path / "run"
    proc = _holder(out)
    try:
        with pytest.raises(OutputBusy, match=rf"is being written by `rmflow train` \(process {proc.pid} on "):
            with output_lock(str(out), "rmflow eval"):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with pytest.warns(RmflowWarning, match=f"took over the lock of `rmflow train` .process {proc.pid}"):
        with output_lock(str(out), "rmflow eval"):
            with output_lock(str(out), "rmflow eval"):  # re-entrant within one process (a workflow's stages)
                pass
    with output_lock(str(out), "rmflow eval"):  # released cleanly: nothing to recover, no warning
        pass


def test_every_command_that_writes_a_folder_takes_its_lock(tmp_path):
    """The lock is taken before any work, so a held one refuses each command in one line."""
    from typer.testing import CliRunner

    from rmflow.cli import app

    out = tmp_path / "busy"
    proc = _holder(out)
    try:
        wf = tmp_path / "wf.yaml"
        wf.write_text(json.dumps({"output": str(out), "train": {"model": "micro"},
                                  "preprocess": {"inputs": [str(DEMO / "hh_rlhf_helpful_sample.jsonl.gz")],
                                                 "tokenizer": str(DEMO / "tokenizer")}}))
        commands = {
            "preprocess": ["preprocess", "-i", DEMO / "hh_rlhf_helpful_sample.jsonl.gz", "--tokenizer",
                           DEMO / "tokenizer", "-o", out],
            "train": ["train", "--data", tmp_path / "nothing", "--model", "micro", "-o", out],
            "eval": ["eval", "--model", tmp_path / "nothing", "--data", tmp_path / "nothing", "-o", out],
            "export": ["export", tmp_path / "nothing", "-o", out],
            "run": ["run", wf],
        }
        for verb, args in commands.items():
            r = CliRunner().invoke(app, [str(a) for a in args])
            assert r.exit_code == 1 and "Traceback" not in r.output, (verb, r.output)
            assert f"is being written by `rmflow train` (process {proc.pid}" in " ".join(r.output.split()), verb
    finally:
        proc.kill()
        proc.wait()


def test_a_staged_output_is_swapped_in_whole_or_not_at_all(tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "eval.json").write_text("old")
    (out / "report.md").write_text("old")
    (out / "input_errors.jsonl").write_text("stale")
    with pytest.raises(RuntimeError):
        with staged_output(str(out), "eval folder") as staging:
            pathlib.Path(staging, "eval.json").write_text("half")
            raise RuntimeError("interrupted")
    assert sorted(os.listdir(out)) == ["eval.json", "input_errors.jsonl", "report.md"]
    assert (out / "eval.json").read_text() == "old"
    assert not list(tmp_path.glob("eval.tmp-*"))
    old = os.umask(0o022)
    try:
        with staged_output(str(out), "eval folder") as staging:
            pathlib.Path(staging, "eval.json").write_text("new")
    finally:
        os.umask(old)
    assert os.listdir(out) == ["eval.json"] and (out / "eval.json").read_text() == "new"
    assert (out.stat().st_mode & 0o777) == 0o755  # as the umask says (tempfile.mkdtemp made it 0700)


def test_a_full_disk_during_export_is_an_oserror(tmp_path, monkeypatch):
    import safetensors.numpy
    from rmflow.trainer.export import save_safetensors
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(OSError, match="No space left on device") as e:
        save_safetensors({"w": np.zeros(4, np.float32)}, str(tmp_path))
    assert e.value.filename == str(tmp_path / "model.safetensors")


def test_messages_say_what_is_wrong():
    from rmflow.rendering.formats import solution_to_score

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for given in (conv, {"messages": conv}):
        with pytest.raises(BadRecord, match="scores the steps of a solution.*this is a conversation"):
            solution_to_score(given)
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(BadRecord, match="content part 1 is 'image_url'"):
        normalize({"prompt": [{"role": "user", "content": image}], "chosen": "a", "rejected": "b"},
                  "conversational", source="s", line=1)


def test_a_sigterm_arriving_in_a_finalizer_is_not_lost():
    """Python ignores an exception raised in ``__del__``: a SIGTERM whose KeyboardInterrupt is raised
    there (a regex object collected mid-job) must still keep preprocess from publishing."""
    import time

    class Collected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(200_000):  # the handler runs here, inside the finalizer
                pass

    from rmflow.schemas.stops import stop_signal, unwinding

    started, received = time.time(), []
    with pytest.raises(KeyboardInterrupt), unwinding(received):
        Collected()  # collected at once
        while time.time() - started < 10:
            time.sleep(0.01)
    assert time.time() - started < 5 and received[0] == signal.SIGTERM
    assert stop_signal() is None  # the stop was the block's: later work in this process publishes


def test_nothing_is_published_once_a_stop_was_asked_for(tmp_path):
    """The second guard: a stop whose KeyboardInterrupt a library swallowed still publishes nothing."""
    from rmflow.pipelines.io import publish
    from rmflow.schemas.stops import clear_stop, note_stop

    (tmp_path / "staged").mkdir()
    note_stop(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            publish(str(tmp_path / "staged"), str(tmp_path / "out"))
        with pytest.raises(KeyboardInterrupt), staged_output(str(tmp_path / "out2"), "eval folder") as d:
            pathlib.Path(d, "x").write_text("x")
    finally:
        clear_stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["staged"]
    publish(str(tmp_path / "staged"), str(tmp_path / "out"))  # no stop: published
    assert (tmp_path / "out").is_dir()

"""What real users do to a tool: reruns into the same folders, relative paths from elsewhere,
mismatched tokenizers, odd files, interrupted commands. Each test guards one such case.

Every command's errors are one line (exit 1, no traceback); checks run before anything is
written; nothing is silently wrong or silently skipped.
"""

import dataclasses
import gzip
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train
from typer.testing import CliRunner

from rmflow.cli import app

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"
CONV = [{"role": "user", "content": "How do I boil an egg?"},
        {"role": "assistant", "content": "Eight minutes in boiling water."}]


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_error(result, code=1):
    """Exit ``code`` with a single message line, no traceback."""
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    return result.output


@pytest.fixture(scope="module")
def base(tmp_path_factory, demo_shards):
    """A run trained from relative paths (cwd = base), and a second tokenizer that differs."""
    base = tmp_path_factory.mktemp("hardening")
    shutil.copytree(demo_shards, base / "shards")  # the demo at max_length 128, preprocessed once per worker
    cwd = os.getcwd()
    os.chdir(base)
    try:
        train(TrainConfig(data="shards", model="micro", output="run", max_steps=2, batch_size=4, logging={"steps": 1}))
    finally:
        os.chdir(cwd)
    other = base / "other-tokenizer"
    shutil.copytree(DEMO / "tokenizer", other)
    (other / "chat_template.jinja").write_text((other / "chat_template.jinja").read_text() + "\n")
    return base


# --------------------------------------------------------------------------- silent wrong results


@pytest.mark.parametrize("first, second", [(4 << 20, 2 << 30), (2 << 30, 4 << 20)])
def test_export_replaces_an_earlier_export_whole(base, tmp_path, first, second):
    """No stale weights file survives beside the new ones (sharded <-> single)."""
    out = tmp_path / "hf"
    assert cli("export", base / "run", "-o", out, "--max-shard-gb", first / 2**30).exit_code == 0
    assert cli("export", base / "run", "-o", out, "--max-shard-gb", second / 2**30).exit_code == 0
    names = {p.name for p in out.iterdir()}
    weights = {n for n in names if n.endswith(".safetensors") or n.endswith(".index.json")}
    if second >= 2 << 30:
        assert weights == {"model.safetensors"}
    else:
        assert "model.safetensors" not in weights and "model.safetensors.index.json" in weights
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == weights - {"model.safetensors.index.json"}
    assert not list(tmp_path.glob("hf.tmp-*"))  # staging swapped in, nothing left


def test_export_refuses_a_folder_of_other_files(base, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    msg = one_line_error(cli("export", base / "run", "-o", out))
    assert "holds other files (config.json), not an earlier export" in msg
    assert (out / "config.json").read_text() == '{"mine": true}' and len(list(out.iterdir())) == 1
    (tmp_path / "afile").write_text("x")
    assert "is a file" in one_line_error(cli("export", base / "run", "-o", tmp_path / "afile"))


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(folder.rglob("*"))}


def test_no_command_writes_over_a_folder_that_is_not_its_own(base, tmp_path):
    """One rule (``schemas.outputs.check_replaceable``) for every command that writes an output
    folder: new, empty or its own earlier output, never a folder of other files, another command's
    output or one holding its inputs; refused in one line before anything is written."""
    shards, run = base / "shards", base / "run"
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("important")
    (mine / "sub" / "file").write_text("x")
    data = mine / "pairs.jsonl"  # the command's own input, inside the folder named as its output
    data.write_text(json.dumps({"prompt": "hi", "chosen": "a", "rejected": "b"}) + "\n")
    export = tmp_path / "export"
    assert cli("export", run, "-o", export).exit_code == 0
    workflow = tmp_path / "wf.yaml"
    workflow.write_text(f"output: {mine}\npreprocess: {{inputs: [{data}], tokenizer: {DEMO / 'tokenizer'}}}\n"
                        "train: {model: micro}\n")
    tok = ("--tokenizer", DEMO / "tokenizer")
    commands = {  # each command against (its output folder -> what it names as its own kind)
        "preprocess": lambda out: ("preprocess", "-i", data, *tok, "-o", out, "--overwrite"),
        "train": lambda out: ("train", "--data", shards, "--model", "micro", "-o", out, "--max-steps", 1),
        "eval": lambda out: ("eval", "--model", run, "--data", shards, "-o", out),
        "export": lambda out: ("export", run, "-o", out),
        "score --runner": lambda out: ("score", "--model", run, "-i", data, "-o", out, "--runner", "DirectRunner",
                                       "--overwrite"),
    }
    others = {"a folder of other files": mine, "the current folder": mine, "another command's output": None,
              "the model": export, "the shards": shards}
    own = {"preprocess": "the shards", "export": "the model"}  # an earlier output of its own: replaced
    for name, args in commands.items():
        for what, out in others.items():
            if what == own.get(name):
                continue
            if out is None:  # another command's output: an export for all but export, which gets shards
                out = export if name != "export" else shards
            before = _snapshot(out)
            cwd = os.getcwd()
            os.chdir(out if what == "the current folder" else cwd)
            try:
                result = cli(*args("." if what == "the current folder" else out))
            finally:
                os.chdir(cwd)
            message = one_line_error(result)
            assert "give a new or empty folder" in message or "apart from its inputs" in message, (name, what, message)
            assert _snapshot(out) == before, (name, what)
    before = _snapshot(mine)
    assert "holds other files" in one_line_error(cli("run", workflow))
    assert _snapshot(mine) == before
    # an eval folder holding the data it evaluates (named, or by a glob), or the model: the eval would replace it
    ev = tmp_path / "ev"
    assert cli("eval", "--model", run, "--data", shards, "-o", ev).exit_code == 0
    shutil.copy(data, ev / "pairs.jsonl")
    before = _snapshot(ev)
    for named in (ev / "pairs.jsonl", tmp_path / "e*" / "pairs.jsonl"):  # refused for holding it, or another file
        assert REFUSED.search(one_line_error(cli("eval", "--model", run, "--data", named, "-o", ev)))
    assert _snapshot(ev) == before
    ev_before = before
    # preprocess --overwrite and the scoring job whose inputs (data, template, model) lie in their output
    own = tmp_path / "own"  # an earlier shard folder (what makes one: its manifest and stats)
    shutil.copytree(shards, own)
    shutil.copy(data, own / "in.jsonl")
    shutil.copytree(export, own / "model")
    before = _snapshot(own)
    assert REFUSED.search(one_line_error(cli("preprocess", "-i", own / "in.jsonl", *tok, "-o", own, "--overwrite")))
    scored = tmp_path / "scored"  # an earlier scoring job's output (what makes one: COMPLETED and its summary)
    scored.mkdir()
    (scored / "COMPLETED").write_text("")
    (scored / "summary.json").write_text("{}")
    shutil.copytree(export, scored / "m")
    frozen = _snapshot(scored)
    assert REFUSED.search(one_line_error(cli("score", "--model", scored / "m", "-i", data, "-o", scored,
                                             "--runner", "DirectRunner", "--overwrite")))
    assert _snapshot(scored) == frozen
    # an output inside another command's output (which that command's rerun would replace), a file
    # of one overwritten by in-process scoring, a folder to replace that holds another output
    for args in (("export", run, "-o", ev / "nested"), ("train", "--data", shards, "--model", "micro", "-o",
                                                           own / "run", "--max-steps", 1),
                 ("score", "--model", export, "-i", data, "-o", export / "config.json"),
                 ("export", run, "-o", run / "checkpoints" / "99")):
        assert "is inside an rmflow" in one_line_error(cli(*args)), args
    assert REFUSED.search(one_line_error(cli("preprocess", "-i", data, *tok, "-o", own, "--overwrite")))
    assert _snapshot(own) == before and _snapshot(ev) == ev_before


# The refusals of the output rule: the output holds the command's input, another rmflow output,
# or files rmflow did not write
REFUSED = re.compile(r"apart from its inputs|holds an rmflow|which rmflow did not write")


def test_an_earlier_output_holding_a_user_s_files_is_never_replaced_nor_a_folder_taken_for_one(base, tmp_path):
    """A folder is a command's earlier output only by all it holds (``OUTPUT_FILES``): one marker
    file among a user's files (a ``checkpoints`` folder, a ``_summary.json``) is no run or shard
    folder, and an earlier eval, shard folder or export that a user added files to is refused in
    one line naming them, nothing touched; an output named by a link is refused too."""
    shards, run = base / "shards", base / "run"
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "chosen": "a", "rejected": "b"}) + "\n")
    tok = ("--tokenizer", DEMO / "tokenizer")
    lightning = tmp_path / "lightning"  # another trainer's project folder: a checkpoints folder and a config
    (lightning / "checkpoints").mkdir(parents=True)
    (lightning / "checkpoints" / "epoch=1.ckpt").write_text("w")
    (lightning / "config.json").write_text('{"my": "config"}')
    userdir = tmp_path / "userdir"
    userdir.mkdir()
    (userdir / "_summary.json").write_text("{}")
    (userdir / "thesis.tex").write_text("precious")
    ev, shard_copy, export = tmp_path / "ev", tmp_path / "shards", tmp_path / "export"
    assert cli("eval", "--model", run, "--data", shards, "-o", ev).exit_code == 0
    assert cli("export", run, "-o", export).exit_code == 0
    shutil.copytree(shards, shard_copy)
    for folder in (ev, shard_copy, export):
        (folder / "notes.txt").write_text("mine")
    cases = ((("train", "--data", shards, "--model", "micro", "-o", lightning, "--max-steps", 1), lightning),
             (("preprocess", "-i", data, *tok, "-o", userdir, "--overwrite"), userdir),
             (("eval", "--model", run, "--data", shards, "-o", ev), ev),
             (("preprocess", "-i", data, *tok, "-o", shard_copy, "--overwrite"), shard_copy),
             (("export", run, "-o", export), export))
    for args, out in cases:
        before = _snapshot(out)
        message = one_line_error(cli(*args))
        assert "holds other files" in message or "which rmflow did not write" in message, (args, message)
        assert _snapshot(out) == before, args
    (ev / "notes.txt").unlink()
    link = tmp_path / "elink"
    link.symlink_to(ev)
    assert f"{link} is a link to {ev}: give the folder itself" in one_line_error(
        cli("eval", "--model", run, "--data", shards, "-o", link))
    assert link.is_symlink() and (ev / "eval.json").exists()


def test_a_run_is_self_contained_and_its_paths_absolute(base, tmp_path, monkeypatch):
    """Score and export from another directory, the shards gone, a decoy shards/ with another
    tokenizer in the working directory: the run's own tokenizer is used."""
    cfg = json.loads((base / "run" / "config.json").read_text())
    assert cfg["data"]["train"] == str(base / "shards") and cfg["output"] == str(base / "run")
    run_copy = tmp_path / "run"
    shutil.copytree(base / "run", run_copy)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "shards" / "tokenizer").mkdir(parents=True)
    shutil.copytree(base / "other-tokenizer", elsewhere / "shards" / "tokenizer", dirs_exist_ok=True)
    monkeypatch.chdir(elsewhere)
    shutil.copytree(base / "shards", tmp_path / "shards-moved")  # keep the module's shards for other tests
    cfg["data"]["train"] = "shards"  # a relative path, now pointing at the decoy
    (run_copy / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": CONV}) + "\n")
    assert cli("score", "--model", run_copy, "-i", tmp_path / "in.jsonl", "-o", tmp_path / "s.jsonl").exit_code == 0
    assert cli("export", run_copy, "-o", tmp_path / "hf").exit_code == 0
    manifest = json.loads((base / "shards" / "manifest.json").read_text())
    assert json.loads((tmp_path / "hf" / "rmflow_export.json").read_text())["tokenizer_sha256"] == \
        manifest["tokenizer"]["sha256"]
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == \
        (base / "shards" / "tokenizer" / "chat_template.jinja").read_text()


def test_eval_checks_the_shards_tokenizer_against_the_model(base, tmp_path):
    preprocess(PreprocessConfig(inputs=(str(DEMO / "hh_rlhf_helpful_sample.jsonl.gz"),), output=str(tmp_path / "s"),
                                tokenizer=str(base / "other-tokenizer"), max_length=128, max_bad_fraction=1.0))
    msg = one_line_error(cli("eval", "--model", base / "run", "--data", tmp_path / "s", "-o", tmp_path / "e"))
    assert "tokenizer hash" in msg and not (tmp_path / "e").exists()


def test_a_model_folder_without_tokenizer_files_is_said(base, tmp_path):
    hf = tmp_path / "hf"
    assert cli("export", base / "run", "-o", hf).exit_code == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (hf / name).unlink(missing_ok=True)
    r = cli("eval", "--model", hf, "--data", base / "shards", "-o", tmp_path / "e")
    assert r.exit_code == 0 and "warning:" in r.output and "has no tokenizer files" in r.output
    # training from such a checkpoint warns the same way
    from rmflow.trainer.model_setup import check_tokenizer, read_manifest

    with pytest.warns(RmflowWarning, match="no tokenizer files"):
        check_tokenizer(read_manifest(str(base / "shards")), str(hf), "the model")
    (tmp_path / "in.jsonl").write_text(json.dumps(CONV) + "\n")
    assert "no tokenizer files" in one_line_error(cli("score", "--model", hf, "-i", tmp_path / "in.jsonl",
                                                      "-o", tmp_path / "s.jsonl"))


# --------------------------------------------------------------------------- score


def test_score_reports_bad_lines_and_keeps_the_users_fields(base, tmp_path):
    lines = [json.dumps({"id": "ok", "messages": CONV}).encode(),
             b'{"id": "latin1", "messages": [{"role": "user", "content": "caf\xe9"}]}',
             json.dumps({"id": "user-last", "messages": CONV + [{"role": "user", "content": "and?"}]}).encode(),
             json.dumps({"id": "system-only", "messages": [{"role": "system", "content": "Be brief."}]}).encode(),
             json.dumps({"id": "shape", "messages": "not a list"}).encode(),
             json.dumps(CONV).encode()]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    r = cli("score", "--model", base / "run", "-i", tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl")
    assert r.exit_code == 1 and "4 of 6 lines (66.7%) cannot be scored" in r.output, r.output
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o.get("id") for o in out] == ["ok", None, "user-last", "system-only", "shape", None]
    assert "score" in out[0] and "score" in out[5]
    assert "not valid UTF-8" in out[1]["error"] and out[1]["line"] == 2
    assert "ends with a user message" in out[2]["error"]
    assert "ends with a system message" in out[3]["error"]
    assert all("score" not in o for o in out[1:5])


def test_score_s_bad_fraction_bad_text_own_fields_and_truncation(base, tmp_path):
    """Under --max-bad-fraction: exit 0 with each bad line written; a lone surrogate or a NaN is a
    bad line (the good lines are still scored); a line's own ``score`` / ``line`` are kept as
    ``input_<name>``; the input is never the output; --truncate left scores what is too long."""
    from rmflow import RewardModel

    long = [{"role": "user", "content": "word " * 5000}, CONV[1]]  # more than micro's 4,096 positions
    lines = [json.dumps({"id": "own", "score": 3, "line": "x", "messages": CONV}),
             json.dumps({"id": "surrogate", "note": "hi \ud800", "messages": CONV}),
             '{"id": NaN, "messages": ' + json.dumps(CONV) + "}",
             json.dumps({"id": "long", "messages": long})] + [json.dumps({"id": i, "messages": CONV}) for i in range(8)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    r = cli("score", "--model", base / "run", "-i", tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl",
            "--max-bad-fraction", "0.25", "--truncate", "left", "--batch-size", "2")  # small shapes: one at 4,096
    assert r.exit_code == 0 and "10 scored, 2 bad lines" in r.output, r.output
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert (out[0]["input_score"], out[0]["input_line"], "line" not in out[0]) == (3, "x", True)
    assert "note holds a lone surrogate" in out[1]["error"] and "NaN is not JSON" in out[2]["error"]
    assert "score" in out[3] and out[3]["id"] == "long"  # left-truncated
    rm = RewardModel.load(str(base / "run"))
    assert abs(out[0]["score"] - rm.score([CONV])[0]) < 1e-5
    r = cli("score", "--model", base / "run", "-i", tmp_path / "in.jsonl", "-o", tmp_path / "strict.jsonl")
    msg = r.output.strip().splitlines()[-1]  # after the progress bar; default --max-bad-fraction: 5%
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "3 of 12 lines (25.0%) cannot be scored, more than --max-bad-fraction 5.0%" in msg, msg
    strict = [json.loads(x) for x in (tmp_path / "strict.jsonl").read_text().splitlines()]
    assert len(strict) == 12 and "--truncate left" in strict[3]["error"]  # written either way; names the fix
    before = (tmp_path / "in.jsonl").read_bytes()
    assert "is the input file" in one_line_error(cli("score", "--model", base / "run", "-i", tmp_path / "in.jsonl",
                                                     "-o", tmp_path / "in.jsonl"))
    assert (tmp_path / "in.jsonl").read_bytes() == before


def test_a_raw_eval_set_s_bad_records_are_set_aside_not_fatal(base, tmp_path):
    """eval_data given as raw files: bad records are counted in the set's errors file and warned
    about, the set evaluated on the rest; a set with nothing usable stops the run in one message
    naming the set and where its reasons are, and leaves no staging folder."""
    from rmflow.trainer.errors import TrainError

    from rmflow.eval.sets import preprocess_eval_sets

    rows = [json.loads(x) for x in gzip.open(DEMO / "hh_rlhf_helpful_sample.jsonl.gz", "rt").read().splitlines()[:31]]
    (tmp_path / "rb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n" +
                                       json.dumps({"chosen": "", "rejected": ""}) + "\n")
    (tmp_path / "bad.jsonl").write_text("{broken\n{also broken\n")
    cfg = TrainConfig(data={"train": str(base / "shards"), "eval": {"rb": [str(tmp_path / "rb.jsonl")]}},
                      model="micro", output=str(tmp_path / "run"))
    with pytest.warns(RmflowWarning, match="data.eval 'rb': 2 of 33 records cannot be used"):
        done = preprocess_eval_sets(cfg)
    assert done.data.eval["rb"] == [str(tmp_path / "run" / "eval_data" / "rb")]
    bad = cfg.with_overrides([f"data.eval=bad={tmp_path / 'bad.jsonl'}"])
    with pytest.raises(TrainError, match="data.eval 'bad' .*every record and its reason: .*bad.errors.jsonl"):
        preprocess_eval_sets(bad)
    assert len((tmp_path / "run" / "eval_data" / "bad.errors.jsonl").read_text().splitlines()) == 2
    assert sorted(os.listdir(tmp_path / "run" / "eval_data")) == ["bad.errors.jsonl", "rb"]


# --------------------------------------------------------------------------- lost work


def test_resume_on_an_empty_or_missing_folder_says_so(base, tmp_path):
    for out in (tmp_path / "missing", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        r = cli("train", "--data", base / "shards", "--model", "micro", "-o", out, "--resume",
                "--set", "max_steps=1", "--set", "batch_size=2")
        assert r.exit_code == 0, r.output
        assert "warning:" in r.output and "no checkpoint to continue from; starting at step 0" in r.output


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_staging_is_cleaned_and_other_staging_reported(tmp_path):
    out = tmp_path / "shards"
    stale, foreign = tmp_path / "shards.tmp-0123456789ab", tmp_path / "shards.tmp-ba9876543210"
    for folder, host, pid in ((stale, socket.gethostname(), _dead_pid()), (foreign, "another-host", 1)):
        folder.mkdir()
        (folder / "train-00000-of-00001.array_record").write_bytes(b"x" * 1000)
        (folder / "_owner.json").write_text(json.dumps({"host": host, "pid": pid, "started": 0}))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "p", "chosen": "yes", "rejected": "no"}) + "\n")
    r = cli("preprocess", "-i", src, "--tokenizer", DEMO / "tokenizer", "-o", out, "--eval-fraction", "0")
    assert r.exit_code == 0, r.output
    assert not stale.exists() and foreign.exists()
    text = " ".join(r.output.split())
    assert f"removed 1 staging folder(s) left by interrupted runs of {out}: {stale}" in text
    assert f"staging folder(s) of other runs of {out} exist: {foreign}" in text
    assert not (out / "_owner.json").exists()  # the owner file never reaches the published output


# --------------------------------------------------------------------------- one-line errors


def _checkpoint(folder: pathlib.Path, **config) -> pathlib.Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_every_command_fails_in_one_line(base, tmp_path):
    shards = base / "shards"
    gpt2 = _checkpoint(tmp_path / "gpt2", model_type="gpt2", vocab_size=100)
    assert "model_type 'gpt2' is not supported" in one_line_error(
        cli("train", "--data", shards, "--model", gpt2, "-o", tmp_path / "r1"))
    partial = _checkpoint(tmp_path / "partial", model_type="llama", vocab_size=100, hidden_size=64)
    assert "has no ['intermediate_size', 'num_hidden_layers', 'num_attention_heads']" in one_line_error(
        cli("train", "--data", shards, "--model", partial, "-o", tmp_path / "r2"))
    broken = tmp_path / "broken"  # a model folder whose config.json is not JSON, or not an object
    broken.mkdir()
    for text in ("not json", "[1, 2]"):
        (broken / "config.json").write_text(text)
        (tmp_path / "one.jsonl").write_text(json.dumps({"messages": CONV}) + "\n")
        assert "config.json" in one_line_error(cli("score", "--model", broken, "-i", tmp_path / "one.jsonl",
                                                   "-o", tmp_path / "one-out.jsonl"))
    (tmp_path / "afile").write_text("x")
    assert "is a file" in one_line_error(cli("train", "--data", shards, "--model", "micro", "-o", tmp_path / "afile"))
    assert "is a file" in one_line_error(cli("eval", "--model", base / "run", "--data", shards,
                                             "-o", tmp_path / "afile"))
    assert "is a file" in one_line_error(cli("preprocess", "-i", DEMO / "hh_rlhf_helpful_sample.jsonl.gz",
                                             "--tokenizer", DEMO / "tokenizer", "-o", tmp_path / "afile",
                                             "--overwrite"))
    assert (tmp_path / "afile").read_text() == "x"
    # --overwrite deletes only rmflow's own output, never a folder of other files
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    assert "holds other files (notes.txt), not an earlier shard folder" in one_line_error(
        cli("preprocess", "-i", DEMO / "hh_rlhf_helpful_sample.jsonl.gz", "--tokenizer", DEMO / "tokenizer",
            "-o", tmp_path / "mine", "--overwrite"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    assert "is a folder" in one_line_error(cli("score", "--model", base / "run", "-i", tmp_path / "afile",
                                               "-o", tmp_path))
    # A run with no checkpoint yet (stopped before its first save).
    nockpt = tmp_path / "nockpt"
    shutil.copytree(base / "run", nockpt, ignore=shutil.ignore_patterns("checkpoints"))
    assert "has no checkpoint yet" in one_line_error(cli("eval", "--model", nockpt, "--data", shards,
                                                         "-o", tmp_path / "e"))
    # An older run's model_config.json that lacks a key.
    old = tmp_path / "old"
    shutil.copytree(base / "run", old)
    mc = json.loads((old / "model_config.json").read_text())
    del mc["head_dim"]
    (old / "model_config.json").write_text(json.dumps(mc))
    assert "missing ['head_dim']" in one_line_error(cli("export", old, "-o", tmp_path / "x"))
    # `rmflow run` with a tokenizer path that does not exist.
    wf = tmp_path / "wf.yaml"
    wf.write_text(json.dumps({"output": str(tmp_path / "wf"), "train": {"model": "micro"},
                              "preprocess": {"inputs": [str(DEMO / "hh_rlhf_helpful_sample.jsonl.gz")],
                                             "tokenizer": str(tmp_path / "no-such-tokenizer")}}))
    r = cli("run", wf)  # progress lines, then the error in one line
    assert r.exit_code == 1 and "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert r.output.strip().splitlines()[-1].startswith("run failed: tokenizer folder ")
    assert "no-such-tokenizer does not exist" in " ".join(r.output.split())


def test_eval_output_is_replaced_whole_and_a_failed_eval_keeps_the_earlier_one(base, tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    for name in ("eval.json", "report.md", "input_errors.jsonl"):  # an earlier eval's, on raw files
        (out / name).write_text("stale, from an earlier eval\n")
    assert cli("eval", "--model", base / "run", "--data", base / "shards", "-o", out, "--step", 2).exit_code == 0
    assert "input_errors.jsonl" not in os.listdir(out)  # the folder is this eval's alone
    written = json.loads((out / "eval.json").read_text())["config"]
    assert written["step"] == 2 and "checkpoint step 2" in written["model_description"]
    before = sorted(os.listdir(out)), (out / "eval.json").read_text()
    (tmp_path / "raw.jsonl").write_text('{"prompt": "p"}\n{"broken\n')
    msg = " ".join(one_line_error(cli("eval", "--model", base / "run", "--data", tmp_path / "raw.jsonl",
                                      "-o", out)).split())
    kept = tmp_path / "e.input_errors.jsonl"  # beside the folder, which keeps the earlier eval
    assert str(kept) in msg and len(kept.read_text().splitlines()) == 2 and kept.exists()
    assert (sorted(os.listdir(out)), (out / "eval.json").read_text()) == before
    assert "has no checkpoint of step 7" in one_line_error(
        cli("eval", "--model", base / "run", "--data", base / "shards", "-o", out, "--step", 7))


def test_eval_on_raw_files_takes_the_preprocess_options(base, tmp_path):
    rows = [{"prompt": f"ignored {i}", "chosen": f"\n\nHuman: Hi {i}\n\nAssistant: Hello, friend.",
             "rejected": f"\n\nHuman: Hi {i}\n\nAssistant: Go away."} for i in range(4)]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "ambiguous_layout" in one_line_error(cli("eval", "--model", base / "run", "--data",
                                                    tmp_path / "raw.jsonl", "-o", tmp_path / "e1"))
    r = cli("eval", "--model", base / "run", "--data", tmp_path / "raw.jsonl", "-o", tmp_path / "e2",
            "--format", "hh-rlhf")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "e2" / "eval.json").read_text())["metrics"]["pairs"] == 4


def test_resume_refuses_a_changed_trajectory_unless_allowed_and_keeps_the_history(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    args = ["train", "--data", base / "shards", "--model", "micro", "-o", run, "--resume",
            "--set", "batch_size=4", "--set", "logging.steps=1"]
    msg = one_line_error(cli(*args, "--set", "max_steps=3", "--set", "optimizer.learning_rate=2e-5"))
    assert "learning_rate: 1e-05 -> 2e-05" in msg and "max_steps: 2 -> 3" in msg and "--allow-config-change" in msg
    msg = one_line_error(cli(*args, "--set", "max_steps=2", "--set", "lora.rank=4"))
    assert "another lora" in msg and "start a new run" in msg
    config = (run / "config.json").read_text()
    r = cli(*args, "--set", "max_steps=2", "--set", "logging.steps=2")  # where it logs: no change to refuse
    assert r.exit_code == 0, r.output
    assert (run / "config.json").read_text() != config
    r = cli(*args, "--set", "max_steps=3", "--allow-config-change")
    assert r.exit_code == 0, r.output
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["from_step"] for h in history] == [0, 2]
    assert history[1]["changed"] == {"max_steps": {"before": 2, "after": 3}}


def test_shards_longer_than_the_models_positions_are_refused(base, tmp_path):
    preprocess(PreprocessConfig(inputs=(str(DEMO / "hh_rlhf_helpful_sample.jsonl.gz"),), output=str(tmp_path / "long"),
                                tokenizer=str(DEMO / "tokenizer"), max_length=8192, max_bad_fraction=1.0))
    msg = one_line_error(cli("train", "--data", tmp_path / "long", "--model", "micro", "-o", tmp_path / "r"))
    assert "8,192 tokens, past the model's 4,096 positions" in msg and "--max-length 4096" in msg
    assert not (tmp_path / "r").exists()
    msg = one_line_error(cli("eval", "--model", base / "run", "--data", tmp_path / "long", "-o", tmp_path / "e"))
    assert "past the model's 4,096 positions" in msg


def _train_process(base, out, *extra):
    args = [sys.executable, "-m", "rmflow.cli", "train", "--data", str(base / "shards"), "--model", "micro",
            "-o", str(out), "--set", "batch_size=4", "--set", "logging.steps=1", *extra]
    return subprocess.Popen(args, cwd=pathlib.Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(path: pathlib.Path, lines: int, proc, timeout: float = 240) -> None:
    import time

    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never had {lines} lines; the process said: {proc.communicate()[0]}")


@pytest.mark.slow
@pytest.mark.parametrize("signum, moment", [(signal.SIGINT, "mid-training"), (signal.SIGTERM, "while compiling")])
def test_a_signal_stops_training_at_a_step_boundary_with_a_checkpoint(base, tmp_path, signum, moment):
    out = tmp_path / "run"
    proc = _train_process(base, out, "--set", "max_steps=500")
    if moment == "mid-training":
        _wait_for(out / "metrics.jsonl", 2, proc)
    else:  # written just before the first step, whose compilation follows
        _wait_for(out / "config.json", 1, proc)
    proc.send_signal(signum)
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == 128 + signum, output
    assert "Traceback" not in output
    said = " ".join(output.split())
    name = signal.Signals(signum).name
    assert f"train stopped: stopped by {name} at step" in said and "--resume" in said
    step = int(said.split(f"stopped by {name} at step ")[1].split(":")[0])
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir()) if step else []
    assert checkpoints == ([str(step)] if step else []), checkpoints  # the step it stopped at, nothing half-written
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert (records[-1]["step"] if records else 0) == step
    if step:  # and it resumes from there
        r = cli("train", "--data", base / "shards", "--model", "micro", "-o", out, "--resume", "--set", "batch_size=4",
                "--set", "logging.steps=1", "--set", f"max_steps={step + 1}", "--allow-config-change")
        assert r.exit_code == 0, r.output
        assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()][-2:] == [step, step + 1]


def test_a_tiny_eval_split_is_said_to_say_little(tmp_path):
    preprocess(PreprocessConfig(inputs=(str(DEMO / "hh_rlhf_helpful_sample.jsonl.gz"),), output=str(tmp_path / "s"),
                                tokenizer=str(DEMO / "tokenizer"), max_length=128, max_bad_fraction=1.0,
                                eval_fraction=0.005))
    with pytest.warns(RmflowWarning, match=r"the eval split holds \d pairs: its accuracy moves in steps of"):
        train(TrainConfig(data=str(tmp_path / "s"), model="micro", output=str(tmp_path / "r"), max_steps=1,
                          batch_size=2))


def test_a_damaged_checkpoint_is_one_line(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    files = [p for p in (run / "checkpoints" / "2" / "state").rglob("*") if p.is_file()]
    for p in files:  # every data file of the parameters cut short, as a full disk or a lost copy leaves them
        if p.stat().st_size > 1000:
            p.write_bytes(p.read_bytes()[:100])
    msg = one_line_error(cli("eval", "--model", run, "--data", base / "shards", "-o", tmp_path / "e"))
    assert "checkpoint step 2 of" in msg and "cannot be read" in msg


def test_a_checkpoint_of_another_model_is_one_line(base, tmp_path):
    """A trained model is read back parameters only, placed by the checkpoint's own layout: a
    checkpoint whose arrays are not the run's model's is refused in one line, not misread."""
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    config = json.loads((run / "model_config.json").read_text())
    (run / "model_config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    msg = one_line_error(cli("eval", "--model", run, "--data", base / "shards", "-o", tmp_path / "e"))
    assert "checkpoint step 2 does not hold the parameters of the run's model" in msg


def test_an_export_is_the_kind_its_run_recorded(base, tmp_path):
    """A model rmflow exported is loaded as the kind its run recorded (its export info), not as
    whatever its head's width suggests; an export info at odds with the head is one line."""
    from rmflow.scoring.api import RewardModel

    assert cli("export", base / "run", "-o", tmp_path / "x").exit_code == 0
    assert RewardModel.load(str(tmp_path / "x")).kind == "outcome"
    info = tmp_path / "x" / "rmflow_export.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), "kind": "process"}))
    msg = one_line_error(cli("eval", "--model", tmp_path / "x", "--data", base / "shards", "-o", tmp_path / "e"))
    assert "says it is a process reward model" in msg and "its config.json has 1" in msg


def test_reading_a_checkpoint_back_logs_nothing(base, tmp_path):
    """A command that reads a run's checkpoint (export here) prints its own lines only: reading
    the checkpoint's layout must not make Orbax warn about files it looked for in the wrong place."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rmflow.cli", "export", str(base / "run"), "-o", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "WARNING" not in out.stderr and "WARNING" not in out.stdout, out.stderr[-2000:]


def test_an_export_carries_how_its_data_was_rendered(base, tmp_path):
    """The rendering spec of the run's shards (tokenizer, vocabulary and template hashes, step
    separator, special-text policy) is written into the export and read back with the model; an
    export from before it was written there gives the same spec from the fields it had."""

    from rmflow.schemas.manifest import Manifest
    from rmflow.trainer.inference import load_model

    spec = Manifest.from_json((base / "run" / "data_manifest.json").read_text()).render
    assert spec.special_text == "text" and spec.tokenizer_sha256 and spec.vocabulary_sha256
    assert cli("export", base / "run", "-o", tmp_path / "x").exit_code == 0
    info = tmp_path / "x" / "rmflow_export.json"
    assert json.loads(info.read_text())["render"] == dataclasses.asdict(spec)
    assert load_model(str(tmp_path / "x")).render == spec == load_model(str(base / "run")).render
    old = {k: v for k, v in json.loads(info.read_text()).items() if k != "render"}
    info.write_text(json.dumps(old))
    read = load_model(str(tmp_path / "x")).render
    assert (read.tokenizer_sha256, read.step_separator) == (spec.tokenizer_sha256, spec.step_separator)


def test_a_chat_template_override_trains_and_evaluates_on_its_own_shards(tmp_path):
    """The shards' tokenizer identity is the tokenizer as used (the override applied), as the run
    stores it: eval of the run on its own shards is not refused."""
    template = tmp_path / "mine.jinja"
    template.write_text((DEMO / "tokenizer" / "chat_template.jinja").read_text() + "{# mine #}")
    preprocess(PreprocessConfig(inputs=(str(DEMO / "hh_rlhf_helpful_sample.jsonl.gz"),), output=str(tmp_path / "s"),
                                tokenizer=str(DEMO / "tokenizer"), chat_template=str(template), max_length=128,
                                max_bad_fraction=1.0))
    train(TrainConfig(data=str(tmp_path / "s"), model="micro", output=str(tmp_path / "r"), max_steps=2, batch_size=4))
    assert (tmp_path / "r" / "tokenizer" / "chat_template.jinja").read_text().endswith("{# mine #}")
    r = cli("eval", "--model", tmp_path / "r", "--data", tmp_path / "s", "-o", tmp_path / "e")
    assert r.exit_code == 0, r.output
    assert cli("export", tmp_path / "r", "-o", tmp_path / "x").exit_code == 0
    r = cli("eval", "--model", tmp_path / "x", "--data", tmp_path / "s", "-o", tmp_path / "e2")
    assert r.exit_code == 0, r.output

"""Weighted mixtures of shard sets (``data: {set: weight}``): Grain mixes them by weight, every
record drawn is its set's, a mixture resumes bit-exactly after kill -9, the run records the
mixture and logs each set's counts and eval metrics, and sets preprocessed unlike are refused."""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import ConfigError, PreprocessConfig
from rmflow.schemas.manifest import Manifest
from rmflow.schemas.sources import DataSource, parse_eval_data
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.data import LoaderSpec, make_loader
from rmflow.trainer.errors import TrainError
from rmflow.trainer.train import run as train

GOOD = 1000
RANGES = {"a": (2000, 3000), "b": (4000, 5000)}  # each set's tokens: a record says which set it is from
SIZES = {"a": 120, "b": 360}


def _set(base, name, tokenizer_dir, **kw):
    rng = np.random.default_rng(len(name) + ord(name[0]))
    lo, hi = RANGES[name]
    with open(base / f"{name}.jsonl", "w") as f:
        for _ in range(SIZES[name]):
            prompt = rng.integers(lo, hi, 4).tolist()
            chosen = rng.integers(lo, hi, int(rng.integers(2, 6))).tolist()
            chosen[int(rng.integers(0, len(chosen)))] = GOOD
            rejected = rng.integers(lo, hi, int(rng.integers(2, 6))).tolist()
            f.write(json.dumps({"chosen_ids": prompt + chosen, "rejected_ids": prompt + rejected,
                                "prompt_len": 4}) + "\n")
    out = base / name
    preprocess(PreprocessConfig(inputs=(str(base / f"{name}.jsonl"),), output=str(out), tokenizer=tokenizer_dir,
                                format="tokenized", max_length=16, eval_fraction=0.1, **kw))
    return out


@pytest.fixture(scope="module")
def sets(tmp_path_factory, tokenizer_dir):
    base = tmp_path_factory.mktemp("mixture")
    return {name: _set(base, name, tokenizer_dir) for name in RANGES}


def train_paths(folder):
    manifest = Manifest.from_json((folder / "manifest.json").read_text())
    return [str(folder / s.file) for s in manifest.splits["train"].shards]


def test_data_spellings_read_as_the_same_sets():
    want = (DataSource("hh", "s/hh", 0.5), DataSource("uf", "gs://b/uf", 0.25))
    for data in ("s/hh=0.5,gs://b/uf=0.25", {"s/hh": 0.5, "gs://b/uf": 0.25},
                 {"hh": {"path": "s/hh", "weight": 0.5}, "uf": {"path": "gs://b/uf", "weight": 0.25}}):
        cfg = TrainConfig(data={"train": data}, model="micro", output="o")
        assert cfg.sources == want
        assert TrainConfig.from_dict(json.loads(cfg.to_json())).sources == want  # stored and read back
    one = TrainConfig(data="shards/hh", model="micro", output="o")
    assert one.data.train == "shards/hh" and one.sources == (DataSource("hh", "shards/hh", 1.0),)
    assert TrainConfig(data="x", model="micro", output="o").with_overrides(["data=p/a=1,p/b=3"]).sources[1].weight == 3
    for bad, words in (("a=0,b=1", "positive number"), ({"x/a": 1, "y/a": 2}, "two sets are named"),
                       ({"a b": {"path": "p", "weight": 1}}, "name 'a b'"), ({"a": {"weight": 1}}, "path"),
                       ("", "required"), ("hh=1,uf=nan", "'uf' is nan"), ("hh=1,uf=inf", "'uf' is inf"),
                       ("hh=1,uf=", "'uf=' is not folder=weight"), ("hh=1,uf=lots",
                        "'uf=lots' is not folder=weight"), ("hh=1,hh=2", "hh is given twice"),
                       ("hh,uf=1", "'hh' is not folder=weight")):
        with pytest.raises(ConfigError, match=words):
            TrainConfig(data={"train": bad}, model="micro", output="o")
    with pytest.raises(ConfigError, match=r"unknown DataConfig keys \['s/hh'\].*a mixture of shard sets goes under "
                                          "data.train"):  # the mixture mapping where the section belongs
        TrainConfig(data={"s/hh": 1}, model="micro", output="o")
    from rmflow.trainer.errors import TrainError
    from rmflow.trainer.model_setup import read_manifest

    with pytest.raises(TrainError, match="does not exist: give a shard folder"):  # not "no COMPLETED marker"
        read_manifest("/nonexistent/shards/uf")
    hive = TrainConfig(data="gs://b/date=2026-11-25/hh", model="micro", output="o")  # '=' inside a folder's path
    assert hive.sources == (DataSource("hh", "gs://b/date=2026-11-25/hh", 1.0),)
    assert TrainConfig(data="data/lang=en", model="micro", output="o").sources[0].path == "data/lang=en"
    assert parse_eval_data("hh=s/hh,rb=x.jsonl,rb=y.jsonl") == {"hh": ("s/hh",), "rb": ("x.jsonl", "y.jsonl")}


@pytest.mark.parametrize("packing", ["pack", "none"])
def test_the_loader_mixes_by_weight_each_record_from_its_set(sets, packing):
    def loader(shard=None):
        return iter(make_loader([train_paths(sets["a"]), train_paths(sets["b"])], LoaderSpec(batch_size=8, max_length=16,
                                seed=1, num_epochs=None, shard_by_process=False, packing=packing,
                                weights=[3.0, 1.0], shard=shard)))

    it, counts = loader(), np.zeros(2, int)
    for _ in range(60):  # 480 records: 360 from a (3 passes over its 108), 120 from b (a third of its 324)
        b = next(it)
        counts += b["source_counts"]
        ids = b["input_ids"]
        tokens = ids[(ids >= 2000) & (ids != GOOD)]
        in_a = (tokens < 3000).sum()
        # each batch's tokens come from its sets in the counts it reports (a: 2000..2999, b: 4000..4999)
        assert (in_a > 0) == (b["source_counts"][0] > 0) and ((tokens >= 4000).sum() > 0) == (b["source_counts"][1] > 0)
    assert counts.tolist() == [360, 120]
    state = it.get_state()
    following = [next(it) for _ in range(3)]
    again = loader()
    again.set_state(state)
    for x in following:  # a restored loader continues on exactly the next batches
        y = next(again)
        assert all(np.array_equal(x[k], y[k]) for k in x)


def test_each_set_is_drawn_in_its_own_passes_and_processes_split_every_set(sets):
    from rmflow.trainer.data.loader import mixed_stream

    sizes = [108, 324]
    sources = [range(108), range(108, 432)]
    one = mixed_stream(sources, [3.0, 1.0], shard=(0, 1), seed=0)
    keys = [one[p][1] for p in range(4 * 108)]
    a = [k for k in keys if k < 108]
    assert len(a) == 324 and all(sorted(a[i:i + 108]) == list(range(108)) for i in range(0, 324, 108))
    assert len(set(k for k in keys if k >= 108)) == 108  # b: a third of it, no repeat
    assert {s for s, _ in (one[p] for p in range(40))} == {0, 1} and sum(sizes) == 432
    two = [mixed_stream(sources, [3.0, 1.0], shard=(i, 2), seed=0) for i in range(2)]
    seen = [{two[i][p][1] for p in range(400)} for i in range(2)]
    assert not seen[0] & seen[1]  # each process its own half of each set
    assert {k < 108 for k in seen[0]} == {True, False}


def _cli(run_dir, data, **sets_):
    args = {"max_steps": 24, "checkpoint.save_steps": 6, "eval_steps": 12, "logging.steps": 6, "batch_size": 8,
            "optimizer.learning_rate": 3e-4, "optimizer.warmup_steps": 4, **sets_}
    return [sys.executable, "-m", "rmflow.cli", "train", "--data", data, "--model", "micro", "--output",
            str(run_dir)] + [f"--set={k}={v}" for k, v in args.items()]


@pytest.mark.slow
def test_a_mixture_trains_logs_each_set_and_resumes_exactly_after_kill_9(sets, tmp_path):
    data = f"{sets['a']}=0.75,{sets['b']}=0.25"
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(killed, data), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "12").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL and not (killed / "checkpoints" / "24").exists()

    kw = {"model": "micro", "max_steps": 24, "checkpoint.save_steps": 6, "eval_steps": 12, "logging.steps": 6,
          "batch_size": 8, "optimizer.learning_rate": 3e-4, "optimizer.warmup_steps": 4}
    resumed = train(TrainConfig.from_dict({"data": data, "output": str(killed), **kw}), resume=True)
    straight = train(TrainConfig.from_dict({"data": data, "output": str(tmp_path / "straight"), **kw}))
    for x, y in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    timing_free = [[{k: v for k, v in h.items() if k != "tokens_per_second"} for h in r.history]
                   for r in (resumed, straight)]
    assert timing_free[0] == timing_free[1]

    history = straight.history
    for h in history:  # 6 steps of 8 pairs on average (fixed rows): 3/4 of them from a
        assert h["pairs/a"] + h["pairs/b"] == h["pairs"] and 0.6 < h["pairs/a"] / h["pairs"] < 0.9
    assert 0.8 < sum(h["pairs"] for h in history) / (24 * 8) < 1.25
    last = history[-1]
    assert last["eval/a/pairs"] + last["eval/b/pairs"] == last["eval_pairs"] > 0
    n = last["eval_pairs"]
    assert last["eval_accuracy"] == pytest.approx(
        (last["eval/a/accuracy"] * last["eval/a/pairs"] + last["eval/b/accuracy"] * last["eval/b/pairs"]) / n)
    mixture = json.loads((tmp_path / "straight" / "mixture.json").read_text())
    assert [(s["name"], s["share"], s["path"]) for s in mixture["sets"]] == \
        [("a", 0.75, str(sets["a"])), ("b", 0.25, str(sets["b"]))]
    train_a = Manifest.from_json((sets["a"] / "manifest.json").read_text()).splits["train"].records
    assert mixture["sets"][0]["train"] == train_a and mixture["planned_draws"] == 24 * 8
    assert mixture["sets"][0]["passes"] == pytest.approx(144 / train_a)  # a: 3/4 of 192 draws
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.export import export

    # a mixture run exports, its model card saying what it cannot compute for one
    card = (pathlib.Path(export(ExportConfig(run=str(tmp_path / "straight"), output=str(tmp_path / "hf"))))
            / "README.md").read_text()
    assert "not computed for a mixture of data sets" in card and "| eval split |" in card

    # Resuming with other weights changes the trajectory: refused unless allowed
    with pytest.raises(TrainError, match="other sets or weights"):
        train(TrainConfig.from_dict({"data": f"{sets['a']}=0.5,{sets['b']}=0.5", "output": str(killed),
                                     **{**kw, "max_steps": 30}}), resume=True)


def test_sets_preprocessed_unlike_are_refused_naming_them(sets, tmp_path, tokenizer_dir):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
    base = tmp_path / "other"
    base.mkdir()
    other = _set(base, "b", tokenizer_dir, chat_template=str(template))
    with pytest.raises(TrainError, match=r"not preprocessed alike: tokenizer and chat template differ \(a: .*, b: "):
        train(TrainConfig(data={"train": {"a": {"path": str(sets["a"]), "weight": 1},
                                          "b": {"path": str(other), "weight": 1}}},
                          model="micro", output=str(tmp_path / "run"), max_steps=2, batch_size=8))
    assert not (tmp_path / "run" / "checkpoints").exists()
    # the same shards under two names (a link, a copy): trained twice their share, so refused
    (tmp_path / "link").symlink_to(sets["a"])
    with pytest.raises(TrainError, match="sets 'a' and 'link' are the same shards"):
        train(TrainConfig(data=f"{sets['a']}=1,{tmp_path / 'link'}=1", model="micro", output=str(tmp_path / "run2"),
                          max_steps=2, batch_size=8))
    # ... or the same file preprocessed again, with the same options, into another folder
    from rmflow.pipelines.preprocess import run as preprocess

    preprocess(PreprocessConfig(inputs=(str(sets["a"].parent / "a.jsonl"),), output=str(tmp_path / "again"),
                                tokenizer=tokenizer_dir, format="tokenized", max_length=16, eval_fraction=0.1))
    with pytest.raises(TrainError, match="sets 'a' and 'again' are the same shards"):
        train(TrainConfig(data=f"{sets['a']}=1,{tmp_path / 'again'}=1", model="micro", output=str(tmp_path / "run2"),
                          max_steps=2, batch_size=8))
    # another kind of records: named, with what to do (not advice about tokenizers)
    (tmp_path / "k.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "responses": ["a", "bb", "ccc"],
                                                          "scores": [1, 2, 3]}) + "\n" for i in range(8)))
    from rmflow.pipelines.preprocess import run as preprocess

    preprocess(PreprocessConfig(inputs=(str(tmp_path / "k.jsonl"),), output=str(tmp_path / "k"), tokenizer=tokenizer_dir,
                                max_length=128, eval_fraction=0.0))
    with pytest.raises(TrainError, match=r"kind of records differ \(a: 'outcome', k: 'multi-response'\): a run "
                                         "trains on one kind: preprocess the K-response sets with --pairs-from"):
        train(TrainConfig(data=f"{sets['a']}=1,{tmp_path / 'k'}=1", model="micro", output=str(tmp_path / "run3"),
                          max_steps=2, batch_size=8))
    with pytest.raises(TrainError, match="data.eval 'k' holds prompts with K scored responses and this run trains "
                                         "on preference pairs: a run evaluates its own kind"):
        train(TrainConfig.from_dict({"data": {"train": str(sets["a"]), "eval": {"k": str(tmp_path / "k")}},
                                     "model": "micro", "output": str(tmp_path / "run4"), "max_steps": 2,
                                     "batch_size": 8}))


def test_checkpoints_kept_are_the_newest_and_the_best_by_the_metric():
    from rmflow.trainer.checkpoints import steps_to_keep

    history = [{"step": 2, "eval/x/loss": 0.5, "eval_accuracy": 0.7}, {"step": 4, "eval/x/loss": 0.3},
               {"step": 6, "eval/x/loss": float("nan"), "eval_accuracy": 0.9}, {"step": 8, "eval/x/loss": 0.3,
                                                                                  "eval_accuracy": 0.9}]
    steps = [2, 4, 6, 8]
    assert steps_to_keep(steps, history, newest=2) == {6, 8}
    assert steps_to_keep(steps, history, newest=1, metric="eval/x/loss", best=1) == {8, 4}  # lower, ties: earlier
    assert steps_to_keep(steps, history, newest=1, metric="eval/x/loss", best=2) == {8, 4}
    assert steps_to_keep(steps, history, newest=1, metric="eval_accuracy", best=1) == {8, 6}  # higher
    assert steps_to_keep([2, 8], history, newest=1, metric="eval_accuracy", best=1) == {8}  # 6 is gone


@pytest.mark.slow
def test_named_eval_sets_and_the_best_checkpoint_kept_resumed_and_exported(sets, tmp_path):
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.checkpoints import checkpoint_manager, load_trained_model
    from rmflow.trainer.export import export

    from rmflow.eval.sets import preprocess_eval_sets

    run_dir = tmp_path / "run"
    # eval/held/pairs is the same at every eval: ranked by it, the earliest checkpoint is the best, so the
    # kept set is certain to hold one the newest-only rule would delete
    kw = {"data.train": str(sets["a"]), "model": "micro", "output": str(run_dir), "batch_size": 8,
          "optimizer.learning_rate": 3e-4, "optimizer.warmup_steps": 2, "logging.steps": 4, "eval_steps": 4,
          "checkpoint.save_steps": 4, "checkpoint.keep_newest": 1, "checkpoint.metric_for_best": "eval/held/pairs",
          "data.eval": {"held": [str(sets["b"])], "raw": [str(sets["b"].parent / "b.jsonl")]}}
    with pytest.raises(TrainError, match="raw: .*b.jsonl is not a shard folder"):
        train(TrainConfig.from_dict({**kw, "max_steps": 12}))
    cfg = preprocess_eval_sets(TrainConfig.from_dict({**kw, "max_steps": 12}))
    assert cfg.data.eval["raw"] == [str(run_dir / "eval_data" / "raw")]
    result = train(cfg)
    for h in result.history:  # the whole of b, once from its shards, once from its raw file
        assert h["eval/held/pairs"] == h["eval/raw/pairs"] == SIZES["b"]
        assert h["eval/held/accuracy"] == pytest.approx(h["eval/raw/accuracy"])
        assert h["eval_pairs"] < SIZES["a"] // 5  # eval_*: a's own eval split alone
    assert sorted(checkpoint_manager(str(run_dir)).all_steps()) == [4, 12]
    assert load_trained_model(str(run_dir), "best")[2] == 4
    out = export(ExportConfig(run=str(run_dir), output=str(tmp_path / "export"), step="best"))
    assert json.loads(open(os.path.join(out, "rmflow_export.json")).read())["step"] == 4

    # Resumed (a longer run), the tracking goes on from the run's history
    train(dataclasses.replace(cfg, max_steps=20), resume=True, allow_config_change=True)
    assert sorted(checkpoint_manager(str(run_dir)).all_steps()) == [4, 20]

    for bad, words in (({"checkpoint.metric_for_best": "eval/nope/accuracy"},
                        "is not a metric this run's evals log; for example eval_loss"),
                       ({"data.eval": {"x": [str(sets["a"])]}}, "is training data"),
                       ({"data.eval": {"held": [str(sets["b"])]},
                         "data.train": {"a": {"path": str(sets["a"]), "weight": 1},
                                        "held": {"path": str(sets["b"]), "weight": 1}}},
                        "a set of the mixture has this name")):
        with pytest.raises(TrainError, match=words):
            train(TrainConfig.from_dict({**cfg.flat(), "output": str(tmp_path / "other"), **bad}))
    with pytest.raises(ConfigError, match="save_steps 6 must be a multiple of eval_steps 4"):
        TrainConfig.from_dict({**kw, "checkpoint.save_steps": 6})

"""Eval's sanity probes (``rmflow.eval.probes``): each passes on a sound model and scoring path
and fails, with a line that says why, on the failure it is there to catch: a model that prefers
the rejected replies or none, a reward read from a side's place, from padding or from a fixed
position, accuracy that comes from length, style preferred to substance. `rmflow eval` reports
them for pairs and K responses (RM-Bench's style-substance table on its layout)."""

import gzip
import json

import numpy as np
import pytest
from rmflow.schemas.config import EvalConfig
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train

from rmflow.eval import probes


def test_chance_tells_a_working_a_swapped_and_an_untrained_model_apart():
    assert probes.chance_probe(0.7, 500)["passed"]
    below = probes.chance_probe(0.3, 500)
    assert not below["passed"] and "prefers the rejected" in below["line"]
    around = probes.chance_probe(0.52, 200)
    assert not around["passed"] and "untrained" in around["line"] and "too few pairs" in around["line"]


def test_swapped_sides_must_reverse_every_verdict():
    rng = np.random.default_rng(0)
    d = rng.normal(size=300)
    ok = probes.swapped_probe(d, -d + rng.normal(scale=1e-7, size=300), scale=1.0)
    assert ok["passed"] and "1 - " in ok["line"]
    placed = probes.swapped_probe(d, d, scale=1.0)  # the reward of "whatever is first": the verdict stays
    assert not placed["passed"] and placed["pairs_kept"] == 300


def test_the_reward_must_be_read_at_the_last_token():
    rng = np.random.default_rng(0)
    alone = rng.normal(size=32)
    same = alone + 1e-7
    assert probes.last_token_probe(alone, same, np.stack([same, same], 1), alone + 1, 1.0)["passed"]
    padded = probes.last_token_probe(alone, alone + 0.5, np.stack([same, same], 1), alone + 1, 1.0)
    assert not padded["passed"] and "padding or placement" in padded["line"]
    fixed = probes.last_token_probe(alone, same, np.stack([same, same], 1), alone, 1.0)  # read at a fixed place
    assert not fixed["passed"] and "final token" in fixed["line"]


def test_length_controlled_accuracy_sees_through_a_length_only_model():
    rng = np.random.default_rng(0)
    diff = rng.integers(-200, 200, 1000).astype(float)
    length_only = probes.length_probe(diff, diff)  # rewards the longer reply, nothing else
    assert not length_only["passed"] and length_only["controlled"] == pytest.approx(0.5)
    content = probes.length_probe(np.abs(rng.normal(size=1000)) * np.where(rng.random(1000) < 0.8, 1, -1), diff)
    assert content["passed"] and content["controlled"] > 0.7
    assert sum(b["pairs"] for b in content["bins"]) == 1000 and len(content["bins"]) == 5


def test_style_substance_table_and_its_probe():
    # chosen (plain, ..., markdown) then rejected: a model that rewards markdown over correctness
    style_only = [np.array([0.0, 1.0, 2.0, 0.1, 1.1, 2.1])] * 10
    t = probes.style_substance(style_only)
    assert t["normal"] == 0 and t["hard"] == 0 and t["easy"] == 1 and np.asarray(t["table"]).shape == (3, 3)
    assert not probes.style_probe(style_only)["passed"]
    substance = [np.array([5.0, 5.1, 5.2, 0.0, 0.1, 0.2])] * 10
    assert probes.style_probe(substance)["passed"] and probes.style_substance(substance)["hard"] == 1


def test_the_last_token_probe_passes_on_the_real_scoring_path(tmp_path):
    from flax import nnx
    from rmflow.trainer.inference.load import LoadedModel
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer

    from rmflow.scoring.api import RewardModel

    model = RewardTransformer(ModelConfig.micro(300, max_position_embeddings=512), rngs=nnx.Rngs(0))
    rm = RewardModel(LoadedModel(model, tokenizer_dir=None, pad_id=0, description="micro, random"), tokenizer=None)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 300, int(rng.integers(2, 200))) for _ in range(40)]
    p = probes.sequence_probe(rm, seqs, scale=float(rm.score_ids(seqs).std()))
    assert p["passed"], p["line"]


@pytest.fixture(scope="module")
def barely_trained(demo_shards, tmp_path_factory):
    base = tmp_path_factory.mktemp("probes")
    train(TrainConfig(data=str(demo_shards), model="micro", output=str(base / "run"), max_steps=1, batch_size=4))
    return base


def test_eval_reports_each_probe_and_an_untrained_model_fails_loudly(barely_trained, demo_shards):
    from typer.testing import CliRunner

    from rmflow.cli import app

    base = barely_trained
    r = CliRunner().invoke(app, ["eval", "--model", str(base / "run"), "--data", str(demo_shards), "--output",
                                 str(base / "eval")])
    assert r.exit_code == 0, r.output
    m = json.loads((base / "eval" / "eval.json").read_text())["metrics"]
    by = {p["name"]: p for p in m["probes"]}
    assert set(by) == {"better than chance", "swapped labels", "reward at the last token", "length-controlled accuracy"}
    assert not by["better than chance"]["passed"]  # one step of training: no preference to speak of
    assert by["swapped labels"]["passed"] and by["reward at the last token"]["passed"], m["probes"]
    assert "FAIL better than chance" in r.output
    report = (base / "eval" / "report.md").read_text()
    assert "## Sanity probes" in report and "## Accuracy by length difference" in report


def test_rm_bench_records_get_the_style_substance_table(barely_trained, shared_data, tmp_path):
    from rmflow.eval.evaluation import run_eval

    with gzip.open(shared_data / "multi_response" / "rmbench_dev.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(40)]
    # RM-Bench's own layout: prompt, chosen (3 styles), rejected (3 styles)
    src = tmp_path / "rmbench.jsonl"
    src.write_text("".join(json.dumps({"prompt": r["prompt"], "subset": r["domain"],
                                       "chosen": [x for x, c in zip(r["responses"], r["is_chosen"]) if c],
                                       "rejected": [x for x, c in zip(r["responses"], r["is_chosen"]) if not c]}) + "\n"
                           for r in rows))
    m = run_eval(EvalConfig(model=str(barely_trained / "run"), data=(str(src),), output=str(tmp_path / "eval"),
                            mode="responses"))
    by = {p["name"]: p for p in m["probes"]}
    assert set(by) == {"reward at the last token", "style and substance"}
    style = by["style and substance"]
    assert style["prompts"] > 0 and np.asarray(style["table"]).shape == (3, 3)
    assert "## Style and substance (RM-Bench)" in (tmp_path / "eval" / "report.md").read_text()

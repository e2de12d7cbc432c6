"""The regression objectives of K responses per prompt: an attribute head (one output per rated
attribute) fitted to the ratings, the reward the outputs' weighted sum.

* the regression sums and metrics by hand (RMSE and Pearson's r per attribute, padding ignored);
* a run on rated responses through the real preprocess stage learns the ratings, alone and beside
  a ranking loss, packed and one record a row alike; its best checkpoint ranks by a lower-is-better
  error; it evaluates, exports as ``*ForSequenceClassification`` with ``num_labels`` = N, the
  attribute names and weights, scored by transformers as rmflow scores it (1e-4, float32), and
  loads back;
* what cannot train is refused in one line: no ratings kept, weights of an attribute not kept,
  weights without a regression objective.
"""

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from rmflow.trainer.loss import regression_metrics_of_sums, regression_sums

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
NAMES = ("helpfulness", "verbosity")


def test_regression_sums_and_metrics_by_hand():
    rng = np.random.default_rng(0)
    pred, rated = rng.normal(size=(2, 5, 2)), rng.normal(size=(2, 5, 2))
    group = np.array([[1, 1, 1, 2, 2], [1, 1, 0, 0, 0]])  # three records, padding slots last
    sums = {k: np.asarray(v, np.float64) for k, v in regression_sums(jnp.asarray(pred), jnp.asarray(rated),
                                                                     jnp.asarray(group)).items()}
    real = group > 0
    p, y = pred[real], rated[real]  # (7, 2)
    records = [(0, slice(0, 3)), (0, slice(3, 5)), (1, slice(0, 2))]
    assert sums["mse_sum"] == pytest.approx(sum(((pred[r, s] - rated[r, s]) ** 2).mean() for r, s in records), rel=1e-5)
    m = regression_metrics_of_sums({**sums, "prompts": 3.0, "responses": 7.0, "pairs": 0.0, "loss_sum": 0.0,
                                    "rank_loss_sum": 0.0, "center_sum": 0.0, "correct": 0.0, "ties": 0.0,
                                    "best_sum": 0.0, "tau_sum": 0.0, "tau_prompts": 0.0, "reward_sum": 0.0,
                                    "reward_sq_sum": 0.0}, NAMES)
    for j, name in enumerate(NAMES):
        assert m[f"{name}_rmse"] == pytest.approx(np.sqrt(((p[:, j] - y[:, j]) ** 2).mean()), rel=1e-5)
        assert m[f"{name}_pearson"] == pytest.approx(np.corrcoef(p[:, j], y[:, j])[0, 1], rel=1e-4)
    assert m["mse"] == pytest.approx(sums["mse_sum"] / 3)
    flat = regression_metrics_of_sums({**sums, "prompts": 3.0, "responses": 7.0, "attr_pred_m2": np.zeros(2),
                                       "attr_cross_m2": np.zeros(2), **{k: 0.0 for k in (
                                           "pairs", "loss_sum", "rank_loss_sum", "center_sum", "correct", "ties",
                                           "best_sum", "tau_sum", "tau_prompts", "reward_sum", "reward_sq_sum")}}, NAMES)
    assert np.isnan(flat["helpfulness_pearson"])  # outputs that do not vary have no correlation


def test_pearson_merged_over_batches_keeps_its_digits():
    """Outputs that vary little against their mean (10 +- 0.0005), split into uneven batches and
    merged as a run merges them (in float32 on the device within a step, then in float64 on the
    host): Pearson's r and RMSE equal numpy's on all of them in float64 (raw float32 moments would
    cancel to noise here)."""
    from rmflow.trainer.loss import REGRESSION_SUM_KEYS, merge_sums

    rng = np.random.default_rng(1)
    y = rng.normal(size=(60, 1))
    pred = (10.0 + 0.0005 * (0.5 * y + np.sqrt(0.75) * rng.normal(size=(60, 1)))).astype(np.float32)
    truth = np.corrcoef(pred[:, 0].astype(np.float64), y[:, 0])[0, 1]

    def batch(lo, hi):  # one record per slot: (hi - lo) rows of one slot each
        return regression_sums(jnp.asarray(pred[lo:hi, None]), jnp.asarray(y[lo:hi, None], jnp.float32),
                               jnp.ones((hi - lo, 1), jnp.int32))

    cuts = [(0, 7), (7, 30), (30, 31), (31, 60)]
    device = batch(*cuts[0])
    for lo, hi in cuts[1:3]:  # a step's micro-batches: merged by jax on the device
        device = merge_sums(device, batch(lo, hi), REGRESSION_SUM_KEYS)
    host = {k: np.float64(0.0) for k in REGRESSION_SUM_KEYS}
    for part in (device, batch(*cuts[3])):  # steps: merged in float64 on the host
        host = merge_sums(host, {k: np.asarray(v, np.float64) for k, v in part.items()}, REGRESSION_SUM_KEYS)
    m = regression_metrics_of_sums({**host, "prompts": 60.0, "responses": 60.0, **{k: 0.0 for k in (
        "pairs", "loss_sum", "rank_loss_sum", "center_sum", "correct", "ties", "best_sum", "tau_sum", "tau_prompts",
        "reward_sum", "reward_sq_sum")}}, NAMES[:1])
    assert m["helpfulness_pearson"] == pytest.approx(truth, abs=2e-3)
    assert m["helpfulness_rmse"] == pytest.approx(np.sqrt(((pred[:, 0] - y[:, 0]) ** 2).mean()), rel=1e-5)
    assert host["attr_n"] == 60
    # ratings that do not vary, in a batch large enough that a float32 mean rounds: no correlation
    flat = regression_sums(jnp.asarray(rng.normal(size=(1024, 1, 1)), jnp.float32), jnp.full((1024, 1, 1), 0.7),
                           jnp.ones((1024, 1), jnp.int32))
    m = regression_metrics_of_sums({**{k: np.asarray(v, np.float64) for k, v in flat.items()}, "prompts": 1024.0,
                                    "responses": 1024.0, **{k: 0.0 for k in (
        "pairs", "loss_sum", "rank_loss_sum", "center_sum", "correct", "ties", "best_sum", "tau_sum", "tau_prompts",
        "reward_sum", "reward_sq_sum")}}, NAMES[:1])
    assert np.isnan(m["helpfulness_pearson"]) and float(flat["attr_label_m2"][0]) == 0.0


@pytest.fixture(scope="module")
def rated(tmp_path_factory, tokenizer_dir):
    """Prompts with 4 replies of random words, each rated: helpfulness 4 when the reply says
    "excellent" (else 0), verbosity its word count; scored by preprocess's weights."""
    from rmflow.pipelines.preprocess import run
    from rmflow.schemas.config import PreprocessConfig

    base = tmp_path_factory.mktemp("rated")
    rng = np.random.default_rng(0)
    with open(base / "rated.jsonl", "w") as f:
        for i in range(160):
            replies, ratings = [], []
            for j in range(4):
                words = list(rng.choice(WORDS, int(rng.integers(1, 7))))
                if (i + j) % 2:
                    words.insert(int(rng.integers(0, len(words) + 1)), "excellent")
                replies.append(" ".join(words))
                ratings.append({"helpfulness": 4.0 * ("excellent" in words), "verbosity": float(len(words))})
            f.write(json.dumps({"prompt": f"question {i}: {' '.join(rng.choice(WORDS, 3))}?", "responses": replies,
                                "attributes": ratings}) + "\n")
    stats = run(PreprocessConfig(inputs=(str(base / "rated.jsonl"),), output=str(base / "shards"),
                                 tokenizer=tokenizer_dir, max_length=128, eval_fraction=0.2, num_shards=1,
                                 attributes=",".join(NAMES), attribute_weights="helpfulness=1,verbosity=-0.1")).stats
    assert stats["kind"] == "multi-response" and stats["counts"]["errors"] == 0, stats["counts"]
    return base / "shards"


WEIGHTS = "helpfulness=1,verbosity=-0.1"  # the reward's, as preprocessing scored the replies


def _train(shards, out, resume=False, allow_config_change=False, **kw):
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.train import run as train

    return train(TrainConfig.from_dict({"data": str(shards), "model": "micro", "output": str(out), "batch_size": 8,
                                        "seed": 0, "optimizer": {"learning_rate": 3e-3, "warmup_steps": 1},
                                        "logging": {"steps": 5}, **kw}),
                 resume=resume, allow_config_change=allow_config_change)


@pytest.mark.slow
def test_a_regression_run_learns_the_ratings_evaluates_and_exports_with_its_attribute_head(rated, tmp_path):
    import torch
    from rmflow.schemas.config import EvalConfig, ExportConfig
    from rmflow.trainer.export import export
    from rmflow.trainer.inference import load_model, score_sequences
    from transformers import AutoModelForSequenceClassification

    from rmflow.eval.evaluation import run_eval

    result = _train(rated, tmp_path / "run", objective="bradley-terry+regression", max_steps=60, eval_steps=30,
                    attribute_weights=WEIGHTS, checkpoint={"save_steps": 30, "metric_for_best": "eval_helpfulness_rmse"})
    first, last = result.history[0], result.history[-1]
    assert last["helpfulness_rmse"] < 0.6 * first["helpfulness_rmse"]
    assert last["eval_helpfulness_pearson"] > 0.9 and last["eval_verbosity_pearson"] > 0.9, last
    assert load_model(str(tmp_path / "run"), "best").step == 60  # the lower error ranks first
    assert last["eval_accuracy"] > 0.6 and "eval_best_of_k_accuracy" in last
    # packed rows, one record a row, and a step of two micro-batches (their statistics merged on
    # the device) give the same loss and metrics
    runs = {"pack": {"data": {"train": str(rated), "packing": "pack"}},
            "none": {"data": {"train": str(rated), "packing": "none"}},
            "accum": {"data": {"train": str(rated), "packing": "none"}, "batch_size": 4, "grad_accum": 2}}
    losses = {name: _train(rated, tmp_path / f"two-{name}", objective="regression", max_steps=2,
                           attribute_weights=WEIGHTS, **kw).history[-1] for name, kw in runs.items()}
    for other in ("pack", "accum"):
        for key in ("loss", "mse", "helpfulness_rmse", "eval_mse", "helpfulness_pearson", "eval_verbosity_pearson"):
            assert losses[other][key] == pytest.approx(losses["none"][key], abs=1e-5), (other, key)

    m = run_eval(EvalConfig(model=str(tmp_path / "run"), data=(str(rated),), output=str(tmp_path / "eval")))
    assert m["kind"] == "outcome" and m["ranking"]["pair_accuracy"] > 0.6
    attrs = m["ranking"]["attributes"]  # the head's outputs against the held-out ratings
    assert attrs["helpfulness"]["pearson"] == pytest.approx(last["eval_helpfulness_pearson"], abs=1e-3)
    assert attrs["verbosity"]["rmse"] == pytest.approx(last["eval_verbosity_rmse"], rel=1e-3)
    assert "| helpfulness |" in (tmp_path / "eval" / "report.md").read_text()

    folder = export(ExportConfig(run=str(tmp_path / "run"), output=str(tmp_path / "export")))
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["num_labels"] == 2 and config["id2label"] == {"0": "helpfulness", "1": "verbosity"}
    assert config["attribute_weights"] == {"helpfulness": 1.0, "verbosity": -0.1}
    card = (tmp_path / "export" / "README.md").read_text()
    assert "one output per attribute: helpfulness, verbosity" in card and "[1, -0.1]" in card
    assert "an attribute head: one output per attribute (helpfulness, verbosity), the reward their weighted sum " \
           "(helpfulness=1,verbosity=-0.1)" in card and "| `attribute_weights` | helpfulness=1,verbosity=-0.1 |" in card
    loaded = load_model(str(tmp_path / "run"))
    seqs = [np.arange(3, 3 + n) * 7 % 500 + 3 for n in (5, 9, 14)]
    ours = score_sequences(loaded.model, seqs, pad_id=loaded.pad_id)
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        outputs = np.stack([hf(input_ids=torch.tensor([s.tolist()])).logits[0].numpy() for s in seqs])
    np.testing.assert_allclose(outputs @ np.array([1.0, -0.1]), ours, atol=1e-4)
    _scores_its_attributes(tmp_path, folder)
    back = load_model(folder)  # the export read back: the same attribute head
    assert back.model.config.attributes == NAMES and back.kind.name == "outcome"
    np.testing.assert_allclose(score_sequences(back.model, seqs, pad_id=back.pad_id), ours, atol=1e-5)


def test_what_cannot_train_an_attribute_head_is_refused_in_one_line(rated, tmp_path, tokenizer_dir):
    from rmflow.pipelines.preprocess import run
    from rmflow.schemas.config import PreprocessConfig
    from rmflow.schemas.options import ConfigError
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.errors import TrainError

    lines = (rated.parent / "rated.jsonl").read_text().splitlines()[:12]
    (tmp_path / "few.jsonl").write_text("\n".join(lines) + "\n")
    run(PreprocessConfig(inputs=(str(tmp_path / "few.jsonl"),), output=str(tmp_path / "unrated"),
                         tokenizer=tokenizer_dir, max_length=128, eval_fraction=0.0, num_shards=1,
                         attribute_weights="helpfulness=1"))  # scored by a rating, which is not kept
    with pytest.raises(TrainError, match="do not keep: preprocess with --attributes"):
        _train(tmp_path / "unrated", tmp_path / "a", objective="regression", max_steps=3)
    with pytest.raises(TrainError, match="weigh honesty, which the records do not keep"):
        _train(rated, tmp_path / "b", objective="regression", attribute_weights="honesty=1", max_steps=3)
    # responses with scores of their own beside their ratings: the reward's weights must be given
    scored = [{**r, "scores": list(range(len(r["responses"])))} for r in map(json.loads, lines)]
    (tmp_path / "scored.jsonl").write_text("".join(json.dumps(r) + "\n" for r in scored))
    run(PreprocessConfig(inputs=(str(tmp_path / "scored.jsonl"),), output=str(tmp_path / "scored"),
                         tokenizer=tokenizer_dir, max_length=128, eval_fraction=0.0, num_shards=1,
                         attributes=",".join(NAMES)))
    with pytest.raises(TrainError, match="give --attribute-weights NAME=WEIGHT"):
        _train(tmp_path / "scored", tmp_path / "c", objective="regression", max_steps=3)
    # responses scored by their ratings (the manifest says so): the head takes those weights
    _train(rated, tmp_path / "d", objective="regression", max_steps=2)
    assert json.loads((tmp_path / "d" / "model_config.json").read_text())["attribute_weights"] == [1.0, -0.1]
    with pytest.raises(ConfigError, match="objective bradley-terry trains none"):
        TrainConfig.from_dict({"data": "d", "model": "micro", "output": "o", "attribute_weights": "helpfulness=1"})
    with pytest.raises(ConfigError, match="objective 'ridge'"):
        TrainConfig.from_dict({"data": "d", "model": "micro", "output": "o", "objective": "ridge"})


def _scores_its_attributes(tmp_path, model):
    """The API, `rmflow score` and `rmflow serve` give each conversation's attribute outputs by
    name beside its reward (their weighted sum), a K-response line's for each response, its
    prompt computed once, equal to each conversation alone."""
    from rmflow import RewardModel
    from rmflow.scoring.scorers import score_file
    from tests.scoring.test_serve import KEY, Server

    rm = RewardModel.load(str(model))
    assert rm.attributes == NAMES and rm.attribute_weights == {"helpfulness": 1.0, "verbosity": -0.1}
    chats = [[{"role": "user", "content": "question 1: alpha?"}, {"role": "assistant", "content": reply}]
             for reply in ("bravo excellent", "charlie delta echo foxtrot golf", "hotel")]
    rewards, attributes = rm.score(chats), rm.score_attributes(chats)
    for reward, a in zip(rewards, attributes):
        assert reward == pytest.approx(a["helpfulness"] - 0.1 * a["verbosity"], abs=1e-5)
    assert attributes[0]["helpfulness"] > attributes[2]["helpfulness"]  # it says "excellent"
    record = {"prompt": "question 1: alpha?", "responses": [c[1]["content"] for c in chats], "scores": [2, 1, 0]}
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": chats[0]}) + "\n" + json.dumps(record) + "\n")
    score_file(str(model), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))
    one, group = (json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines())
    assert one["attribute_scores"] == pytest.approx(attributes[0], abs=1e-5)
    for got, want in zip(group["response_attribute_scores"], attributes):
        assert got == pytest.approx(want, abs=1e-5)
    server = Server(model, "--max-batch-rows", "4", "--token-budget", "512", env={"RMFLOW_API_KEY": KEY})
    try:
        r = server.post("/v1/score", {"conversations": chats})
        assert r.status_code == 200, r.text
        for got, want in zip(r.json()["attribute_scores"], attributes):
            assert got == pytest.approx(want, abs=1e-5)
        r = server.post("/v1/score", {"responses": [record]})
        assert r.status_code == 200, r.text
        for got, want in zip(r.json()["response_attribute_scores"][0], attributes):
            assert got == pytest.approx(want, abs=1e-5)
    finally:
        server.stop()


def test_a_run_keeps_its_head_and_its_eval_sets_keep_its_ratings(rated, tmp_path, tokenizer_dir):
    """A resume that would train another head (another objective, other ratings) is refused
    before any file of the run changes; a named eval set keeping other ratings is refused; raw
    eval files are preprocessed with the run's ratings; a ranking-only run collates no ratings
    (a mixture of sets keeping different ones trains); an export continues with other weights."""
    from rmflow.trainer.errors import TrainError
    from rmflow.trainer.inference import load_model

    from tests.training.test_listwise import record

    run = tmp_path / "run"
    _train(rated, run, max_steps=2, checkpoint={"save_steps": 2})
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(TrainError, match="score head of 1 output.s.; this config trains one of 2 output.s. "
                                         ".helpfulness, verbosity."):
        _train(rated, run, max_steps=4, objective="regression", attribute_weights=WEIGHTS, resume=True,
               allow_config_change=True)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert load_model(str(run)).step == 2

    raw = rated.parent / "rated.jsonl"
    (tmp_path / "held.jsonl").write_text("\n".join(raw.read_text().splitlines()[:8]) + "\n")
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.train import run as train

    from rmflow.eval.sets import preprocess_eval_sets

    cfg = TrainConfig.from_dict({"data": {"train": str(rated), "eval": {"held": [str(tmp_path / "held.jsonl")]}},
                                 "model": "micro", "output": str(tmp_path / "raw-eval"), "batch_size": 8,
                                 "objective": "regression", "attribute_weights": WEIGHTS, "max_steps": 2,
                                 "optimizer": {"warmup_steps": 1}})
    result = train(preprocess_eval_sets(cfg))  # as rmflow train does: with the run's ratings
    assert result.history[-1]["eval/held/helpfulness_rmse"] >= 0
    with pytest.raises(TrainError, match="keeps the attribute ratings verbosity, helpfulness; the head fits "
                                         "helpfulness, verbosity"):
        from rmflow.pipelines.preprocess import run as preprocess
        from rmflow.schemas.config import PreprocessConfig

        preprocess(PreprocessConfig(inputs=(str(tmp_path / "held.jsonl"),), output=str(tmp_path / "swapped"),
                                    tokenizer=tokenizer_dir, max_length=128, eval_fraction=0.0, num_shards=1,
                                    attributes="verbosity,helpfulness"))
        _train(rated, tmp_path / "swapped-run", objective="regression", attribute_weights=WEIGHTS, max_steps=2,
               data={"train": str(rated), "eval": {"swapped": str(tmp_path / "swapped")}})

    import numpy as np
    from rmflow.trainer.data.response_units import ResponsesCollate
    from rmflow.trainer.objective import objective_for

    rng = np.random.default_rng(0)
    a = record(0, 4, [3, 2], [1.0, 0.0], rng)
    b = dataclasses.replace(record(1, 4, [3, 2], [1.0, 0.0], rng), attributes=np.ones((2, 2)))
    ranking = objective_for("multi-response")
    assert ranking.padded(2, 64)([a, b])["response_attributes"].shape[-1] == 0  # not collated: any ratings mix
    with pytest.raises(ValueError, match="different numbers of attribute ratings"):
        ResponsesCollate(2, 64)([a, b])

    folder = export_of(tmp_path / "run-reg", rated)
    continued = _train(rated, tmp_path / "continued", objective="regression", attribute_weights="helpfulness=2",
                       max_steps=2, model=str(folder))
    assert continued.history[-1]["step"] == 2
    assert json.loads((tmp_path / "continued" / "model_config.json").read_text())["attribute_weights"] == [2.0, 0.0]


def export_of(run, rated):
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.export import export

    _train(rated, run, objective="regression", attribute_weights=WEIGHTS, max_steps=2)
    return export(ExportConfig(run=str(run), output=str(run) + "-export"))


def _strict(path: pathlib.Path):
    """Every JSON text of a file, parsed as strict readers do (jq, JavaScript): no NaN or Infinity."""
    def refuse(name):
        raise AssertionError(f"{path.name}: {name} is not JSON")

    text = path.read_text()
    return [json.loads(x, parse_constant=refuse) for x in text.splitlines() if x.strip()] if path.suffix == ".jsonl" \
        else json.loads(text, parse_constant=refuse)


def test_eval_of_rated_responses_says_which_weights_made_its_labels(rated, tmp_path):
    """Raw responses rated only by attributes are ranked by the model's own weights (its attribute
    head's) unless --attribute-weights names others, and eval.json and report.md say which; a
    response too long for the model is left out and counted, not the end of the eval; --mode
    responses reads shards too; nothing it writes holds NaN."""
    from rmflow.schemas.config import EvalConfig

    from rmflow.eval.evaluation import run_eval

    _train(rated, tmp_path / "run", objective="regression", max_steps=2, attribute_weights="helpfulness=2,verbosity=1")
    lines = (rated.parent / "rated.jsonl").read_text().splitlines()[:20]
    huge = json.loads(lines[0])
    huge["responses"][1] = "word " * 6000  # past the micro preset's 4,096 positions with its prompt
    (tmp_path / "raw.jsonl").write_text("\n".join([json.dumps(huge), *lines[1:]]) + "\n")
    m = run_eval(EvalConfig(model=str(tmp_path / "run"), data=(str(tmp_path / "raw.jsonl"),),
                            output=str(tmp_path / "e1"), mode="responses"))
    assert m["label_weights"] == {"weights": "helpfulness=2,verbosity=1", "from": "the model's attribute head"}
    assert m["ranking"]["prompts"] == 20 and m["ranking"]["responses"] == 79
    assert {"count": 1, "why": "responses too long for max_length with their prompt, left out"} in \
        m["input"]["left_out"]
    report = (tmp_path / "e1" / "report.md").read_text()
    assert "helpfulness=2,verbosity=1 (the model's attribute head)" in report and "1 responses too long" in report
    other = run_eval(EvalConfig(model=str(tmp_path / "run"), data=(str(tmp_path / "raw.jsonl"),),
                                output=str(tmp_path / "e2"), mode="responses", attribute_weights="verbosity=1"))
    assert other["label_weights"]["from"] == "--attribute-weights"
    assert other["ranking"]["scored_pairs"] != m["ranking"]["scored_pairs"]  # other labels, other pairs
    shards = run_eval(EvalConfig(model=str(tmp_path / "run"), data=(str(rated),), output=str(tmp_path / "e3"),
                                 mode="responses"))
    assert shards["label_weights"] == {"weights": WEIGHTS, "from": "the shards' preprocessing"}
    for out in ("e1", "e2", "e3"):
        _strict(tmp_path / out / "eval.json")
    _strict(tmp_path / "run" / "metrics.jsonl")

"""K responses per prompt, trained with the prompt computed once (kind ``responses``).

* the record codec: round trip, corruption refused, lengths read from the header;
* the unit: the prompt once, each response on its own branch, positions continuing from the prompt;
* the attention kernels (blockwise; Pallas in interpret mode) take K branches;
* for every supported architecture, each response's reward, the loss and every gradient of a
  batch, packed or one record a row, equal those of each response run alone with its prompt
  within 1e-5 (float32);
* the listwise losses and their metrics, by hand and against the eval's ranking metrics.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rmflow.schemas.record import RecordCorruptError, ResponsesRecord, decode, encode, peek_lengths
from rmflow.trainer.data.response_units import (
    ResponsesCollate,
    ResponsesPackCollate,
    record_values,
    responses_unit,
)
from rmflow.trainer.loss import listwise_loss, pairwise_loss
from rmflow.trainer.modeling.convert import load_reward_model
from rmflow.trainer.objective import OBJECTIVES, objective_for

from tests.training.test_model_parity import build_hf
from tests.training.test_packing import VOCAB, assert_attention_equals_reference


def record(i, prompt, lengths, scores, rng):
    return ResponsesRecord(prompt_ids=rng.integers(3, VOCAB, prompt),
                           responses=[rng.integers(3, VOCAB, n) for n in lengths],
                           lasts=[prompt + n - 1 for n in lengths], scores=scores, record_id=f"{i:032x}", source="s")


def records(n, rng, prompt=(4, 14), length=(2, 12), k=(2, 6)):
    out = []
    for i in range(n):
        kk = int(rng.integers(*k))
        scores = rng.permutation(kk).astype(float)
        scores[-1] = scores[0]  # a tie in every record of 3 or more
        if len(set(scores)) < 2:
            scores = np.arange(kk, dtype=float)
        out.append(record(i, int(rng.integers(*prompt)), [int(x) for x in rng.integers(*length, kk)], scores, rng))
    return out


def test_a_responses_record_round_trips_and_refuses_corruption():
    rng = np.random.default_rng(0)
    r = record(7, 5, [3, 1, 4], [2.0, -1.0, 0.5], rng)
    with_attrs = ResponsesRecord(r.prompt_ids, r.responses, r.lasts, r.scores, r.record_id, "src", "sub",
                                 attributes=rng.normal(size=(3, 5)), margin_from_scores=True)
    for rec in (r, with_attrs):
        buf = encode(rec)
        assert decode(buf) == rec and peek_lengths(buf) == (5 + 8, 0)
        assert decode(buf).sequence(2).tolist() == rec.prompt_ids.tolist() + rec.responses[2].tolist()
        for at in (10, len(buf) // 2, len(buf) - 5):
            bad = bytearray(buf)
            bad[at] ^= 0xFF
            with pytest.raises(RecordCorruptError):
                decode(bytes(bad))
    assert r.stat_lengths() == {"prompt": 5, "longest": 9, "responses": 3, "tokens": 13}
    for kwargs, match in (({"responses": [[5]]}, "at least 2"), ({"lasts": [0, 9, 0]}, "lasts"),
                          ({"scores": [1.0, float("nan"), 0.0]}, "finite"), ({"responses": [[5], []]}, "no tokens")):
        fields = {"prompt_ids": [1, 2], "responses": [[5], [6], [7]], "lasts": [2, 2, 2], "scores": [1, 0, 2],
                  "record_id": "0" * 32, **kwargs}
        if len(fields["responses"]) != 3 and "lasts" not in kwargs:
            fields["lasts"], fields["scores"] = [2] * len(fields["responses"]), list(range(len(fields["responses"])))
        with pytest.raises(ValueError, match=match):
            ResponsesRecord(**fields)


def test_a_unit_holds_the_prompt_once_and_each_response_on_its_branch():
    rng = np.random.default_rng(1)
    r = record(0, 4, [2, 3, 1], [0.0, 1.0, 2.0], rng)
    u = responses_unit(r)
    assert u.ids.tolist() == r.prompt_ids.tolist() + [t for x in r.responses for t in x.tolist()]
    assert u.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 4]
    assert u.branches.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 3]
    assert u.reward_at.tolist() == [5, 8, 9]
    b = ResponsesPackCollate(2, 64)([r, record(1, 3, [1, 1], [1.0, 0.0], rng)])
    assert b["record_slots"].tolist() == [[0, 0, 3], [0, 3, 2]] and b["reward_index"].shape == (1, 8)
    assert b["response_group"][0].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert b["real_tokens"] == 3 * 4 + 6 + 2 * 3 + 2 and b["computed_tokens"] == 10 + 5
    assert not b["response_margins"].any()  # margins only where a record trains with them
    import dataclasses

    with_margins = ResponsesPackCollate(1, 64)([dataclasses.replace(r, margin_from_scores=True)])
    assert with_margins["response_margins"][0, :3].tolist() == [0.0, 1.0, 2.0]
    one = ResponsesCollate(3, 64)([r])  # a partial batch: empty rows
    assert one["input_ids"].shape == (3, 16) and one["segment_ids"][1:].sum() == 0
    long = record(2, 20, [9, 9, 9], [0.0, 1.0, 2.0], rng)  # 47 tokens as a unit, each conversation 29
    assert ResponsesCollate(1, 32)([long])["input_ids"].shape == (1, 64)  # past max_length: a power of two


@pytest.mark.parametrize("impl,t,block", [("blockwise", 300, 64), ("pallas", 120, 32)])
def test_attention_kernels_take_k_branches(impl, t, block):
    assert_attention_equals_reference(impl, None, t, block, branches=5)


def _alone(model, recs, batch):
    """Each response run alone with its prompt (one sequence a row, no branches), its reward put in
    the slot the batch gives it."""
    seqs = [(r.sequence(i), r.lasts[i]) for r in recs for i in range(r.k)]
    t = max(len(s) for s, _ in seqs)
    ids = np.zeros((len(seqs), t), np.int32)
    seg = np.zeros((len(seqs), t), np.int32)
    for j, (s, _) in enumerate(seqs):
        ids[j, : len(s)], seg[j, : len(s)] = s, 1
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), ids.shape)
    index = np.asarray([[last] for _, last in seqs], np.int32)
    rows = np.asarray([row for row, _, k in batch["record_slots"] for _ in range(k)])
    slots = np.asarray([first + i for _, first, k in batch["record_slots"] for i in range(k)])
    rewards = model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(index), jnp.zeros_like(seg))
    return jnp.zeros(batch["reward_index"].shape, jnp.float32).at[rows, slots].set(rewards[:, 0])


def _loss_and_grads(model, batch, recs, alone):
    arrays = {k: jnp.asarray(v) for k, v in batch.items() if k in objective_for("multi-response").device_keys}

    @nnx.jit(static_argnums=2)
    def run(model, arrays, alone):
        def f(m):
            rewards = _alone(m, recs, batch) if alone else m(*(arrays[k] for k in (
                "input_ids", "positions", "segment_ids", "reward_index", "branch_ids")))
            loss, _ = listwise_loss(rewards, arrays["response_scores"], arrays["response_group"], 0.01,
                                    "plackett-luce")
            bt, _ = listwise_loss(rewards, arrays["response_scores"], arrays["response_group"])
            return loss + bt, rewards

        return nnx.value_and_grad(f, has_aux=True)(model)

    (loss, rewards), grads = run(model, arrays, alone)
    return float(loss), record_values(np.asarray(rewards), batch["record_slots"]), grads


# K responses on branches of one prompt use the rules two replies use (the attention mask and the
# positions of ``test_packing.py``, which checks every family): one family for each way the rules
# meet a family's attention, a window (Mistral; Phi-3 with LongRoPE; Mixtral, with experts),
# rotary on part of each head (Phi-4-mini), soft-capped logits and local then global layers
# (Gemma 2), a RoPE per layer type (Gemma 3), and Llama as the plain case.
BRANCHING = ("llama", "mistral-sliding-window", "phi3-longrope-window", "phi4-mini-partial-rotary", "gemma2",
             "gemma3", "mixtral")


@pytest.mark.parametrize("arch", BRANCHING)
def test_each_response_scores_as_alone_with_its_prompt(arch, tmp_path):
    build_hf(arch, "ForSequenceClassification", tmp_path)
    rng = np.random.default_rng(2)
    recs = records(4, rng)  # prompts long enough to cross Mistral's sliding window (8) from the responses
    reference = load_reward_model(str(tmp_path), attention="xla")
    blockwise = load_reward_model(str(tmp_path), attention="blockwise")
    packed = ResponsesPackCollate(4, 64, rows=2)(recs)
    loss_a, rewards_a, grads_a = _loss_and_grads(reference, packed, recs, alone=True)
    assert np.isfinite(loss_a) and all(np.isfinite(r).all() for r in rewards_a)  # (NaN would equal NaN below)
    for model, batch in ((reference, packed), (blockwise, packed), (blockwise, ResponsesCollate(4, 64)(recs))):
        loss_b, rewards_b, grads_b = _loss_and_grads(model, batch, recs, alone=False)
        assert loss_b == pytest.approx(loss_a, abs=1e-5)
        for a, b in zip(rewards_a, rewards_b):
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
        for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


def _grid(rewards, scores):
    """One record a row: (R, S) rewards, scores and groups."""
    s = max(len(x) for x in rewards)
    r, sc, g = (np.zeros((len(rewards), s), dt) for dt in (np.float32, np.float32, np.int32))
    for i, (a, b) in enumerate(zip(rewards, scores)):
        r[i, : len(a)], sc[i, : len(b)], g[i, : len(a)] = a, b, 1
    return jnp.asarray(r), jnp.asarray(sc), jnp.asarray(g)


def test_at_two_responses_both_ranking_losses_are_the_pairs_loss():
    rng = np.random.default_rng(3)
    rc, rr = rng.normal(size=5).astype(np.float32), rng.normal(size=5).astype(np.float32)
    pair, _ = pairwise_loss(jnp.asarray(rc), jnp.asarray(rr), jnp.zeros(5), jnp.ones(5), 0.05)
    grid = _grid([[c, r] for c, r in zip(rc, rr)], [[1.0, 0.0]] * 5)
    for ranking in ("bradley-terry", "plackett-luce"):
        loss, sums = listwise_loss(*grid, 0.05, ranking)
        assert float(loss) == pytest.approx(float(pair), abs=1e-6)
        assert sums["prompts"] == 5 and sums["pairs"] == 5 and sums["correct"] == (rc > rr).sum()


def test_the_ranking_losses_by_hand():
    r, s = np.array([2.0, 0.5, 1.0, -1.0]), np.array([3.0, 1.0, 1.0, 0.0])  # responses 1 and 2 tie
    log_sig = lambda x: -np.log1p(np.exp(-x))  # noqa: E731
    pairs = [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]
    bt = np.mean([-log_sig(r[i] - r[j]) for i, j in pairs])
    lse = lambda idx: np.log(np.exp(r[idx]).sum())  # noqa: E731
    pl = np.mean([lse([0, 1, 2, 3]) - r[0], lse([1, 2, 3]) - r[1], lse([1, 2, 3]) - r[2]])  # Breslow: 1, 2 share
    grid = _grid([r, [0.3, 0.1]], [s, [1.0, 0.0]])
    other_bt = -log_sig(0.2)
    other_pl = np.log(np.exp(0.3) + np.exp(0.1)) - 0.3
    assert float(listwise_loss(*grid)[0]) == pytest.approx((bt + other_bt) / 2, abs=1e-6)
    assert float(listwise_loss(*grid, 0.0, "plackett-luce")[0]) == pytest.approx((pl + other_pl) / 2, abs=1e-6)
    m = jnp.asarray([[3.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # margins from the first record's scores
    bt_m = np.mean([-log_sig(r[i] - r[j] - (s[i] - s[j])) for i, j in pairs])
    assert float(listwise_loss(*grid, 0.0, "bradley-terry", m)[0]) == pytest.approx((bt_m + other_bt) / 2, abs=1e-6)
    _, sums = listwise_loss(*grid, 1.0)
    center = (2 * r.mean()) ** 2 + (2 * 0.2) ** 2
    assert float(sums["center_sum"]) == pytest.approx(center, abs=1e-5)
    assert sums["pairs"] == 6 and sums["correct"] == 6 and sums["best_sum"] == 2
    with pytest.raises(ValueError, match="ranking loss"):
        listwise_loss(*grid, 0.0, "listnet")


def test_training_metrics_equal_the_eval_s_ranking_metrics():
    from rmflow.trainer.loss import ranking_metrics_of_sums

    from rmflow.eval.figures import ranking_metrics

    rng = np.random.default_rng(4)
    rewards = [np.round(rng.normal(size=k), 1) for k in rng.integers(1, 8, 40)]  # rounded: some reward ties
    scores = [rng.integers(0, 4, len(r)).astype(float) for r in rewards]
    # some prompts have nothing to rank (one response, or all of one score: kept for their ratings):
    # counted as prompts, left out of best-of-K, alike in training and in eval
    assert sum(len(set(s)) < 2 for s in scores) >= 3
    m = ranking_metrics_of_sums({k: float(v) for k, v in listwise_loss(*_grid(rewards, scores))[1].items()})
    ref = ranking_metrics(rewards, scores)  # one rule (schemas.metrics): a reward tie is not right
    assert m["prompts"] == ref["prompts"] and m["pairs"] == ref["scored_pairs"]
    assert m["ties"] > 0 and m["ties"] == pytest.approx(ref["tie_rate"], abs=1e-6)  # ties occur, counted alike
    assert m["accuracy"] == pytest.approx(ref["pair_accuracy"], abs=1e-6)
    assert m["best_of_k_accuracy"] == pytest.approx(ref["best_of_k_accuracy"], abs=1e-6)
    assert m["kendall_tau"] == pytest.approx(ref["kendall_tau"], abs=1e-5)


def test_each_ranking_loss_is_an_objective_and_pairs_take_only_bradley_terry():
    assert objective_for("multi-response").ranking == "bradley-terry"
    assert objective_for("multi-response", "plackett-luce").name == "multi-response:plackett-luce"
    assert OBJECTIVES["multi-response:plackett-luce"] is objective_for("multi-response:plackett-luce")
    with pytest.raises(ValueError, match="applies to K responses"):
        objective_for("outcome", "plackett-luce")


@pytest.mark.slow
def test_real_rm_bench_prompts_preprocess_whole_train_packed_or_not_alike_and_evaluate(tmp_path, tokenizer_dir):
    """30 RM-Bench prompts (6 responses each) from the shared data kept whole: one record a prompt,
    held out as their pairs would be; trained two steps packed and one record a row with the same
    loss; the run evaluated on the shards as rankings and exported as an outcome model."""
    import gzip
    import json
    import pathlib

    import grain
    from rmflow.pipelines.preprocess import run
    from rmflow.schemas.config import EvalConfig, PreprocessConfig
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.model_setup import read_manifest, shard_paths
    from rmflow.trainer.train import run as train

    from rmflow.eval.evaluation import run_eval

    shared = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "multi_response"
    rows = gzip.open(shared / "rmbench_dev.jsonl.gz", "rt").read().splitlines()[::18][:30]
    src = tmp_path / "rmbench.jsonl"
    src.write_text("\n".join(rows) + "\n")
    outs = {}
    for name, extra in (("whole", {"max_responses": 5}), ("pairs", {"pairs_from": "expand"})):
        outs[name] = run(PreprocessConfig(inputs=(str(src),), output=str(tmp_path / name), tokenizer=tokenizer_dir,
                                          max_length=1024, eval_fraction=0.3, num_shards=1, **extra)).stats
    whole = outs["whole"]
    c = whole["counts"]
    assert whole["kind"] == "multi-response" and c["records_read"] == 30 and c["errors"] == 0
    assert c["pairs_written"] + c["dropped_too_long"] == 30 and c["responses_capped"] > 0, c
    assert whole["lengths"]["train"]["responses"]["max"] == 5

    def prompts(folder, split):
        m = read_manifest(str(folder))
        out = set()
        for path in shard_paths(str(folder), m, split):
            for raw in grain.sources.ArrayRecordDataSource([path]):
                rec = decode(raw)
                out.add(tuple(rec.prompt_ids if isinstance(rec, ResponsesRecord) else rec.chosen_ids[:rec.prompt_len]))
        return out

    held_out = prompts(tmp_path / "whole", "eval")
    assert held_out and held_out <= prompts(tmp_path / "pairs", "eval")  # the same prompts held out either way
    assert not held_out & prompts(tmp_path / "whole", "train")
    losses = {}
    for packing in ("pack", "none"):
        result = train(TrainConfig.from_dict({
            "data": {"train": str(tmp_path / "whole"), "packing": packing}, "model": "micro", "max_steps": 2,
            "batch_size": 4, "output": str(tmp_path / f"run-{packing}"), "objective": "plackett-luce",
            "center_rewards_coefficient": 0.01}))
        last = result.history[-1]
        losses[packing] = (last["loss"], last["eval_loss"], last["eval_best_of_k_accuracy"])
        assert last["computed_fraction"] < 0.95  # each prompt computed once, not once per response (1.0)
    assert losses["pack"] == pytest.approx(losses["none"], abs=1e-5)
    # margins (--margin-from-scores) that a Plackett-Luce ranking would never read: refused, not ignored
    import shutil

    from rmflow.trainer.errors import TrainError

    shutil.copytree(tmp_path / "whole", tmp_path / "margins")
    manifest = json.loads((tmp_path / "margins" / "manifest.json").read_text())
    manifest["config"]["margin_from_scores"] = True
    (tmp_path / "margins" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TrainError, match="--margin-from-scores, whose margins objective plackett-luce does not use"):
        train(TrainConfig.from_dict({"data": str(tmp_path / "margins"), "model": "micro", "max_steps": 2,
                                     "output": str(tmp_path / "run-m"), "objective": "plackett-luce"}))
    m = run_eval(EvalConfig(model=str(tmp_path / "run-pack"), data=(str(tmp_path / "whole"),),
                            output=str(tmp_path / "eval"), normalize=True))
    assert m["kind"] == "outcome" and m["ranking"]["prompts"] == len(held_out)
    assert (m["accuracy"], m["pairs"]) == (m["ranking"]["pair_accuracy"], m["ranking"]["scored_pairs"])  # headline
    norm = json.loads((tmp_path / "run-pack" / "reward_normalization.json").read_text())
    assert norm["responses"] == m["ranking"]["responses"] and norm["std"] > 0
    assert 0 <= m["ranking"]["best_of_k_accuracy"] <= 1 and "length_baseline" in m["ranking"]
    assert (tmp_path / "eval" / "ranking.png").stat().st_size > 0
    assert "ranking.png" in (tmp_path / "eval" / "report.md").read_text()
    assert json.loads((tmp_path / "run-pack" / "data_manifest.json").read_text())["kind"] == "multi-response"


def test_scoring_records_computes_each_prompt_once_and_equals_each_conversation_alone():
    import dataclasses

    from rmflow.trainer.inference import score_responses, score_sequences
    from rmflow.trainer.modeling.decoder import RewardTransformer

    from tests.training.test_step import CFG

    rng = np.random.default_rng(5)
    recs = records(7, rng, prompt=(3, 30), length=(1, 20), k=(2, 7))
    model = RewardTransformer(dataclasses.replace(CFG, vocab_size=VOCAB), rngs=nnx.Rngs(0))
    together = score_responses(model, recs, tokens=200)  # several rows of records, and a record alone
    alone = score_sequences(model, [r.sequence(i) for r in recs for i in range(r.k)], batch_size=4)
    assert [len(x) for x in together] == [r.k for r in recs] and np.isfinite(alone).all()
    np.testing.assert_allclose(np.concatenate(together), alone, atol=1e-5, rtol=0)
    # groups of whole conversations (rmflow score's K-response lines): their shared start found and
    # computed once; a group sharing nothing, or a sequence that is all prefix but its last token, too
    from rmflow.trainer.inference import score_groups

    groups = [[r.sequence(i) for i in range(r.k)] for r in recs[:3]]
    groups.append([np.array([5, 6, 7], np.int32), np.array([8, 6], np.int32), np.array([5, 6, 7, 9], np.int32)])
    got, outputs = score_groups(model, groups)
    assert [o.shape for o in outputs] == [(len(g), 1) for g in groups]  # the score head's, one output a sequence
    flat = [s for g in groups for s in g]
    np.testing.assert_allclose(np.concatenate(got), score_sequences(model, flat, batch_size=4), atol=1e-5, rtol=0)

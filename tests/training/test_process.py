"""Process reward models end to end: the stepwise layouts (TRL's ``stepwise_supervised`` and
ProcessBench) through the real preprocess stage into step records, the 2-class step head and its
loss (padded, packed, accumulated, sharded), training that learns a stepwise task, evaluation
(step figures, first-error accuracy, ProcessBench F1), export as ``*ForTokenClassification``
(PyTorch parity) and per-step scoring through the API and ``rmflow score``."""

import gzip
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rmflow.pipelines.preprocess import PreprocessError
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.rendering.formats import BadRecord, CanonicalSteps, detect_format, normalize
from rmflow.rendering.length import TooLong, apply_length_policy_steps
from rmflow.rendering.tokenize import step_token_ends
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.manifest import Manifest
from rmflow.schemas.record import RecordCorruptError, StepRecord, decode, encode, peek_lengths
from rmflow.schemas.train_config import OptimizerConfig, TrainConfig
from rmflow.trainer.batching import stack_micro_batches
from rmflow.trainer.data import StepCollate, StepPackCollate
from rmflow.trainer.data.steps import record_step_values
from rmflow.trainer.inference import score_steps
from rmflow.trainer.loss import step_loss, step_metrics_of_sums
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.objective import PROCESS
from rmflow.trainer.step import Trainer
from rmflow.trainer.train import run as train

from rmflow.eval.figures import process_metrics
from tests import forward

CFG = ModelConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_labels=2)


def step_records(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, 64, 4)
        steps = [rng.integers(3, 64, int(rng.integers(2, 6))) for _ in range(int(rng.integers(1, 6)))]
        ids = np.concatenate([prompt, *steps]).astype(np.int32)
        ends = np.cumsum([len(prompt), *map(len, steps)])[1:] - 1
        labels = (rng.random(len(steps)) < 0.7).astype(np.uint8)
        out.append(StepRecord(ids, ends, labels, 4, f"{i:032x}", "s"))
    return out


# --------------------------------------------------------------------------- record codec


def test_step_record_round_trip_and_integrity():
    for rec in step_records(20) + [StepRecord([1, 2, 3], [2], [0], 1, "ab" * 16, "ü-source", subset="math")]:
        buf = encode(rec)
        assert decode(buf) == rec and peek_lengths(buf) == (len(rec.input_ids), 0)
    rec = step_records(1)[0]
    buf = bytearray(encode(rec))
    buf[45] ^= 1
    with pytest.raises(RecordCorruptError, match="CRC"):
        decode(bytes(buf))
    with pytest.raises(ValueError, match="increase strictly"):
        StepRecord([1, 2, 3, 4], [3, 2], [1, 1], 1, "0" * 32)
    with pytest.raises(ValueError, match="labels"):
        StepRecord([1, 2, 3], [1, 2], [1], 0, "0" * 32)
    with pytest.raises(ValueError, match="0 .incorrect. or 1"):
        StepRecord([1, 2, 3], [2], [2], 0, "0" * 32)
    assert StepRecord([1, 2, 3, 4], [1, 2, 3], [1, 0, 0], 0, "0" * 32).first_error == 1


# --------------------------------------------------------------------------- layouts


def test_stepwise_and_processbench_layouts():
    rec = {"prompt": "p", "completions": ["a", "b", "c"], "labels": [True, True, False]}
    assert detect_format(rec) == "stepwise"
    s = normalize(rec, "stepwise", source="f", line=1)
    assert isinstance(s, CanonicalSteps) and s.prompt == (("user", "p"),) and s.labels == (True, True, False)
    conv = normalize({**rec, "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]},
                     "stepwise", source="f", line=1)
    assert conv.prompt == (("system", "s"), ("user", "p")) and conv.pair_id != s.pair_id
    for bad, code in (({**rec, "labels": [True]}, "label_count"),
                      ({**rec, "completions": ["a", None, "c"]}, "bad_type"),
                      ({**rec, "completions": ["a", " ", "c"]}, "empty_step"), ({**rec, "completions": []}, "no_steps"),
                      ({**rec, "labels": [1, 2, 0]}, "bad_label")):
        with pytest.raises(BadRecord) as e:
            normalize(bad, "stepwise", source="f", line=1)
        assert e.value.code == code
    pb = {"id": "x", "problem": "q", "steps": ["a", "b", "c", "d"], "label": 1, "final_answer_correct": False}
    assert detect_format(pb) == "processbench"
    s = normalize(pb, "processbench", source="f", line=1)
    assert s.steps == ("a", "b") and s.labels == (True, False)  # no label exists after the first wrong step
    assert normalize({**pb, "label": -1}, "processbench", source="f", line=1).labels == (True,) * 4
    with pytest.raises(BadRecord, match="not -1 or the index"):
        normalize({**pb, "label": 4}, "processbench", source="f", line=1)


def test_step_token_ends():
    offsets = [(0, 3), (3, 5), (5, 6), (6, 9), (9, 10), (10, 14)]
    assert step_token_ends([6, 10], offsets, 1).tolist() == [2, 4]
    assert step_token_ends([7, 14], offsets, 1).tolist() == [2, 5]  # a token crossing the end is not used
    with pytest.raises(BadRecord, match="no token of its own"):
        step_token_ends([6, 6], offsets, 1)
    with pytest.raises(BadRecord, match="no token of its own"):
        step_token_ends([3], offsets, 1)  # inside the prompt


def test_length_policy_for_steps():
    ids, ends = np.arange(20, dtype=np.int32), np.array([12, 16, 19], np.int32)
    same = apply_length_policy_steps(ids, ends, 10, 2, 20, "drop")
    assert same[0] is ids and same[2] == 10
    with pytest.raises(TooLong, match="20 tokens"):
        apply_length_policy_steps(ids, ends, 10, 2, 16, "drop")
    cut, new_ends, prompt_len = apply_length_policy_steps(ids, ends, 10, 2, 16, "truncate-prompt")
    assert len(cut) == 16 and prompt_len == 6 and new_ends.tolist() == [8, 12, 15]
    assert cut[new_ends].tolist() == ids[ends].tolist() and cut[:2].tolist() == [0, 1]
    with pytest.raises(TooLong) as e:
        apply_length_policy_steps(ids, ends, 10, 2, 9, "truncate-prompt")
    assert e.value.code == "steps_too_long"


# --------------------------------------------------------------------------- preprocess on real data


@pytest.fixture(scope="module")
def prm800k(shared_data, tmp_path_factory, tokenizer_dir):
    """The first 300 PRM800K phase-1 test solutions through the real preprocess stage."""
    base = tmp_path_factory.mktemp("prm800k")
    with gzip.open(shared_data / "prm800k_phase1_test.stepwise.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = list(itertools.islice(f, 300))
    (base / "prm.jsonl").write_text("".join(lines), encoding="utf-8")
    result = preprocess(PreprocessConfig(inputs=(str(base / "prm.jsonl"),), output=str(base / "shards"),
                                         tokenizer=tokenizer_dir, max_length=512, eval_fraction=0.1))
    return base, lines, result


def _read_all(folder):
    import grain

    manifest = Manifest.from_json((folder / "manifest.json").read_text())
    paths = [str(folder / s.file) for split in manifest.splits.values() for s in split.shards]
    source = grain.sources.ArrayRecordDataSource(paths)
    return manifest, [decode(source[i]) for i in range(len(source))]


def test_real_stepwise_data_becomes_step_records(prm800k, hf_tokenizer):
    base, lines, result = prm800k
    c = result.stats["counts"]
    assert result.manifest.kind == "process" and result.stats["kind"] == "process"
    assert c["records_read"] == 300
    assert c["pairs_written"] + c["dropped_too_long"] + c["errors"] + c["duplicates"] + c["ties"] == 300
    errors = [json.loads(x) for x in (base / "shards" / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == 300 - c["pairs_written"]
    assert {e["code"] for e in errors if e["category"] == "error"} <= {"bad_type"}  # real rows with a null step
    manifest, records = _read_all(base / "shards")
    assert len(records) == c["pairs_written"] and all(isinstance(r, StepRecord) for r in records)
    assert sum(len(r.step_ends) for r in records) == c["steps_written"]
    assert sum(int((r.step_labels == 0).sum()) for r in records) == c["incorrect_steps"] > 0
    assert all(len(r.input_ids) <= 512 for r in records)
    # Every step's scoring token closes exactly that step and its separator: the text up to it
    # ends with the step, and the step before it does not reach past it.
    by_id = {}
    for i, line in enumerate(lines, 1):
        try:
            s = normalize(json.loads(line), "stepwise", source="prm.jsonl", line=i)
            by_id[s.pair_id] = s
        except BadRecord:
            pass
    for r in records[:60]:
        s = by_id[r.record_id]
        assert [bool(x) for x in r.step_labels] == list(s.labels)
        for step, end in zip(s.steps, r.step_ends):
            text = hf_tokenizer.decode(r.input_ids[: end + 1])
            assert text.endswith(step + "\n"), (step, text[-80:])


def test_mixing_pairs_and_steps_is_refused(tmp_path, tokenizer_dir):
    (tmp_path / "steps.jsonl").write_text(json.dumps({"prompt": "p", "completions": ["a"], "labels": [True]}) + "\n")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(PreprocessError, match="mix preference pairs .1 written. and stepwise solutions .1 written."):
        preprocess(PreprocessConfig(inputs=(str(tmp_path / "*.jsonl"),), output=str(tmp_path / "out"),
                                    tokenizer=tokenizer_dir, eval_fraction=0.0))
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- head, loss, batches


def test_step_loss_and_metrics_from_exact_counts():
    logits = jnp.array([[[0.0, 2.0], [1.0, -1.0], [0.3, 0.2], [5.0, 5.0]]])  # P(correct): .88 .12 .48 .5
    labels = jnp.array([[1, 0, 1, 1]])
    weight = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    loss, sums = step_loss(logits, labels, weight)
    p = jax.nn.softmax(logits, -1)[0, :3, 1]
    expected = -np.mean([np.log(p[0]), np.log(1 - p[1]), np.log(p[2])])
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    m = step_metrics_of_sums({k: float(v) for k, v in sums.items()})
    # predicted incorrect: steps 1 and 2; truly incorrect: step 1 -> tp 1, fp 1, fn 0
    assert m["steps"] == 3 and m["step_accuracy"] == pytest.approx(2 / 3)
    assert (m["incorrect_precision"], m["incorrect_recall"], m["incorrect_f1"]) == pytest.approx((0.5, 1.0, 2 / 3))


def test_packed_steps_equal_one_solution_a_row():
    model = RewardTransformer(CFG, rngs=nnx.Rngs(0))
    recs = step_records(7, seed=3)
    padded = StepCollate(8, 64)(recs)
    packed = StepPackCollate(8, 64, rows=2)(recs)
    assert packed["input_ids"].size < padded["input_ids"].size

    def probs(b):
        out = jax.nn.softmax(forward.logits(model, *(jnp.asarray(b[k]) for k in (
            "input_ids", "positions", "segment_ids", "reward_index", "branch_ids"))), -1)
        return record_step_values(np.asarray(out[..., 1]), b["record_steps"])

    for a, b, r in zip(probs(padded), probs(packed), recs):
        assert len(a) == len(r.step_ends)
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(score_steps(model, recs, batch_size=3)),
                               np.concatenate(probs(padded)), atol=1e-5)
    # the labels reach the slots of their steps
    for b in (padded, packed):
        got = record_step_values(b["step_labels"], b["record_steps"])
        assert all(np.array_equal(g, r.step_labels) for g, r in zip(got, recs))
        assert b["step_weight"].sum() == sum(len(r.step_ends) for r in recs)


def test_process_gradient_accumulation_equals_one_big_batch():
    recs = step_records(8, seed=1)

    def fresh():
        return Trainer(RewardTransformer(CFG, rngs=nnx.Rngs(0)), OptimizerConfig(learning_rate=1e-3), total_steps=10,
                       objective=PROCESS)

    t = fresh()
    big, m_big = t.train_step(t.init_state, stack_micro_batches([StepCollate(8, 64)(recs)], PROCESS))
    t = fresh()  # micro-batches of different step slot counts, padded to one S
    micro = [StepCollate(3, 64)(recs[i:i + 3]) for i in range(0, 8, 3)]
    acc, m_acc = t.train_step(t.init_state, stack_micro_batches(micro, PROCESS))
    for a, b in zip(jax.tree.leaves(big.params), jax.tree.leaves(acc.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert float(m_big["steps"]) == float(m_acc["steps"]) == sum(len(r.step_ends) for r in recs)
    with pytest.raises(ValueError, match="score head of 2"):
        Trainer(RewardTransformer(ModelConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0)), OptimizerConfig(),
                objective=PROCESS)


SHARDED = '''
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tests.training.test_process import CFG, step_records
from rmflow.trainer.data import StepCollate, StepPackCollate
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.objective import PROCESS
from rmflow.trainer.parallel import make_mesh
from rmflow.trainer.parallel.mesh import BATCH_AXES
from rmflow.trainer.batching import stack_micro_batches
from rmflow.schemas.train_config import OptimizerConfig
from rmflow.trainer.step import Trainer

def fresh():
    return Trainer(RewardTransformer(CFG, rngs=nnx.Rngs(0)), OptimizerConfig(learning_rate=1e-3), total_steps=5,
                   objective=PROCESS)

for collate in (StepCollate(8, 64), StepPackCollate(8, 64, rows=8)):
    batches = [stack_micro_batches([collate(step_records(8, seed=s))], PROCESS) for s in range(3)]
    t = fresh()
    ref = t.init_state
    for b in batches:
        ref, m_ref = t.train_step(ref, {k: jnp.asarray(v) for k, v in b.items()})
    mesh = make_mesh((2, 4, 1))
    t = fresh()
    state = t.use_mesh(mesh)
    for b in batches:
        state, m = t.train_step(state, jax.device_put(b, NamedSharding(mesh, P(None, BATCH_AXES))))
    assert abs(float(m["loss_sum"]) - float(m_ref["loss_sum"])) < 1e-4
    for a, c in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5, rtol=0)
    print(type(collate).__name__, "ok")
'''


@pytest.mark.slow
def test_process_training_on_a_mesh_equals_one_device():
    from tests.training.test_parallel import run_8_devices

    out = run_8_devices(SHARDED)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "StepCollate ok" in out.stdout and "StepPackCollate ok" in out.stdout


def test_process_metrics_first_error_and_processbench_f1():
    # solution 0: error at step 1, found at 1; solution 1: error at 2, flagged at 0 (too early);
    # solution 2: all correct, none flagged; solution 3: all correct, one flagged.
    p = [np.array([.9, .2, .1]), np.array([.4, .9, .3]), np.array([.8, .7]), np.array([.9, .45])]
    y = [np.array([1, 0, 0]), np.array([1, 1, 0]), np.array([1, 1]), np.array([1, 1])]
    m = process_metrics(p, y, subsets=["a", "a", "b", "b"])
    assert (m["solutions"], m["with_error"], m["all_correct"]) == (4, 2, 2)
    assert m["first_error_accuracy"] == 0.5
    assert (m["accuracy_with_error"], m["accuracy_all_correct"]) == (0.5, 0.5) and m["processbench_f1"] == 0.5
    assert m["confusion"] == {"true_incorrect": 3, "false_incorrect": 2, "missed_incorrect": 0, "true_correct": 5}
    assert m["step_accuracy"] == 0.8 and m["incorrect_recall"] == 1.0 and m["incorrect_precision"] == 0.6
    assert m["subsets"]["a"]["accuracy_all_correct"] is None and m["subsets"]["a"]["processbench_f1"] is None
    assert m["subsets"]["b"]["first_error_accuracy"] == 0.5


# --------------------------------------------------------------------------- train, eval, export, score

WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "table", "music", "light", "paper", "horse", "glass"]


@pytest.fixture(scope="module")
def synthetic_steps(tmp_path_factory, tokenizer_dir):
    """Stepwise solutions whose first wrong step contains the word "wrong"; every later step is
    wrong too (as in Math-Shepherd): a step's label depends on the steps before it."""
    base = tmp_path_factory.mktemp("steps")
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(700):
        n = int(rng.integers(2, 6))
        steps = [" ".join(rng.choice(WORDS, int(rng.integers(2, 5)))) for _ in range(n)]
        first = int(rng.integers(0, n)) if rng.random() < 0.5 else n
        if first < n:
            words = steps[first].split()
            words.insert(int(rng.integers(0, len(words) + 1)), "wrong")
            steps[first] = " ".join(words)
        rows.append({"prompt": " ".join(rng.choice(WORDS, 3)), "completions": steps,
                     "labels": [i < first for i in range(n)]})
    with open(base / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    preprocess(PreprocessConfig(inputs=(str(base / "train.jsonl"),), output=str(base / "shards"),
                                tokenizer=tokenizer_dir, max_length=128, eval_fraction=0.15, dedup=True))
    return base


@pytest.fixture(scope="module")
def process_run(synthetic_steps):
    cfg = TrainConfig(data=str(synthetic_steps / "shards"), model="micro", output=str(synthetic_steps / "run"),
                      batch_size=16, optimizer={"learning_rate": 2e-3, "warmup_steps": 10}, max_steps=60,
                      eval_steps=60, checkpoint={"save_steps": 60}, logging={"steps": 20},
                      seed=0)  # enough steps for every eval figure to reach 1.0
    return train(cfg), synthetic_steps / "run"


@pytest.mark.slow
def test_a_process_model_learns_a_stepwise_task(process_run):
    result, _ = process_run
    last = result.history[-1]
    assert last["eval_steps"] > 100
    assert last["eval_step_accuracy"] > 0.95 and last["eval_incorrect_f1"] > 0.9, last
    assert last["step_accuracy"] > 0.9 and "accuracy" not in last  # a process run logs step figures


@pytest.mark.slow
def test_eval_export_and_score_agree(process_run, synthetic_steps, tmp_path):
    import torch
    from rmflow.schemas.config import EvalConfig, ExportConfig
    from rmflow.trainer.export import export
    from transformers import AutoModelForTokenClassification

    from rmflow import RewardModel as API
    from rmflow.eval.evaluation import load_model, run_eval
    from rmflow.scoring.scorers import score_file

    _, run_dir = process_run
    m = run_eval(EvalConfig(model=str(run_dir), data=(str(synthetic_steps / "shards"),), output=str(tmp_path / "eval")))
    assert m["kind"] == "process" and m["first_error_accuracy"] > 0.9 and m["processbench_f1"] > 0.9, m
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "ProcessBench F1" in report and (tmp_path / "eval" / "step_scores.png").exists()

    out = export(ExportConfig(run=str(run_dir), output=str(tmp_path / "export")))
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and config["num_labels"] == 2
    assert config["id2label"] == {"0": "incorrect", "1": "correct"}
    hf = AutoModelForTokenClassification.from_pretrained(out).eval()
    ours = load_model(str(run_dir)).model
    _, records = _read_all(synthetic_steps / "shards")
    records = records[:12]
    # Ours: the 12 solutions as one right-padded batch (one shape to run, not twelve); the padding is
    # its own segment after each solution, so no real token sees it.
    width, slots = max(len(r.input_ids) for r in records), max(len(r.step_ends) for r in records)
    ids, segments = np.zeros((len(records), width), np.int32), np.zeros((len(records), width), np.int32)
    ends = np.zeros((len(records), slots), np.int32)
    for i, r in enumerate(records):
        ids[i, :len(r.input_ids)], segments[i, :len(r.input_ids)] = r.input_ids, 1
        ends[i, :len(r.step_ends)] = r.step_ends
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
    mine_all = np.asarray(forward.logits(ours, *map(jnp.asarray, (ids, positions, segments, ends))))
    for r, mine in zip(records, mine_all):
        with torch.no_grad():
            theirs = hf(torch.tensor(r.input_ids[None].astype(np.int64))).logits[0].numpy()[r.step_ends]
        np.testing.assert_allclose(mine[:len(r.step_ends)], theirs, atol=1e-4)

    # Per-step scores: the API, the CLI's file scoring and the run directory agree (rmflow loads the
    # exported TokenClassification checkpoint too).
    rows = [json.loads(x) for x in (synthetic_steps / "train.jsonl").read_text().splitlines()[:20]]
    api = API.load(out)
    api_scores = api.score_steps(rows, batch_size=4)
    by_run = score_steps(ours, [StepRecord(*api.encode_steps(r), np.ones(len(r["completions"])), 0, "0" * 32)
                                for r in rows[:4]])
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                       + json.dumps({"prompt": "p", "completions": []}) + "\n")
    counts = score_file(out, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))
    assert counts == {"scored": 20, "errors": 1}
    scored = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    right = 0
    for a, b in zip(api_scores, by_run):  # the run directory's model (loaded above) scores alike
        np.testing.assert_allclose(a, b, atol=1e-5)
    for row, a, s in zip(rows, api_scores, scored):
        assert len(a) == len(row["completions"]) and s["labels"] == row["labels"]
        np.testing.assert_allclose(s["step_scores"], a, atol=1e-6)
        truth = row["labels"].index(False) if False in row["labels"] else -1
        right += s["first_error"] == truth
    assert right >= 18 and scored[-1]["error"] == "'completions' has no steps"


def test_kinds_are_not_mixed_up(process_run, synthetic_steps, demo_shards, tmp_path):
    from rmflow.schemas.config import EvalConfig
    from rmflow.trainer.errors import TrainError

    from rmflow import RewardModel as API
    from rmflow.eval.evaluation import EvalError, run_eval
    from rmflow.scoring.api import BadConversation, WrongModelKind

    _, run_dir = process_run
    with pytest.raises(EvalError, match="holds preference pairs, which an outcome reward model .* scores; .* is a "
                       "process reward model .*: evaluate it on stepwise solutions"):
        run_eval(EvalConfig(model=str(run_dir), data=(str(demo_shards),), output=str(tmp_path / "e1")))
    for mode in ("rewardbench-v1", "rewardbench-v2"):  # outcome modes: refused before any data is read
        with pytest.raises(EvalError, match=f"--mode {mode} do not apply to .*a process reward model"):
            run_eval(EvalConfig(model=str(run_dir), data=(str(synthetic_steps / "shards"),), output=str(tmp_path / "e2"),
                                mode=mode))
    with pytest.raises(EvalError, match="--mode pairs and --normalize do not apply"):
        run_eval(EvalConfig(model=str(run_dir), data=(str(synthetic_steps / "shards"),), output=str(tmp_path / "e2"),
                            normalize=True))
    with pytest.raises(TrainError, match="center_rewards_coefficient applies to pairwise .outcome. reward models"):
        train(TrainConfig(data=str(synthetic_steps / "shards"), model="micro", output=str(tmp_path / "r"),
                          max_steps=1, center_rewards_coefficient=0.01))
    # An exported process model is a 2-class token classifier: it cannot start an outcome model.
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.export import export
    from rmflow.trainer.modeling.convert import CheckpointError

    prm = export(ExportConfig(run=str(run_dir), output=str(tmp_path / "prm")))
    with pytest.raises(CheckpointError, match="is a process reward model .P.correct. for each step of a solution., but this run trains "
                       "an outcome reward model"):
        train(TrainConfig(data=str(demo_shards), model=prm, output=str(tmp_path / "o"), max_steps=1))
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rm = API.load(str(run_dir))
    assert rm.kind == "process"
    for method, args in (("score", ([conv],)), ("score_pairs", ([conv], [conv])), ("score_ids", ([[1, 2]],))):
        with pytest.raises(WrongModelKind, match=f"{method}: this is a process reward model.*score_steps"):
            getattr(rm, method)(*args)
    with pytest.raises(BadConversation, match="solution 0: 'prompt' is empty"):
        rm.score_steps([{"prompt": " ", "completions": ["a"]}])


def test_processbench_raw_file_eval(process_run, shared_data, tmp_path):
    from rmflow.schemas.config import EvalConfig

    from rmflow.eval.evaluation import run_eval

    _, run_dir = process_run
    with gzip.open(shared_data / "processbench_gsm8k.jsonl.gz", "rt", encoding="utf-8") as f:
        every = [json.loads(x) for x in f]
    rows = [r for r in every if r["label"] >= 0][:30] + [r for r in every if r["label"] < 0][:30]
    (tmp_path / "pb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = run_eval(EvalConfig(model=str(run_dir), data=(str(tmp_path / "pb.jsonl"),), output=str(tmp_path / "eval")))
    assert m["input"]["counts"]["pairs_written"] == 60 == m["solutions"]  # the tiny model's 4,096 positions hold all
    assert m["with_error"] == 30 == m["all_correct"]
    # steps up to the labelled first error (none labelled after it), or all of a correct solution's
    assert m["steps"] == sum(r["label"] + 1 if r["label"] >= 0 else len(r["steps"]) for r in rows)
    assert m["incorrect_steps"] == m["with_error"]
    acc_err, acc_ok = m["accuracy_with_error"], m["accuracy_all_correct"]
    assert m["processbench_f1"] == pytest.approx(2 * acc_err * acc_ok / (acc_err + acc_ok) if acc_err + acc_ok else 0)


@pytest.mark.slow
def test_lora_process_model_exports_a_token_classification_adapter(synthetic_steps, tmp_path):
    import peft
    import torch
    import transformers
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.checkpoints import load_trained_model
    from rmflow.trainer.export import export

    run_dir = tmp_path / "lora"
    train(TrainConfig(data=str(synthetic_steps / "shards"), model="micro", output=str(run_dir), batch_size=8, optimizer={"learning_rate": 3e-3}, max_steps=6, checkpoint={"save_steps": 6}, logging={"steps": 6}, seed=0, lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    model, _, _ = load_trained_model(str(run_dir))
    _, records = _read_all(synthetic_steps / "shards")
    r = records[0]
    ids = jnp.asarray(r.input_ids[None])
    ours = np.asarray(forward.logits(model, ids, jnp.arange(ids.shape[1])[None], jnp.ones_like(ids),
                                     jnp.asarray(r.step_ends[None])))[0]
    merged = export(ExportConfig(run=str(run_dir), output=str(tmp_path / "merged")))
    hf = transformers.AutoModelForTokenClassification.from_pretrained(merged).eval()
    folder = export(ExportConfig(run=str(run_dir), output=str(tmp_path / "adapter"), adapter=True))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["task_type"] == "TOKEN_CLS" and cfg["modules_to_save"] == ["score"]
    base = transformers.AutoModelForTokenClassification.from_pretrained(
        os.path.join(folder, cfg["base_model_name_or_path"]))  # relative to the export (a preset's base, beside it)
    peft_model = peft.PeftModel.from_pretrained(base, folder).eval()
    tokens = torch.tensor(r.input_ids[None].astype(np.int64))
    with torch.no_grad():
        for m in (hf, peft_model):
            np.testing.assert_allclose(m(tokens).logits[0].numpy()[r.step_ends], ours, atol=1e-4)


@pytest.mark.slow
def test_the_workflow_runs_a_process_model(synthetic_steps, tmp_path, tokenizer_dir):
    from rmflow.workflow import Workflow, run

    lines = (synthetic_steps / "train.jsonl").read_text().splitlines()[:80]
    (tmp_path / "steps.jsonl").write_text("\n".join(lines) + "\n")
    wf = Workflow.from_dict({
        "output": str(tmp_path / "out"),
        "preprocess": {"inputs": [str(tmp_path / "steps.jsonl")], "tokenizer": tokenizer_dir, "max_length": 128,
                       "eval_fraction": 0.25},
        "train": {"model": "micro", "max_steps": 3, "batch_size": 4, "logging": {"steps": 1}},
        "eval": {"split": "eval"}, "export": True})
    logs = []
    assert run(wf, log=logs.append) == {"preprocess": "ran", "train": "ran", "eval": "ran", "export": "ran"}
    assert any("step accuracy" in m for m in logs)
    assert json.loads((tmp_path / "out" / "export" / "config.json").read_text())["num_labels"] == 2
    assert "ProcessBench F1" in (tmp_path / "out" / "eval" / "report.md").read_text()

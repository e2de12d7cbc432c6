"""An ensemble of score heads on one backbone (``ensemble.members``, ``schemas.heads.ENSEMBLE``):

* its loss is the mean of its members' Bradley-Terry losses (and listwise losses), each member's
  head drawn apart; its metrics are the reward's;
* a run trains, evaluates (each member against the reward, the disagreement's AUROC), scores
  with the members' rewards, their mean and spread beside the reward, in the API, `rmflow score`
  and `rmflow serve` (whose OpenRLHF endpoint returns the reward it was started with), gives the
  reward asked (mean, min, lcb:LAMBDA), and exports one multi-output checkpoint that transformers
  scores as rmflow does, whose card says what it holds;
* what cannot be an ensemble is refused in one line.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rmflow.schemas.options import ConfigError
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train

from tests.scoring.test_serve import Server

CONVS = [[{"role": "user", "content": f"Tell me about item {i}."},
          {"role": "assistant", "content": "It is fine. " * (1 + i % 5)}] for i in range(12)]


def test_the_loss_is_the_mean_of_the_members_and_the_metrics_the_reward_s():
    import dataclasses

    from flax import nnx
    from rmflow.trainer.loss import pairwise_loss
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.objective import OUTCOME

    cfg = dataclasses.replace(ModelConfig.micro(100), num_labels=3, members=3)
    model = RewardTransformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 100, (4, 16)), jnp.int32)
    batch = {"input_ids": ids, "positions": jnp.broadcast_to(jnp.arange(16), (4, 16)),
             "segment_ids": jnp.ones((4, 16), jnp.int32), "branch_ids": jnp.zeros((4, 16), jnp.int32),
             "reward_index": jnp.asarray([15, 12, 9, 14]), "margin": jnp.zeros(2), "weight": jnp.ones(2)}
    loss, sums = OUTCOME.loss(model, batch, 0.1)
    out = np.asarray(model.logits(*(batch[k] for k in ("input_ids", "positions", "segment_ids", "reward_index",
                                                        "branch_ids")))).reshape(2, 2, 3)
    assert len(set(np.round(out[0, 0], 6))) == 3  # each member's head drawn apart
    each = [pairwise_loss(jnp.asarray(out[:, 0, m]), jnp.asarray(out[:, 1, m]), batch["margin"], batch["weight"],
                          0.1)[1] for m in range(3)]
    assert float(loss) == pytest.approx(np.mean([s["bt_loss_sum"] + 0.1 * s["center_sum"] for s in each]), rel=1e-5)
    assert float(sums["chosen_sum"]) == pytest.approx(out[:, 0].mean(-1).sum(), rel=1e-5)  # the reward: the mean
    grads = nnx.grad(lambda m: OUTCOME.loss(m, batch, 0.1)[0])(model)
    assert all(np.abs(np.asarray(grads.score.kernel[...]))[:, m].sum() > 0 for m in range(3))  # each member learns
    assert jax.tree.leaves(grads)


def test_a_bootstrap_gives_each_member_its_own_fixed_resample_of_the_pairs():
    import dataclasses

    from flax import nnx
    from rmflow.schemas.record import PairRecord
    from rmflow.trainer.data import PackCollate
    from rmflow.trainer.loss import pairwise_loss
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.objective import OUTCOME, bootstrap_weights

    def random_pairs(n, rng, vocab):
        out = []
        for _ in range(n):
            p = rng.integers(3, vocab, int(rng.integers(2, 8)))
            c, r = (np.r_[p, rng.integers(3, vocab, int(rng.integers(1, 9)))].astype(np.int32) for _ in range(2))
            out.append(PairRecord(c, r, len(c) - 1, len(r) - 1, len(p), rng.bytes(16).hex(), "s"))
        return out

    keys = jnp.arange(20000, dtype=jnp.int32) * 7919
    w = np.asarray(bootstrap_weights(keys, 3))
    assert w.shape == (20000, 3) and abs(w.mean() - 1) < 0.03 and abs(w.var() - 1) < 0.05  # Poisson(1)
    assert (w == 0).mean() == pytest.approx(np.exp(-1), abs=0.02)  # about 37% of pairs left out of each member
    assert not np.array_equal(w[:, 0], w[:, 1])  # each member its own resample...
    np.testing.assert_array_equal(w, np.asarray(bootstrap_weights(keys, 3)))  # ...the same every time

    model = RewardTransformer(dataclasses.replace(ModelConfig.micro(64), num_labels=3, members=3), rngs=nnx.Rngs(0))
    pairs = random_pairs(6, np.random.default_rng(0), vocab=64)
    b = PackCollate(6, 128)(pairs)
    assert len(set(b["pair_key"][b["weight"] > 0].tolist())) == 6
    mb = {k: jnp.asarray(v) for k, v in b.items() if k in OUTCOME.device_keys}
    boot = dataclasses.replace(OUTCOME, loss=__import__("functools").partial(OUTCOME.loss, bootstrap=True))
    loss, _ = boot.loss(model, mb, 0.0)
    out = np.asarray(model.logits(*(mb[k] for k in ("input_ids", "positions", "segment_ids", "reward_index",
                                                     "branch_ids")))).reshape(-1, 2, 3)
    bw = np.asarray(mb["weight"])[:, None] * np.asarray(bootstrap_weights(mb["pair_key"], 3))
    each = [pairwise_loss(jnp.asarray(out[:, 0, m]), jnp.asarray(out[:, 1, m]), mb["margin"], jnp.asarray(bw[:, m]),
                          0.0)[1]["bt_loss_sum"] for m in range(3)]
    assert float(loss) == pytest.approx(float(np.mean(each)), rel=1e-5)
    assert float(loss) != pytest.approx(float(OUTCOME.loss(model, mb, 0.0)[0]), rel=1e-3)  # the draws weigh in


def test_k_responses_train_each_member_on_the_ranking():
    import dataclasses

    from flax import nnx
    from rmflow.trainer.data.response_units import ResponsesPackCollate
    from rmflow.trainer.loss import listwise_loss
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.objective import objective_for

    from tests.training.test_listwise import VOCAB, records

    model = RewardTransformer(dataclasses.replace(ModelConfig.micro(VOCAB), num_labels=2, members=2),
                              rngs=nnx.Rngs(1))
    objective = objective_for("multi-response", "plackett-luce")
    b = ResponsesPackCollate(4, 64, rows=2)(records(4, np.random.default_rng(0)))
    mb = {k: jnp.asarray(v) for k, v in b.items() if k in objective.device_keys}
    loss, sums = objective.loss(model, mb, 0.01)
    out = model.logits(*(mb[k] for k in ("input_ids", "positions", "segment_ids", "reward_index", "branch_ids")))
    each = [listwise_loss(out[..., m], mb["response_scores"], mb["response_group"], 0.01, "plackett-luce",
                          mb["response_margins"])[1]["loss_sum"] for m in range(2)]
    assert float(loss) == pytest.approx(float(np.mean(each)), rel=1e-5)
    reward = listwise_loss(out.mean(-1), mb["response_scores"], mb["response_group"], 0.01, "plackett-luce",
                           mb["response_margins"])[1]
    assert float(sums["loss_sum"]) == pytest.approx(float(reward["loss_sum"]), rel=1e-5)  # metrics: the reward's


def test_what_cannot_be_an_ensemble_is_refused_in_one_line():
    base = {"data": "d", "model": "micro", "output": "o"}
    with pytest.raises(ConfigError, match="2 or more members"):
        TrainConfig(**base, ensemble={"members": 1})
    with pytest.raises(ConfigError, match="give ensemble.members too"):
        TrainConfig(**base, ensemble={"reward": "min"})
    with pytest.raises(ConfigError, match="ensemble.bootstrap: applies to an ensemble's members"):
        TrainConfig(**base, ensemble={"bootstrap": True})
    with pytest.raises(ConfigError, match="ensemble.layers: applies to an ensemble's members"):
        TrainConfig(**base, ensemble={"layers": 1})
    with pytest.raises(ConfigError, match="lcb:LAMBDA"):
        TrainConfig(**base, ensemble={"members": 2, "reward": "lcb:-1"})
    from rmflow.trainer.objective import PROCESS, REGRESSIONS

    for objective in (PROCESS, REGRESSIONS[0]):
        with pytest.raises(ConfigError, match="ensemble.members 4: an ensemble of reward heads trains on pairs"):
            objective.head(None, "", TrainConfig(**base, ensemble={"members": 4}).ensemble)


@pytest.fixture(scope="module")
def ensemble_run(demo_shards, tmp_path_factory):
    base = tmp_path_factory.mktemp("ensemble")
    train(TrainConfig(data=str(demo_shards), model="micro", output=str(base / "run"), max_steps=4, batch_size=4,
                      ensemble={"members": 4, "bootstrap": True}))
    return base


def test_an_ensemble_scores_with_its_members_and_the_reward_asked(ensemble_run, tmp_path):
    from rmflow import RewardModel
    from rmflow.scoring.scorers import score_file

    run = str(ensemble_run / "run")
    rm = RewardModel.load(run)
    assert rm.head.name == "ensemble" and rm.model_config.members == 4
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    score_file(run, str(src), str(tmp_path / "out.jsonl"))
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    members = np.asarray([r["member_scores"] for r in rows])
    assert members.shape == (12, 4) and members.std(1).min() > 0
    np.testing.assert_allclose([r["score"] for r in rows], members.mean(1), atol=1e-5)
    np.testing.assert_allclose([r["score_std"] for r in rows], members.std(1), atol=1e-5)
    np.testing.assert_allclose(rm.score(CONVS), members.mean(1), atol=1e-5)
    rm.use_reward("min")
    np.testing.assert_allclose(rm.score(CONVS), members.min(1), atol=1e-5)
    lcb = RewardModel.load(run, reward="lcb:1.5")
    np.testing.assert_allclose(lcb.score(CONVS), members.mean(1) - 1.5 * members.std(1), atol=1e-5)
    from rmflow.trainer.inference import ModelLoadError

    with pytest.raises(ModelLoadError, match="lcb:LAMBDA"):
        rm.use_reward("median")


def test_an_ensemble_evaluates_exports_and_serves(ensemble_run, demo_shards, tmp_path, tokenizer_dir):
    import torch
    from rmflow.schemas.config import EvalConfig, ExportConfig
    from rmflow.trainer.export import export
    from transformers import AutoModelForSequenceClassification

    from rmflow import RewardModel
    from rmflow.eval.evaluation import run_eval

    run = ensemble_run / "run"
    m = run_eval(EvalConfig(model=str(run), data=(str(demo_shards),), output=str(tmp_path / "eval"), normalize=True))
    e = m["ensemble"]
    assert e["members"] == 4 and len(e["member_accuracy"]) == 4 and e["reward_accuracy"] == m["accuracy"]
    assert "## Ensemble (4 members)" in (tmp_path / "eval" / "report.md").read_text()
    stats = json.loads((run / "reward_normalization.json").read_text())
    assert stats["reward"] == "mean" and stats["member_std"] == pytest.approx(e["reward_std_mean"])
    assert RewardModel.load(str(run)).normalization == stats  # the rule they were taken of
    other = RewardModel.load(str(run), reward="min")
    assert other.normalization is None and other.identity()["reward"] == "min"  # not another rule's figures

    folder = export(ExportConfig(run=str(run), output=str(tmp_path / "export")))
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["num_labels"] == 4 and config["rmflow_ensemble"] == {"members": 4, "reward": "mean"}
    card = (tmp_path / "export" / "README.md").read_text()
    assert "an ensemble head: 4 members on one backbone" in card and "logits.mean()" in card
    assert "| `ensemble.members` | 4 |" in card
    rm = RewardModel.load(folder)
    assert rm.model_config.members == 4
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = [float(hf(input_ids=torch.tensor([rm.encode(c).tolist()])).logits[0].mean()) for c in CONVS[:4]]
    np.testing.assert_allclose(theirs, rm.score(CONVS[:4]), atol=1e-4)

    server = Server(run, "--reward", "min", max_length=None)
    try:
        r = server.post("/v1/score", {"conversations": CONVS[:3]})
        assert r.status_code == 200, r.text
        body = r.json()
        want = RewardModel.load(str(run), reward="min").score(CONVS[:3])
        np.testing.assert_allclose(body["scores"], want, atol=1e-5)
        np.testing.assert_allclose(np.asarray(body["member_scores"]).min(1), want, atol=1e-5)
        np.testing.assert_allclose(body["score_std"], np.asarray(body["member_scores"]).std(1), atol=1e-5)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        text = tok.apply_chat_template(CONVS[0], tokenize=False)
        r = server.post("/get_reward", {"query": [text]})
        assert r.status_code == 200, r.text
        assert r.json()["rewards"][0] == pytest.approx(float(want[0]), abs=1e-4)  # the reward it was started with
    finally:
        server.stop()


def test_members_with_their_own_top_layers_are_each_a_model_over_the_shared_layers():
    """``ensemble.layers``: the shared layers run once, then each member's own copy of the top
    layers; member m scores as a plain model of the shared layers, its own layers and the score
    head's output m, and the loss trains every member's layers."""
    import dataclasses

    from flax import nnx
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.objective import OUTCOME

    cfg = dataclasses.replace(ModelConfig.micro(100), num_labels=3, members=3, member_layers=1)
    model = RewardTransformer(cfg, rngs=nnx.Rngs(0))
    assert len(model.model.layers) == 1 and [len(m.layers) for m in model.members] == [1, 1, 1]
    # copies of one draw, each its own arrays (a train step donates its parameters)
    q = [m.layers[0].self_attn.q_proj.kernel.get_value() for m in model.members]
    assert np.array_equal(q[0], q[1]) and q[0] is not q[1]
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 100, (4, 16)), jnp.int32)
    batch = {"input_ids": ids, "positions": jnp.broadcast_to(jnp.arange(16), (4, 16)),
             "segment_ids": jnp.ones((4, 16), jnp.int32), "branch_ids": jnp.zeros((4, 16), jnp.int32),
             "reward_index": jnp.asarray([15, 12, 9, 14]), "margin": jnp.zeros(2), "weight": jnp.ones(2)}
    args = [batch[k] for k in ("input_ids", "positions", "segment_ids", "reward_index", "branch_ids")]
    # members made to differ, as training makes them
    for m, member in enumerate(model.members):
        kernel = member.layers[0].mlp.down_proj.kernel
        kernel.set_value(kernel[...] * (1 + 0.5 * m))
    out = np.asarray(model.logits(*args))
    assert out.shape == (4, 3) and len(set(np.round(out[0], 5))) == 3
    for m, member in enumerate(model.members):
        plain = RewardTransformer(dataclasses.replace(ModelConfig.micro(100), num_labels=1), rngs=nnx.Rngs(9))
        plain.model.embed_tokens, plain.model.norm = model.model.embed_tokens, model.model.norm
        plain.model.layers = nnx.List([*model.model.layers, *member.layers])
        plain.score.kernel.set_value(model.score.kernel[...][:, m:m + 1])
        np.testing.assert_allclose(np.asarray(plain.logits(*args))[:, 0], out[:, m], atol=1e-6)
    grads = nnx.grad(lambda mdl: OUTCOME.loss(mdl, batch, 0.1)[0])(model)
    for m in range(3):
        assert np.abs(np.asarray(grads.members[m].layers[0].mlp.down_proj.kernel[...])).sum() > 0
    assert np.abs(np.asarray(grads.model.layers[0].mlp.down_proj.kernel[...])).sum() > 0


def test_lora_members_over_every_layer_keep_one_frozen_base():
    """N LoRA members over every layer of one frozen (nf4) base: each member's own adapters,
    every frozen weight one array, placed once: the frozen bytes of one model."""
    import dataclasses

    from rmflow.trainer.memory_plan import shard_bytes
    from rmflow.trainer.model_setup import base_model
    from rmflow.trainer.modeling import lora
    from rmflow.trainer.modeling.config import ModelConfig, ScoreHead
    from rmflow.trainer.objective import OUTCOME
    from rmflow.trainer.step import Trainer

    def frozen_bytes(head, ensemble):
        cfg = TrainConfig(data="d", model="micro", output="o", lora={"rank": 4, "base_dtype": "nf4"},
                          ensemble=ensemble)
        model = base_model(cfg, ModelConfig.preset("micro", vocab_size=100, **dataclasses.asdict(head)), head=head)
        trainer = Trainer(model, cfg.optimizer, trainable=lora.trainable_filter(cfg.lora),
                          objective=OUTCOME.for_data(None, "", cfg.ensemble))
        return model, shard_bytes(trainer.frozen)

    model, ensemble = frozen_bytes(ScoreHead(3, members=3, member_layers=2), {"members": 3, "layers": 2})
    _, single = frozen_bytes(ScoreHead(), {})
    first, second = (m.layers[1].mlp.up_proj for m in list(model.members)[:2])
    assert first.kernel.get_value().codes is second.kernel.get_value().codes  # one frozen weight
    assert not np.array_equal(first.lora_A[...], second.lora_A[...])  # each member its own adapters
    assert ensemble == single


@pytest.fixture(scope="module")
def layered_run(demo_shards, tmp_path_factory):
    base = tmp_path_factory.mktemp("layered")
    train(TrainConfig(data=str(demo_shards), model="micro", output=str(base / "run"), max_steps=4, batch_size=4,
                      center_rewards_coefficient=0.01, ensemble={"members": 3, "layers": 1, "reward": "lcb:1"}))
    return base / "run"


def test_an_ensemble_with_its_own_layers_exports_one_checkpoint_per_member(layered_run, tmp_path):
    import torch
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.export import export
    from transformers import AutoModelForSequenceClassification

    from rmflow import RewardModel

    rm = RewardModel.load(str(layered_run))
    assert rm.model_config.member_layers == 1
    folder = export(ExportConfig(run=str(layered_run), output=str(tmp_path / "export")))
    manifest = json.loads((tmp_path / "export" / "ensemble.json").read_text())
    assert manifest == {"members": 3, "reward": "lcb:1", "layers": 1,
                        "checkpoints": ["member-0", "member-1", "member-2"]}
    card = (tmp_path / "export" / "README.md").read_text()
    assert "checkpoints, one per member (`member-0` ... `member-2`, named in `ensemble.json`)" in card
    assert 'from_pretrained(f"PATH/member-{m}")' in card and "logits.mean() - 1 * logits.std" in card
    theirs = []
    for m in range(3):
        config = json.loads((tmp_path / "export" / f"member-{m}" / "config.json").read_text())
        assert config["num_labels"] == 1 and "rmflow_ensemble" not in config  # each a plain reward model
        hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export" / f"member-{m}",
                                                                dtype=torch.float32).eval()
        with torch.no_grad():
            theirs.append([float(hf(input_ids=torch.tensor([rm.encode(c).tolist()])).logits[0, 0]) for c in CONVS[:4]])
    theirs = np.asarray(theirs).T  # (conversations, members)
    assert theirs.std(1).min() > 0  # the members differ
    np.testing.assert_allclose(theirs.mean(1) - theirs.std(1), rm.score(CONVS[:4]), atol=1e-4)
    exported = RewardModel.load(folder)  # rmflow reads the members back as one model
    assert exported.model_config.member_layers == 1 and exported.model_config.member_reward == "lcb:1"
    np.testing.assert_allclose(exported.score(CONVS[:4]), rm.score(CONVS[:4]), atol=1e-5)
    # a member whose shared layers differ is no member of this ensemble
    from safetensors.numpy import load_file, save_file

    weights = tmp_path / "export" / "member-2" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    from rmflow.trainer.inference import ModelLoadError
    from rmflow.trainer.modeling.convert import CheckpointError

    with pytest.raises((CheckpointError, ModelLoadError), match="member-2's model.layers.0.mlp.up_proj.weight differs"):
        RewardModel.load(folder)


def test_more_own_layers_than_the_model_has_is_refused_in_one_line(demo_shards, tmp_path):
    from rmflow.schemas.errors import RmflowError

    with pytest.raises(RmflowError, match=r"ensemble.layers 3: the members' own top layers, from 0 to the model's 2"):
        train(TrainConfig(data=str(demo_shards), model="micro", output=str(tmp_path / "run"), max_steps=1,
                          batch_size=4, ensemble={"members": 2, "layers": 3}))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_members_copy_a_checkpoint_s_top_layers_and_lora_members_store_them_once(tmp_path):
    """From a Hugging Face base, member m's own layer j is the base's layer L - K + j; with a
    frozen (nf4) base each is quantised once, read once and held once for every member."""
    import torch
    import transformers
    from flax import nnx
    from rmflow.trainer.modeling import lora
    from rmflow.trainer.modeling.config import ScoreHead
    from rmflow.trainer.modeling.convert import load_reward_model, open_tensors

    transformers.set_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2)).to(torch.float32)
    hf.save_pretrained(tmp_path)
    base = open_tensors(str(tmp_path))
    head = ScoreHead(3, members=3, member_layers=2)
    model = load_reward_model(str(tmp_path), head=head)
    assert len(model.model.layers) == 1
    np.testing.assert_array_equal(model.model.layers[0].mlp.up_proj.kernel[...], base["model.layers.0.mlp.up_proj.weight"].T)
    for member in model.members:
        for j in range(2):
            np.testing.assert_array_equal(member.layers[j].mlp.up_proj.kernel[...],
                                          base[f"model.layers.{1 + j}.mlp.up_proj.weight"].T)
    stored = []
    store = lora.base_storage(lora.LoraConfig(base_dtype="nf4"))
    quantized = load_reward_model(str(tmp_path), head=head, store=lambda n, v: stored.append(n) or store(n, v))
    assert not [n for n in stored if n.startswith(("members.1.", "members.2."))]  # member 0's copy read and stored once
    codes = [m.layers[1].self_attn.o_proj.kernel.get_value().codes for m in quantized.members]
    assert codes[0] is codes[1] is codes[2]
    assert len(nnx.to_flat_state(nnx.state(quantized, nnx.Param))) == len(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_an_ensemble_export_is_no_base_and_its_own_layers_are_fixed_on_resume(layered_run, tmp_path):
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.errors import TrainError
    from rmflow.trainer.export import export
    from rmflow.trainer.rundir import read_run

    run = read_run(str(layered_run))
    folder = export(ExportConfig(run=str(layered_run), output=str(tmp_path / "export")))
    data = run.config.data.train
    with pytest.raises(TrainError, match="is an ensemble exported one checkpoint per member"):
        train(TrainConfig(data=data, model=folder, output=str(tmp_path / "again"), max_steps=1, batch_size=4,
                          ensemble={"members": 3, "layers": 1}))
    with pytest.raises(TrainError, match="ensemble.layers"):  # its parameters' shapes: not even when allowed
        train(TrainConfig(data=data, model="micro", output=str(layered_run), max_steps=6, batch_size=4,
                          center_rewards_coefficient=0.01, ensemble={"members": 3, "layers": 2, "reward": "lcb:1"}),
              resume=True, allow_config_change=True)
    (tmp_path / "export" / "ensemble.json").write_text(json.dumps({"members": 3, "layers": 1,
                                                                   "checkpoints": ["member-0", "member-1"]}))
    from rmflow.trainer.modeling.convert import CheckpointError

    from rmflow import RewardModel

    with pytest.raises(CheckpointError, match="must name 2 or more member checkpoints"):
        RewardModel.load(folder)

"""LoRA reward models: only the adapters and the score head train (base weights bitwise
unchanged, no optimizer state for them), a LoRA run learns the synthetic task, resumes exactly,
and its merged export loads in transformers with rmflow's rewards."""

import json
import os
import pathlib
import shutil
import signal

import jax
import numpy as np
import pytest
from flax import nnx
from rmflow.schemas.config import ConfigError
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.checkpoints import load_trained_model
from rmflow.trainer.errors import Interrupted
from rmflow.trainer.model_setup import base_model
from rmflow.trainer.modeling import lora
from rmflow.trainer.train import run as train

from tests.training.test_train import GOOD, config, synthetic  # noqa: F401 - the synthetic shards fixture

LORA = {"rank": 8, "alpha": 16, "target_modules": "all-linear"}


def split(model):
    """(adapters, score head, base) flat parameter dicts."""
    flat = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    ad = {k: v for k, v in flat.items() if "lora_" in k}
    head = {k: v for k, v in flat.items() if k.startswith("score")}
    base = {k: v for k, v in flat.items() if k not in ad and k not in head}
    return ad, head, base


@pytest.mark.slow
def test_lora_trains_adapters_and_head_only_and_learns(synthetic, tmp_path):  # noqa: F811
    # 60 steps: the task is learnt well before the end, a margin for the accuracy bound.
    cfg = config(synthetic, tmp_path / "run", max_steps=60, eval_steps=60, checkpoint={"save_steps": 20},
                 optimizer={"learning_rate": 3e-3}, lora=LORA)
    result = train(cfg)
    final = result.history[-1]
    assert final["eval_accuracy"] > 0.9, final  # learns the task through the adapters
    # Optimizer state only for the trainable parameters: 7 adapted projections x 2 layers x (A, B) + head.
    n_trainable = len(jax.tree.leaves(result.state.params))
    assert n_trainable == 7 * 2 * 2 + 1
    mu = result.state.opt_state[0].mu
    assert len(jax.tree.leaves(mu)) == n_trainable

    trained, run, step = load_trained_model(str(tmp_path / "run"))
    fresh = base_model(TrainConfig.from_dict({**json.loads((tmp_path / "run" / "config.json").read_text())}),
                       run.model_config)
    ad_t, head_t, base_t = split(trained)
    ad_0, head_0, base_0 = split(fresh)
    assert base_t.keys() == base_0.keys() and len(base_t) == 1 + 9 * 2 + 1  # embeddings, 2 layers, final norm
    for k in base_t:  # the base model, bitwise
        np.testing.assert_array_equal(base_t[k], base_0[k], err_msg=k)
    assert all(not np.array_equal(ad_t[k], ad_0[k]) for k in ad_t if k.endswith("lora_B"))  # B starts at 0
    assert not np.array_equal(head_t["score.kernel"], head_0["score.kernel"])

    # Resume from the step-40 checkpoint: the same adapters as the uninterrupted run.
    shutil.copytree(tmp_path / "run", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "60")
    resumed = train(config(synthetic, tmp_path / "resumed", max_steps=60, eval_steps=60, checkpoint={"save_steps": 20}, optimizer={"learning_rate": 3e-3}, lora=LORA),
                    resume=True)
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(result.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_merged_export_matches_in_transformers(synthetic, tmp_path):  # noqa: F811
    import torch
    import transformers
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.export import export

    train(config(synthetic, tmp_path / "run", max_steps=20, checkpoint={"save_steps": 20}, optimizer={"learning_rate": 3e-3}, lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}))
    out = export(ExportConfig(run=str(tmp_path / "run"), output=str(tmp_path / "hf")))
    names = set(json.loads((pathlib.Path(out) / "config.json").read_text()))
    assert "architectures" in names
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ids = [[2000 + i, 2100, GOOD, 2200 + i] for i in range(3)]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids)).logits[:, 0].numpy()
    model, _, _ = load_trained_model(str(tmp_path / "run"))  # with adapters, unmerged
    from tests.scoring.test_export import rmflow_rewards

    ours = rmflow_rewards(model, ids)
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    assert lora.adapters(model)  # it was a LoRA model

    # The PEFT adapter folder: peft loads it onto the base model with the same scores.
    import peft
    from typer.testing import CliRunner

    from rmflow.cli import app

    r = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "-o", str(tmp_path / "adapter"), "--adapter"])
    assert r.exit_code == 0, r.output
    folder = tmp_path / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["score"] and cfg["r"] == 4 and cfg["task_type"] == "SEQ_CLS"
    assert cfg["base_model_name_or_path"] == "base"  # a preset's random base, shipped beside it: relative, it moves
    base = transformers.AutoModelForSequenceClassification.from_pretrained(folder / cfg["base_model_name_or_path"],
                                                                           dtype=torch.float32)
    with torch.no_grad():
        untrained = base(input_ids=torch.tensor(ids)).logits[:, 0].numpy()
    peft_model = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        got = peft_model(input_ids=torch.tensor(ids)).logits[:, 0].numpy()
    np.testing.assert_allclose(got, ours, atol=1e-4, rtol=0)
    assert not np.allclose(untrained, ours, atol=1e-3)  # the adapter and the head did change the scores
    # Not a LoRA run: --adapter is refused in one line.
    train(config(synthetic, tmp_path / "full", max_steps=2, checkpoint={"save_steps": 2}))
    r = CliRunner().invoke(app, ["export", str(tmp_path / "full"), "-o", str(tmp_path / "x"), "--adapter"])
    assert r.exit_code == 1 and "is not a LoRA run" in r.output


def test_lora_config_checks():
    cfg = TrainConfig(data="d", model="micro", output="o", lora={"rank": 4, "target_modules": "all-linear"})
    assert cfg.lora.target_modules == lora.TARGETS and cfg.lora.scale == 4.0
    assert TrainConfig(data="d", model="micro", output="o").with_overrides(["lora.rank=2"]).lora.rank == 2
    for bad, match in [({"rank": 0}, "rank"), ({"target_modules": ["lm_head"]}, "target_modules"),
                       ({"dropout": 1.0}, "dropout"), ({"dropout": -0.1}, "dropout"),
                       ({"base_dtype": "int4"}, "base_dtype"), ({"base_block_size": 3}, "base_block_size"), ({"ranks": 4}, "unknown LoraConfig keys")]:
        with pytest.raises(ConfigError, match=match):
            TrainConfig(data="d", model="micro", output="o", lora=bad)


def test_adapter_dropout_is_unbiased_and_only_in_training():
    import jax.numpy as jnp
    from rmflow.trainer.modeling.decoder import RewardTransformer

    from tests.training.test_step import CFG

    model = RewardTransformer(CFG, rngs=nnx.Rngs(0))
    lora.apply(model, lora.LoraConfig(rank=4, alpha=8, dropout=0.5, target_modules=("q_proj",)))
    linear = model.model.layers[0].self_attn.q_proj
    linear.lora_B = nnx.LoRAParam(jax.random.normal(jax.random.key(1), linear.lora_B[...].shape))
    x = jax.random.normal(jax.random.key(2), (4, CFG.hidden_size))
    plain = lora.delta(linear, x)
    draws = []
    for i in range(400):
        with lora.dropout_key(jax.random.key(i)):
            draws.append(lora.delta(linear, x))
    with lora.dropout_key(jax.random.key(0)):
        again = lora.delta(linear, x)
    np.testing.assert_array_equal(draws[0], again)  # a key gives one mask
    assert not np.allclose(draws[0], draws[1])  # another key, another mask
    assert not np.allclose(draws[0], plain)
    mean = jnp.mean(jnp.stack(draws), axis=0)  # inverted dropout: unbiased
    assert float(jnp.max(jnp.abs(mean - plain))) < 0.15 * float(jnp.max(jnp.abs(plain)))
    np.testing.assert_array_equal(lora.delta(linear, x), plain)  # outside training: no dropout


@pytest.mark.parametrize("rate", [0.05, 0.5])
def test_dropout_masks_drop_at_the_rate_with_any_width(rate):
    """Two 16-bit draws a random word: the rate is met to 1/65536, odd widths included, every
    element drawn independently (no two halves of a word alike), and the scale is unbiased."""
    keep, scale = lora.keep_mask(jax.random.key(0), (64, 1001), rate)
    assert keep.shape == (64, 1001)
    kept = float(keep.mean())
    assert abs(kept - (1 - rate)) < 4 * (rate * (1 - rate) / keep.size) ** 0.5 + 1e-4
    assert abs(scale * (1 - rate) - 1) < 1e-4
    pairs = np.asarray(keep[:, :1000]).reshape(64, 500, 2)  # the two halves of each word
    both = float((pairs[..., 0] & pairs[..., 1]).mean())
    assert abs(both - (1 - rate) ** 2) < 0.02


@pytest.mark.slow
def test_dropout_and_bfloat16_base_train_export_and_resume(synthetic, tmp_path):  # noqa: F811
    import jax.numpy as jnp
    import torch
    import transformers
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.export import export

    from tests.scoring.test_export import rmflow_rewards

    spec = {"rank": 4, "alpha": 8, "dropout": 0.1, "base_dtype": "bfloat16", "target_modules": "all-linear"}
    optimizer = {"warmup_steps": 2, "learning_rate": 3e-3, "learning_rate_end": 3e-3}  # the same rate whatever max_steps
    cfg = config(synthetic, tmp_path / "run", max_steps=8, checkpoint={"save_steps": 4}, logging={"steps": 2},
                 lora=spec,
                 optimizer=optimizer)
    full = train(cfg)
    model = base_model(cfg, full.trainer.model(full.state.params).config)
    ad, head, base = split(model)
    kernels = {k: v for k, v in base.items() if v.ndim >= 2}
    assert kernels and all(v.dtype == jnp.bfloat16 for v in kernels.values())  # half the frozen bytes
    assert all(v.dtype == np.float32 for v in (*ad.values(), *head.values()))
    assert full.trainer.frozen and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(full.trainer.frozen)
                                       if x.ndim >= 2)
    # Dropout draws from the run's seed and step: stopped by SIGINT (Ctrl-C) once step 4 is logged,
    # which stops at that step boundary with its checkpoint, and resumed, the run ends with the
    # uninterrupted one's parameters, bit for bit. (The same config on both sides: a resume that
    # changes max_steps runs another compiled program, whose rounding XLA need not keep.)
    def ctrl_c_at_step_4(record):
        if record["step"] == 4:
            os.kill(os.getpid(), signal.SIGINT)

    again = config(synthetic, tmp_path / "resumed", max_steps=8, checkpoint={"save_steps": 4}, logging={"steps": 2},
                   lora=spec, optimizer=optimizer)
    with pytest.raises(Interrupted, match="stopped by SIGINT at step 4"):
        train(again, on_log=ctrl_c_at_step_4)
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == ["4"]
    resumed = train(again, resume=True)
    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The merged export holds the bfloat16-rounded base plus the adapters, in float32: transformers
    # scores like rmflow.
    out = export(ExportConfig(run=str(tmp_path / "run"), output=str(tmp_path / "hf")))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ids = [[2000 + i, 2100, GOOD, 2200 + i] for i in range(3)]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids)).logits[:, 0].numpy()
    loaded, _, _ = load_trained_model(str(tmp_path / "run"))
    np.testing.assert_allclose(rmflow_rewards(loaded, ids), expected, atol=1e-4, rtol=0)


def test_the_train_step_draws_dropout_masks_from_the_run_seed():
    from rmflow.schemas.train_config import OptimizerConfig
    from rmflow.trainer.batching import stack_micro_batches
    from rmflow.trainer.data import Collate
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.step import Trainer

    from tests.training.test_step import CFG, records

    batch = stack_micro_batches([Collate(4, 64)(records(4))])

    def step(dropout, seed):
        model = RewardTransformer(CFG, rngs=nnx.Rngs(0))
        cfg = lora.LoraConfig(rank=4, alpha=8, dropout=dropout, target_modules=("q_proj", "v_proj"))
        lora.apply(model, cfg)
        t = Trainer(model, OptimizerConfig(learning_rate=1e-2), total_steps=2, seed=seed,
                    trainable=lora.trainable_filter(cfg))
        state, _ = t.train_step(t.init_state, batch)
        return jax.tree.leaves(state.params)

    same = all(np.array_equal(a, b) for a, b in zip(step(0.0, 0), step(0.0, 1)))
    differ = not all(np.array_equal(a, b) for a, b in zip(step(0.5, 0), step(0.5, 1)))
    assert same and differ  # only the dropout masks depend on the run's seed

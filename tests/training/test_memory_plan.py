"""The memory plan (``rmflow train --plan``, ``trainer.memory_plan``): built without loading a
weight, it counts what a run places, its levers save what they say, a run that cannot fit is
refused before it loads anything, and the step it compiles is the one the run trains with."""

import os
import shutil

import jax
import pytest
from rmflow.trainer import memory_plan as mp
from rmflow.trainer import step as step_module
from rmflow.trainer.errors import TrainError
from rmflow.trainer.train import Run
from rmflow.trainer.train import run as train

from tests.training.test_train import config, synthetic  # noqa: F401 - the fixture


def _plan(data, out, **kw):
    return mp.plan_memory(Run(config(data, out, max_steps=4, **kw), abstract=True))[0]


def test_the_plan_counts_what_a_run_places(synthetic, tmp_path):  # noqa: F811
    plan = _plan(synthetic, tmp_path / "p")
    run = Run(config(synthetic, tmp_path / "r", max_steps=4))
    state = run.trainer.use_mesh(run.mesh)
    assert plan.parameters == mp.shard_bytes(state.params) > 0
    assert plan.optimizer == mp.shard_bytes(state.opt_state) == 2 * plan.parameters + 8  # float32 moments, 2 counts
    assert plan.trained == sum(x.size for x in jax.tree.leaves(state.params))
    host = mp.widest_batch(run)
    assert plan.batch_shape == host["input_ids"].shape and plan.batch == sum(v.nbytes for v in host.values())
    assert plan.temporaries > plan.gradients == plan.parameters  # the gradients, and the activations beside them
    assert plan.total == sum((plan.parameters, plan.frozen, plan.optimizer, plan.batch, plan.temporaries, plan.outputs))
    assert plan.fits and plan.limit is None  # CPU: no device memory count
    text = plan.render()
    assert "trained parameters" in text and "no device memory limit known" in text and "Levers: " in text


def test_each_optimizer_lever_saves_what_it_says(synthetic, tmp_path):  # noqa: F811
    full = _plan(synthetic, tmp_path / "a")
    small = {m: _plan(synthetic, tmp_path / m, optimizer={"learning_rate": 1e-3, "moments": m})
             for m in ("bfloat16", "int8")}
    for m, plan in small.items():
        assert full.moment_savings[m] == full.optimizer - plan.optimizer > 0
    assert small["int8"].optimizer < small["bfloat16"].optimizer < full.optimizer
    off = _plan(synthetic, tmp_path / "off", optimizer={"learning_rate": 1e-3, "offload": True})
    assert off.optimizer == 0 and off.host_optimizer == full.optimizer and off.moment_savings == {}
    assert dict(full.levers())["optimizer.offload=true"] == full.optimizer
    assert "optimizer.offload=true" not in dict(off.levers())
    lora = _plan(synthetic, tmp_path / "lora", lora={"rank": 4, "alpha": 8})
    assert lora.frozen > lora.parameters > 0 and lora.trained < full.trained
    assert not any(k.startswith("lora.rank") for k, _ in lora.levers())


def test_a_checkpoint_is_planned_from_its_config_alone(synthetic, tmp_path, tokenizer_dir):  # noqa: F811
    import torch
    import transformers

    folder = tmp_path / "ckpt"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), folder / name)
    whole = _plan(synthetic, tmp_path / "a", model=str(folder))
    (folder / "model.safetensors").write_bytes(b"not the weights")  # unreadable: the plan never opens it
    assert _plan(synthetic, tmp_path / "b", model=str(folder)) == whole
    with pytest.raises(Exception):  # noqa: B017 - the run itself reads them (the loader's own error)
        train(config(synthetic, tmp_path / "c", model=str(folder), max_steps=1))


def test_a_step_that_cannot_fit_is_refused_before_anything_is_loaded(synthetic, tmp_path, monkeypatch):  # noqa: F811
    plan = _plan(synthetic, tmp_path / "p")
    variants = {"optimizer.moments=int8": _plan(synthetic, tmp_path / "i", optimizer={"learning_rate": 1e-3, "moments": "int8"}),
                "optimizer.offload=true": _plan(synthetic, tmp_path / "o", optimizer={"learning_rate": 1e-3, "offload": True}),
                "model.gradient_checkpointing=true": _plan(synthetic, tmp_path / "g", model={"path": "micro", "gradient_checkpointing": True})}
    limit = plan.total - 1
    monkeypatch.setattr(mp, "device_limit", lambda: limit)
    loaded = []
    real_build = Run.__init__

    def watching(self, cfg, *, abstract=False):
        loaded.append(abstract)
        return real_build(self, cfg, abstract=abstract)

    monkeypatch.setattr(Run, "__init__", watching)
    with pytest.raises(TrainError, match=r"needs [\d.]+ GiB a device and the device holds [\d.]+ GiB; with ") as e:
        train(config(synthetic, tmp_path / "r", max_steps=4))
    for what, other in variants.items():  # each alternative compiled: its peak, and whether it fits
        assert f"{what}: {other.total / mp.GIB:.2f} GiB" + (" (fits)" if other.total <= limit else "") in str(e.value)
    assert "lora.rank=16" in str(e.value) and str(e.value).endswith("rmflow train --plan prints the whole plan")
    assert loaded == [True] * 4  # the plan and its 3 alternatives, abstract: no weight drawn, no run file written
    assert not (tmp_path / "r" / "checkpoints").exists() and not (tmp_path / "r" / "config.json").exists()
    monkeypatch.setattr(mp, "device_limit", lambda: plan.total + 1)
    train(config(synthetic, tmp_path / "ok", max_steps=4))
    assert loaded == [True] * 5 + [False]
    monkeypatch.setattr(mp, "device_limit", lambda: 1)  # packing pack: rows vary, so no exact plan and no check
    train(config({"train": str(synthetic), "packing": "pack"}, tmp_path / "pack", max_steps=2))


def test_the_run_trains_with_the_step_its_plan_compiled(synthetic, tmp_path, monkeypatch):  # noqa: F811
    step_module.forget_compiled()
    compiled = []
    real = step_module.Trainer._compile

    def counting(self, step, abstract):
        compiled.append(step)
        return real(self, step, abstract)

    monkeypatch.setattr(step_module.Trainer, "_compile", counting)
    monkeypatch.setattr(mp, "device_limit", lambda: 2 ** 40)  # as on an accelerator: the plan is made first
    train(config(synthetic, tmp_path / "r", max_steps=4))
    assert compiled.count("train") == 1


def test_the_cli_prints_the_plan_and_writes_nothing(synthetic, tmp_path):  # noqa: F811
    from typer.testing import CliRunner

    from rmflow.cli import app

    out = tmp_path / "never"
    r = CliRunner().invoke(app, ["train", "--data", str(synthetic), "--model", "micro", "--output", str(out),
                                 "--batch-size", "16", "--set", "optimizer.moments=int8", "--plan"])
    assert r.exit_code == 0, r.output
    assert "Memory plan of one train step" in r.output and "moments int8" in r.output and "total" in r.output
    assert not out.exists()


def test_lora_members_are_planned_with_one_frozen_base(synthetic, tmp_path):  # noqa: F811
    """N LoRA members over every layer hold one frozen base (``lora.share_frozen``), which the plan
    counts once, as the run places it."""
    lora = {"rank": 4, "alpha": 8}
    single = _plan(synthetic, tmp_path / "one", lora=lora)
    members = {"members": 3, "layers": 2, "reward": "mean"}
    plan = _plan(synthetic, tmp_path / "ens", lora=lora, ensemble=members)
    assert plan.frozen == single.frozen and plan.parameters > single.parameters  # their adapters, 3 times
    run = Run(config(synthetic, tmp_path / "r", max_steps=4, lora=lora, ensemble=members))
    run.trainer.use_mesh(run.mesh)
    assert mp.shard_bytes((run.trainer.frozen, run.trainer.others)) == plan.frozen  # placed: one array each

"""Training end to end on CPU with the tiny preset: learning works on a synthetic task, a run
killed with SIGKILL resumes to the same parameters and metrics, divergence stops cleanly."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import grain
import jax
import numpy as np
import pytest
from rmflow.pipelines.io import write_array_record_shard
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.record import decode, encode
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.errors import TrainError
from rmflow.trainer.train import METRICS_FILE
from rmflow.trainer.train import run as train

GOOD = 1000  # the token that makes a reply preferred


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, tokenizer_dir):
    """Pre-tokenized pairs through the real preprocess stage: the chosen reply carries GOOD."""
    base = tmp_path_factory.mktemp("synthetic")
    rng = np.random.default_rng(0)
    with open(base / "pairs.jsonl", "w") as f:
        for _ in range(800):
            prompt = rng.integers(2000, 3000, 5).tolist()
            chosen = rng.integers(2000, 3000, int(rng.integers(3, 7))).tolist()
            chosen[int(rng.integers(0, len(chosen)))] = GOOD
            rejected = rng.integers(2000, 3000, int(rng.integers(3, 7))).tolist()
            f.write(json.dumps({"chosen_ids": prompt + chosen, "rejected_ids": prompt + rejected,
                                "prompt_len": 5}) + "\n")
    preprocess(PreprocessConfig(inputs=(str(base / "pairs.jsonl"),), output=str(base / "shards"),
                                tokenizer=tokenizer_dir, format="tokenized", max_length=32, eval_fraction=0.1))
    return base / "shards"


def config(data, out, **kw):
    """A run on ``data``: ``kw`` over these options (a section given as a mapping updates that section's)."""
    base = {"data": data if isinstance(data, dict) else str(data), "model": "micro", "output": str(out), "batch_size": 16, "seed": 0,
            "optimizer": {"learning_rate": 1e-3}, "logging": {"steps": 10}}
    for key, value in kw.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) and isinstance(value, dict) else value
    steps = base.get("max_steps", 0)
    # a warmup shorter than the run
    base["optimizer"].setdefault("warmup_steps", 10 if not steps or steps > 20 else steps // 2)
    return TrainConfig.from_dict(base)


def test_a_run_rounds_rows_as_finely_as_its_steps_repay(synthetic, tmp_path):
    """In packing ``pack``, ``lengths_per_doubling`` decides each loader's rounding: a short run's
    rows are powers of two (few programs to compile), a long run's one of 8 lengths per doubling
    (little padding); an eval set's, its batches times the run's evaluations."""
    from rmflow.trainer.train import Run

    def lengths(run, in_training):
        it = iter(run.train_loader() if in_training else run.eval_loader(""))
        return [b["input_ids"].shape[1] for b in (next(it) for _ in range(5))]  # the eval set is 5 batches

    def pow2(n):
        return n & (n - 1) == 0

    pack = {"train": str(synthetic), "packing": "pack"}
    short = Run(config(pack, tmp_path / "s", max_steps=6, eval_steps=3))
    assert all(pow2(n) for n in lengths(short, True) + lengths(short, False))
    long = Run(config(pack, tmp_path / "l", max_steps=2000, eval_steps=5))  # 400 evaluations of 5 batches
    for in_training in (True, False):
        got = lengths(long, in_training)
        assert not all(pow2(n) for n in got) and all(n % 16 == 0 for n in got), got  # 8 per doubling of 128


def test_a_run_is_planned_without_a_device(synthetic, tmp_path):
    """``plan_run`` decides a run from its config, its data and the mesh's numbers alone: the same
    config planned for this CPU and for 8 GPUs over 2 processes. On an accelerator, where a
    compilation costs many more steps, rows are rounded to fewer lengths; the batch is split
    over the processes and each process packs one row per batch shard."""
    from rmflow.trainer.errors import TrainError
    from rmflow.trainer.plan import plan_run

    cfg = config(synthetic, tmp_path / "r", max_steps=2000, eval_steps=5)
    cpu = plan_run(cfg, mesh_shape={"data": 1, "fsdp": 1, "tensor": 1}, processes=1, backend="cpu")
    gpu = plan_run(cfg, mesh_shape={"data": 4, "fsdp": 2, "tensor": 1}, processes=2, backend="gpu")
    assert cpu.total_steps == gpu.total_steps == 2000 and cpu.evaluations == frozenset(range(5, 2001, 5))
    assert (cpu.train_rounding, gpu.train_rounding) == (8, 2) and (cpu.eval_rounding, gpu.eval_rounding) == ({"": 8},
            {"": 2})
    assert (cpu.packing, gpu.packing) == ("fixed", "bucket")
    assert (cpu.rows, cpu.local_batch, gpu.rows, gpu.local_batch) == (1, 16, 4, 8)
    with pytest.raises(TrainError, match=r"batch_size 16 must be a multiple of the 32 batch shards \(mesh data x fsdp x expert = 8 x 4 x 1\)"):
        plan_run(cfg, mesh_shape={"data": 8, "fsdp": 4, "tensor": 1}, processes=1, backend="gpu")
    with pytest.raises(TrainError, match=r"warmup_steps 100000 >= the run's \d+ steps"):  # one epoch's steps
        plan_run(config(synthetic, tmp_path / "w", max_steps=0, num_epochs=1, optimizer={"warmup_steps": 100_000}),
                 mesh_shape={"data": 1, "fsdp": 1, "tensor": 1}, processes=1, backend="cpu")


def test_a_run_plans_with_its_own_mesh_and_backend(synthetic, tmp_path, monkeypatch):
    """The run plans with the backend it runs on and the shape of the mesh it made."""
    from rmflow.trainer import train as train_module

    asked = []
    real = train_module.plan_run

    def spy(cfg, **kw):
        asked.append(kw)
        return real(cfg, **kw)

    monkeypatch.setattr(train_module, "plan_run", spy)
    run = train_module.Run(config(synthetic, tmp_path / "r", max_steps=2000, eval_steps=5))
    assert asked == [{"mesh_shape": dict(run.mesh.shape), "processes": jax.process_count(),
                      "backend": jax.default_backend()}]
    assert run.plan.train_rounding == 8


@pytest.mark.parametrize("devices,packing", [(1, "fixed"), (8, "bucket")])
def test_a_run_builds_its_model_for_the_rows_its_packing_makes(synthetic, tmp_path, monkeypatch, devices, packing):
    """The run hands the model builder its resolved packing and its mesh's size, from which
    ``attention: auto`` is resolved (``setup.base_model``): on one GPU packed rows and the Pallas
    kernels, over several buckets and cuDNN. (A GPU and a mesh of 8 stood in for: the run stops
    where it builds the model.)"""
    import types

    from rmflow.trainer import train as train_module

    class Built(Exception):
        pass

    def build_model(cfg, manifest, objective, packing, devices, shards, abstract=False):
        raise Built(packing, devices)

    mesh = types.SimpleNamespace(size=devices, shape={"data": devices, "fsdp": 1, "tensor": 1})
    monkeypatch.setattr(train_module.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(train_module, "make_mesh", lambda shape: mesh)
    monkeypatch.setattr(train_module, "build_model", build_model)
    with pytest.raises(Built) as got:
        train_module.Run(config(synthetic, tmp_path / "r", max_steps=6))
    assert got.value.args == (packing, devices)


@pytest.mark.slow
def test_learning_works_on_a_synthetic_preference(synthetic, tmp_path):
    # 60 steps: the task is learnt well before the end, a wide margin for the accuracy bound.
    result = train(config(synthetic, tmp_path / "run", max_steps=60, eval_steps=20, checkpoint={"save_steps": 60}))
    final = result.history[-1]
    assert final["step"] == 60 and final["eval_pairs"] > 40
    assert final["eval_accuracy"] > 0.95, final
    assert result.history[0]["loss"] > final["loss"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [10 * i for i in range(1, 7)]
    assert [json.loads(x)["step"] for x in lines if "eval_accuracy" in x] == [20, 40, 60]
    assert os.listdir(tmp_path / "run" / "tensorboard")
    assert json.loads((tmp_path / "run" / "config.json").read_text())["max_steps"] == 60


def timing_free(history):
    return [{k: v for k, v in h.items() if k != "tokens_per_second"} for h in history]


@pytest.mark.slow
def test_kill_9_then_resume_equals_an_uninterrupted_run(synthetic, tmp_path):
    kw = dict(max_steps=60, checkpoint={"save_steps": 10}, eval_steps=30, optimizer={"learning_rate": 3e-4})
    run_dir = tmp_path / "killed"
    flags = {"max_steps": 60, "checkpoint.save_steps": 10, "eval_steps": 30, "optimizer.learning_rate": 3e-4,
             "batch_size": 16, "optimizer.warmup_steps": 10, "logging.steps": 10}
    args = [sys.executable, "-m", "rmflow.cli", "train", "--data", str(synthetic), "--model", "micro",
            "--output", str(run_dir)] + [f"--set={k}={v}" for k, v in flags.items()]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    deadline = time.time() + 300
    while not (run_dir / "checkpoints" / "20").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (run_dir / "checkpoints" / "60").exists()

    resumed = train(config(synthetic, run_dir, **kw), resume=True)
    straight = train(config(synthetic, tmp_path / "straight", **kw))
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert timing_free(resumed.history) == timing_free(straight.history)
    on_disk = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert timing_free(on_disk) == timing_free(straight.history)


def test_existing_run_needs_resume(synthetic, tmp_path):
    train(config(synthetic, tmp_path / "r", max_steps=2, logging={"steps": 1}))
    before = {f: (tmp_path / "r" / f).read_bytes() for f in ("config.json", "model_config.json", METRICS_FILE)}
    with pytest.raises(TrainError, match="--resume"):  # a different config, refused
        train(config(synthetic, tmp_path / "r", max_steps=3, logging={"steps": 1}, optimizer={"learning_rate": 0.5}))
    # nothing of the existing run was touched before the refusal (it can still be exported)
    assert {f: (tmp_path / "r" / f).read_bytes() for f in before} == before


def test_nan_loss_stops_with_the_step_and_saves_nothing_corrupt(synthetic, tmp_path):
    """Fault injection: a copy of the shards where 2% of the pairs carry a NaN margin."""
    data = tmp_path / "poisoned"
    shutil.copytree(synthetic, data)
    for shard in data.glob("train-*.array_record"):
        source = grain.sources.ArrayRecordDataSource([str(shard)])
        recs = [decode(source[i]) for i in range(len(source))]
        recs = [dataclasses.replace(r, margin=float("nan")) if i % 50 == 7 else r for i, r in enumerate(recs)]
        shard.unlink()
        write_array_record_shard(str(shard), [encode(r) for r in recs])
    with pytest.raises(TrainError, match=r"loss is nan at step \d+") as e:
        train(config(data, tmp_path / "d", max_steps=50, checkpoint={"save_steps": 1}, logging={"steps": 1}))
    bad_step = int(re.search(r"at step (\d+)", str(e.value)).group(1))
    assert bad_step > 1
    saved = sorted(int(s) for s in os.listdir(tmp_path / "d" / "checkpoints") if s.isdigit())
    assert max(saved) == bad_step - 1  # every step before it was saved, that one was not
    assert f"newest checkpoint is step {bad_step - 1}" in str(e.value)
    logged = [json.loads(x)["step"] for x in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) == bad_step - 1


def test_shards_must_match_the_run(synthetic, tmp_path, tokenizer_dir):
    import torch
    import transformers

    incomplete = tmp_path / "incomplete"
    shutil.copytree(synthetic, incomplete)
    (incomplete / "COMPLETED").unlink()
    with pytest.raises(TrainError, match="COMPLETED"):
        train(config(incomplete, tmp_path / "a", max_steps=1))
    with pytest.raises(TrainError, match="max_length 32 .shards. > 16"):
        train(config(synthetic, tmp_path / "b", max_steps=1, **{"data.max_length": 16}))

    def checkpoint(folder, vocab, tokenizer_patch):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2)
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), folder / name)
        if tokenizer_patch == "other":  # another tokenizer (its template alone would not count: test_config_manifest)
            spec = json.loads((folder / "tokenizer.json").read_text())
            spec["pre_tokenizer"]["add_prefix_space"] = True
            (folder / "tokenizer.json").write_text(json.dumps(spec))
        if tokenizer_patch == "saved again":  # by transformers: other bytes (and fields), the same ids
            transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(folder)

    checkpoint(tmp_path / "other-tok", 49152, tokenizer_patch="other")
    with pytest.raises(TrainError, match=r"tokenizer .vocabulary. hash.* \(they tokenize 'Hello, world! How are you "
                                         r"today\?' differently\)\. Preprocess with the model's tokenizer"):
        train(config(synthetic, tmp_path / "c", model=str(tmp_path / "other-tok"), max_steps=1))
    checkpoint(tmp_path / "small-vocab", 1000, tokenizer_patch=None)
    with pytest.raises(TrainError, match="49152 tokens, the model's embedding only 1000"):
        train(config(synthetic, tmp_path / "d", model=str(tmp_path / "small-vocab"), max_steps=1))
    checkpoint(tmp_path / "same", 49152, tokenizer_patch="saved again")
    result = train(config(synthetic, tmp_path / "e", model=str(tmp_path / "same"), max_steps=2, logging={"steps": 1}))
    assert [h["step"] for h in result.history] == [1, 2]


def test_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX imports torch when installed (it is, in the test environment): memory a
    training process has no use for. rmflow's writer keeps it out."""
    import textwrap

    script = textwrap.dedent(f'''
        import sys
        import importlib.util
        assert importlib.util.find_spec("torch") is not None, "the test needs torch installed"
        from rmflow.trainer.tensorboard import summary_writer
        w = summary_writer({str(tmp_path)!r})
        w.add_scalar("loss", 1.0, 1)
        w.close()
        assert "torch" not in sys.modules
        print("OK")
    ''')
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]
    assert os.listdir(tmp_path)


@pytest.mark.slow
def test_a_second_run_compiles_nothing_the_first_compiled(synthetic, tmp_path):
    """The persistent compilation cache: a rerun (as a resume or a new run of the same shapes
    is) reads every executable, train and eval steps included, from the cache, also with other
    optimizer numbers (they are arguments of the step, not constants compiled into it). In one
    process a second run compiles and reads nothing at all."""
    from rmflow.trainer.step import forget_compiled

    events = {"executables": 0, "read": 0}  # JAX times a cache read as a backend compile too

    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            events["executables"] += 1

    def on_event(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            events["read"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    other = dict(optimizer={"learning_rate": 3e-4, "learning_rate_end": 1e-5, "warmup_steps": 2},
                 center_rewards_coefficient=0.01)  # adam's betas and the schedule's kind are the program's
    try:
        cache = tmp_path / "cache"
        forget_compiled()
        first = train(config(synthetic, tmp_path / "a", max_steps=6, logging={"steps": 3}, compilation_cache=str(cache)))
        assert events["executables"] > events["read"] and os.listdir(cache)
        # XLA's own caches (a GPU's autotuning, per fusion) are kept in the same folder
        assert jax.config.jax_persistent_cache_enable_xla_caches == "xla_gpu_per_fusion_autotune_cache_dir"
        events.update(executables=0, read=0)
        forget_compiled()  # as a new process
        second = train(config(synthetic, tmp_path / "b", max_steps=6, logging={"steps": 3}, compilation_cache=str(cache), **other))
        assert events["read"] >= 2 and events["executables"] == events["read"], events  # none compiled
        lr = [json.loads(x)["learning_rate"] for x in open(tmp_path / "b" / "metrics.jsonl") if "loss" in x]
        assert lr and lr != [json.loads(x)["learning_rate"] for x in open(tmp_path / "a" / "metrics.jsonl")
                             if "loss" in x]  # the other numbers took effect
        assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(first.state.params),
                                                           jax.tree.leaves(second.state.params)))
        events.update(executables=0, read=0)
        train(config(synthetic, tmp_path / "b2", max_steps=6, logging={"steps": 3}, compilation_cache=str(cache)))
        assert events == {"executables": 0, "read": 0}, events  # in the same process: nothing at all
        forget_compiled()
        train(config(synthetic, tmp_path / "c", max_steps=1, compilation_cache="off"))  # one step shows it
        assert events["read"] == 0 and events["executables"] > 0
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


def test_compiling_ahead_trains_and_resumes_exactly_as_without(synthetic, tmp_path):
    """compile_ahead reads batches ahead (trainer.data.lookahead): the same batches, the same
    parameters, and a resume from a middle checkpoint continues on exactly the next batch."""
    from rmflow.trainer.train import compile_ahead_steps

    assert compile_ahead_steps(-1, "cpu", 1) == 0 and compile_ahead_steps(-1, "gpu", 1) == 8
    assert compile_ahead_steps(3, "cpu", 1) == 3 and compile_ahead_steps(3, "gpu", 2) == 0
    plain = train(config(synthetic, tmp_path / "plain", max_steps=8, logging={"steps": 2}, compile_ahead=0))
    ahead = train(config(synthetic, tmp_path / "ahead", max_steps=8, logging={"steps": 2}, checkpoint={"save_steps": 4}, compile_ahead=3))
    shutil.rmtree(tmp_path / "ahead" / "checkpoints" / "8")  # as if stopped after step 4's save
    resumed = train(config(synthetic, tmp_path / "ahead", max_steps=8, logging={"steps": 2}, checkpoint={"save_steps": 4}, compile_ahead=3),
                    resume=True)
    for result in (ahead, resumed):
        assert timing_free(result.history) == timing_free(plain.history)
        for a, b in zip(jax.tree.leaves(result.state.params), jax.tree.leaves(plain.state.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_compiling_ahead_compiles_the_evaluations_shapes_in_the_background(synthetic, tmp_path, monkeypatch):
    """With compile_ahead, every shape the evaluations meet (the data's eval split and a named
    eval set) is compiled off the training thread while training runs, and the evaluation's
    metrics are those of a run compiling them when met."""
    import threading

    from rmflow.trainer import step as step_module

    compiled = []
    real = step_module.Trainer._compile

    def recording(self, step, abstract):
        compiled.append((step, threading.current_thread().name))
        return real(self, step, abstract)

    other = shutil.copytree(synthetic, tmp_path / "other")  # a named eval set (a copy: not the training folder)

    def run_config(out, ahead):
        cfg = config(synthetic, out, max_steps=8, compile_ahead=ahead)  # evaluated at the end
        return TrainConfig.from_dict({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "eval": {"again": str(other)}}})

    plain = train(run_config(tmp_path / "plain", 0))
    step_module.forget_compiled()
    monkeypatch.setattr(step_module.Trainer, "_compile", recording)
    ahead = train(run_config(tmp_path / "ahead", 3))
    evals = [thread for step, thread in compiled if step == "eval"]
    assert evals and all(t.startswith("rmflow-compile") for t in evals), compiled
    keys = [k for k in step_module._EXECUTABLES if k[-1][0] == "eval"]
    assert len(keys) == len(evals)  # every evaluated shape was one compiled ahead: none compiled when met
    for a, b in zip(timing_free(ahead.history), timing_free(plain.history)):
        assert a == b
    assert any("eval/again/accuracy" in h for h in ahead.history)

"""Two processes on localhost (JAX's CPU collectives, 2 devices each) train like one process fed
the same global batch: each process reads its own slice of the shards, global batches are built
from process-local data, both processes save and restore the checkpoint (with their own Grain
iterator state), and a run resumed from its step-2 checkpoint by both processes ends exactly where
the uninterrupted one did. Every process is killed at a deadline: a stalled one cannot hang CI."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = REPO / "rmflow" / "demo"
DEADLINE = 300  # seconds for a whole multi-process run
STEPS = 10

WORKER = textwrap.dedent('''
    import sys
    STEPS = @STEPS@
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.train import run
    data, output, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    run(TrainConfig(data={"train": data, "packing": "pack"}, model="micro", output=output, max_steps=STEPS,
                    batch_size=8, checkpoint={"save_steps": 2}, logging={"steps": 1},
                    optimizer={"learning_rate": 1e-3, "adam_eps": 1e-6}), resume=resume)
    print("WORKER DONE")
''').replace("@STEPS@", str(STEPS))

REFERENCE = textwrap.dedent('''
    import json, sys
    STEPS = @STEPS@
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.data import LoaderSpec, lengths_per_doubling, make_loader
    from rmflow.trainer.batching import stack_micro_batches
    from rmflow.trainer.batching import widen as _widen
    from rmflow.trainer.model_setup import build_model, read_manifest, shard_paths
    from rmflow.trainer.objective import for_config
    from rmflow.trainer.step import make_trainer
    from rmflow.trainer.checkpoints import load_trained_model
    data, run_dir = sys.argv[1], sys.argv[2]
    cfg = TrainConfig(data={"train": data, "packing": "pack"}, model="micro", output=run_dir, max_steps=STEPS,
                      batch_size=8, checkpoint={"save_steps": 2}, logging={"steps": 1},
                      optimizer={"learning_rate": 1e-3, "adam_eps": 1e-6})
    manifest = read_manifest(data)
    trainer = make_trainer(cfg, build_model(cfg, manifest, for_config(cfg, manifest)), STEPS)
    paths = shard_paths(data, manifest, "train")
    # What process i of 2 reads: half the pairs of each global batch, packed into its 2 rows.
    its = [iter(make_loader(paths, LoaderSpec(batch_size=4, max_length=manifest.max_length, seed=cfg.seed, num_epochs=None,
                            pad_id=manifest.tokenizer.pad_token_id or 0, packing="pack", rows=2, shard=(i, 2),
                            per_doubling=lengths_per_doubling(STEPS))))
           for i in range(2)]
    state, losses = trainer.init_state, []
    for _ in range(STEPS):
        local = [next(it) for it in its]
        length = max(b["input_ids"].shape[1] for b in local)
        parts = [stack_micro_batches([_widen(b, length)]) for b in local]
        batch = {k: jnp.asarray(np.concatenate([p[k] for p in parts], axis=1)) for k in parts[0]}
        state, m = trainer.train_step(state, batch)
        losses.append(float(m["loss_sum"]) / float(m["pairs"]))
    got = [json.loads(line)["loss"] for line in open(run_dir + "/metrics.jsonl")]
    np.testing.assert_allclose(got, losses, atol=1e-5, rtol=0)
    trained, _, _ = load_trained_model(run_dir)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(nnx.state(trained, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    print("REFERENCE OK")
''').replace("@STEPS@", str(STEPS))

# The run killed and resumed (argv[3]) ends with the uninterrupted run's (argv[2]) exact parameters.
RESUMED_EQUALS = textwrap.dedent('''
    (a, _, sa), (b, _, sb) = load_trained_model(run_dir), load_trained_model(sys.argv[3])
    assert sa == sb == STEPS
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    print("RESUME OK")
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_processes(data: pathlib.Path, output: pathlib.Path, resume: bool) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip(),
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(data), str(output), "1" if resume else "0"],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def wait_all(procs: list[subprocess.Popen]) -> list[str]:
    deadline = time.monotonic() + DEADLINE
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a process stalled past the {DEADLINE} s deadline; both killed")
    for p, out in zip(procs, outputs):
        assert p.returncode == 0 and "WORKER DONE" in out, out[-4000:]
    return outputs


def run_two_processes(data: pathlib.Path, output: pathlib.Path, resume: bool) -> list[str]:
    return wait_all(start_two_processes(data, output, resume))


def kill_both_after(procs: list[subprocess.Popen], metrics: pathlib.Path, step: int) -> int:
    """SIGKILL both processes once process 0 has logged ``step``; returns the last logged step."""
    deadline = time.monotonic() + DEADLINE
    last = 0
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            last = json.loads(lines[-1])["step"] if lines else 0
            if last >= step:
                break
        time.sleep(0.02)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
    return last


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_exactly(demo_shards, tmp_path):
    shards = demo_shards
    run_two_processes(shards, tmp_path / "a", resume=False)
    # Both processes saved: one checkpoint, with each process's Grain iterator state.
    data_items = sorted(p.name for p in (tmp_path / "a" / "checkpoints" / str(STEPS) / "data").iterdir())
    assert any("process_0" in n for n in data_items) and any("process_1" in n for n in data_items), data_items

    # Both processes killed (SIGKILL) mid-run, after a checkpoint, then resumed by both.
    procs = start_two_processes(shards, tmp_path / "b", resume=False)
    last = kill_both_after(procs, tmp_path / "b" / "metrics.jsonl", step=3)
    assert 3 <= last < STEPS, f"the run was not interrupted (last logged step {last})"
    run_two_processes(shards, tmp_path / "b", resume=True)

    # One process checks both (one start-up, not two): the uninterrupted two-process run equals one
    # process fed the same global batches, and the resumed run ends with its exact parameters.
    ref = subprocess.run([sys.executable, "-c", REFERENCE + RESUMED_EQUALS, str(shards), str(tmp_path / "a"),
                          str(tmp_path / "b")], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=DEADLINE)
    assert ref.returncode == 0 and "REFERENCE OK" in ref.stdout, (ref.stdout[-2000:], ref.stderr[-4000:])
    assert "RESUME OK" in ref.stdout, ref.stderr[-4000:]
    # ... and the same losses, step by step.
    la = [json.loads(x)["loss"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert la == lb and len(la) == STEPS
    pairs = [json.loads(x)["pairs"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert pairs == [8] * STEPS  # the global batch: 4 pairs from each process

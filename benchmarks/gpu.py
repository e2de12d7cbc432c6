"""The GPU check in one command: kernel parity, packed against bucketed speed, rmflow beside TRL,
and a real model trained by both; one JSON and one Markdown table.

Two steps, because the GPU machine has no Beam and no network:

1. Here (CPU, Beam installed): ``python benchmarks/gpu.py prepare INPUTS`` preprocesses every data
   set the check reads into ``INPUTS`` (shards of the shared HH-RLHF and UltraFeedback pairs at
   max_length 2048 with SmolLM2's tokenizer, LLMBar as a second eval set) and downloads into
   ``INPUTS/wheels`` the packages the GPU image lacks (grain, array-record, trl, datasets and
   their own missing needs; ``--no-wheels`` skips that). Carry ``INPUTS`` to the GPU machine.
2. There: ``python benchmarks/gpu.py run INPUTS OUT [--checkpoint SMOLLM2]`` installs the wheels
   into a folder of its own (``/tmp/rmflow-gpu-site``, put on this process's and its children's
   path), then runs the parts and writes ``OUT/gpu.json`` and ``OUT/gpu.md``, each part's rows as
   it finishes (a part that fails is recorded with its error; the others still run):
   - ``parity``: each attention implementation (blockwise, cudnn, pallas) against the dense
     reference on packed rows, float32 and bfloat16, outputs and gradients;
   - ``speed``: training throughput (real tokens/s, MFU) with Qwen2.5-0.5B- and SmolLM2-135M-shaped
     weights at max_length 2048 in bfloat16: ``pack`` with each packed-row kernel and block size
     against ``bucket`` with cuDNN;
   - ``trl``: TRL's RewardTrainer and rmflow on the same model, data, batch and recipe, bfloat16,
     TRL with sdpa attention, gradient checkpointing off and on: real tokens/s and peak memory;
   - ``real``: the model of ``--checkpoint`` (the real SmolLM2-135M-Instruct: build it with
     ``../shared/tools/export_smollm2_hf.py``) trained into a reward model for one epoch of the
     HH-RLHF and UltraFeedback pairs by rmflow and by TRL with the same recipe, evaluated on the
     held-out split and LLMBar beside the length-only baseline; rmflow's run exported, and the
     export's scores in transformers (bfloat16) against rmflow's. Without ``--checkpoint``
     ``trl`` uses SmolLM2-shaped random weights and ``real`` is recorded as skipped.

``--rehearse`` runs the same code path on this CPU at toy sizes (a 2-layer model, short rows,
a few steps), preparing its inputs in a temporary folder: ``python benchmarks/gpu.py rehearse
OUT``. The test suite runs it (``tests/test_gpu_script.py``), so that GPU time goes to measuring.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
DATA = REPO.parent / "shared" / "data"
TOKENIZER = REPO.parent / "shared" / "assets" / "smollm2-135m-instruct-tokenizer"
SITE = pathlib.Path("/tmp/rmflow-gpu-site")
PARTS = ("parity", "speed", "trl", "real")
# What the GPU image lacks (its list: the device tool's KINDS.md); the versions this project installs.
WHEELS = ("grain", "array-record", "trl", "datasets", "dill", "multiprocess", "xxhash")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bfloat16, SXM; MFU as the README defines it

# Sizes: the GPU check's, and the rehearsal's (the same code path at toy sizes on CPU).
SIZES = {
    "gpu": {"max_length": 2048, "speed_models": ("Qwen2.5-0.5B", "SmolLM2-135M"), "speed_batch": 32, "speed_steps": 10,
            "blocks": (64, 128, 512), "packed_attention": ("blockwise", "pallas"), "parity_t": 2048,
            "trl_steps": 40, "trl_batch": 16, "checkpointing": (False, True), "real_batch": 16, "real_steps": 0,
            "lr": 1e-5},
    "rehearse": {"max_length": 256, "speed_models": ("toy",), "speed_batch": 4, "speed_steps": 2, "blocks": (64,),
                 "packed_attention": ("blockwise",), "parity_t": 256, "trl_steps": 6, "trl_batch": 2,
                 "parity_cases": (("blockwise", "float32", None), ("cudnn", "bfloat16", None),
                                  ("pallas", "float32", 100)),
                 "checkpointing": (True,),
                 "real_batch": 4, "real_steps": 3, "lr": 1e-4},
}
TOY = dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
           tie_word_embeddings=True, max_position_embeddings=4096)


# --------------------------------------------------------------------------- step 1: inputs, here


def prepare(inputs: pathlib.Path, max_length: int, wheels: bool, pairs: int | None = None) -> dict:
    """Shards of every data set the check reads, and the wheels the GPU image lacks."""
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
                import gzip

                with gzip.open(DATA / f, "rt") as src:
                    (small / f.replace(".gz", "")).write_text("".join(next(src) for _ in range(pairs)))
            paths = [str(small / f.replace(".gz", "")) for f in files]
        preprocess(PreprocessConfig(inputs=tuple(paths), output=str(inputs / name), tokenizer=str(TOKENIZER),
                                    max_length=max_length, eval_fraction=0.1 if name == "train" else 0.0,
                                    max_bad_fraction=0.5))
    if wheels:
        download_wheels(inputs / "wheels")
    info = {"max_length": max_length, "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (inputs / "inputs.json").write_text(json.dumps(info, indent=2))
    return info


def download_wheels(folder: pathlib.Path) -> None:
    """The packages of ``WHEELS`` at the versions installed here, as wheels for the GPU machine
    (Python 3.12, x86-64 manylinux), without their dependencies (the image has the rest)."""
    from importlib.metadata import version

    folder.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + \
        ["--platform=manylinux2014_x86_64", "--platform=any"]
    for name in WHEELS:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
                        f"{name}=={version(name)}"], check=True)


def install_wheels(folder: pathlib.Path) -> list[str]:
    """Install the carried wheels into ``SITE`` (once per machine) and put it on the path of this
    process and its children; returns what was installed."""
    wheels = sorted(str(p) for p in folder.glob("*.whl")) if folder.is_dir() else []
    if wheels and not (SITE / ".installed").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(SITE), *wheels], check=True)
        (SITE / ".installed").write_text("\n".join(wheels))
    if wheels:
        sys.path.insert(0, str(SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")])
    return [pathlib.Path(w).name for w in wheels]


# --------------------------------------------------------------------------- step 2: the parts


def part_parity(size: dict, inputs: pathlib.Path, work: pathlib.Path, checkpoint: str | None) -> list[dict]:
    import device

    return device.check_parity(t=size["parity_t"], cases=size.get("parity_cases", device.PARITY_CASES),
                               longest=min(300, size["parity_t"] // 2))


def part_speed(size: dict, inputs: pathlib.Path, work: pathlib.Path, checkpoint: str | None) -> list[dict]:
    import device
    import jax

    records = device.load_records(inputs / "train")
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in jax.devices()[0].device_kind), 989.0)
    rows = []
    for name in size["speed_models"]:
        config = TOY if name == "toy" else None
        for impl in size["packed_attention"]:
            for block in size["blocks"]:
                rows.append(device.throughput(name, records, "pack", size["speed_batch"], size["speed_steps"], peak,
                                              block, impl, max_length=size["max_length"], config=config))
        rows.append(device.throughput(name, records, "bucket", size["speed_batch"], size["speed_steps"], peak, 0,
                                      max_length=size["max_length"], config=config))
    best = {}
    for r in rows:  # the fastest packed configuration of each model against bucket
        key = (r["model"], r["packing"])
        best[key] = max(best.get(key, r), r, key=lambda x: x["real_tokens_per_s"])
    for name in size["speed_models"]:
        pack, bucket = best[(name, "pack")], best[(name, "bucket")]
        rows.append({"model": name, "summary": "pack / bucket", "ratio": pack["real_tokens_per_s"]
                     / bucket["real_tokens_per_s"], "pack_mfu": pack["mfu"], "pack_attention": pack["attention"],
                     "pack_block": pack["block"]})
    return rows


def model_folder(work: pathlib.Path, inputs: pathlib.Path, checkpoint: str | None, rehearse: bool) -> str:
    """The model both trainers start from: ``checkpoint``, else random weights of SmolLM2's shape
    (the toy's in a rehearsal), built with transformers and saved with the tokenizer."""
    if checkpoint:
        return checkpoint
    import device
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(TOY if rehearse else device.CONFIGS["SmolLM2-135M"])
    shape.pop("model_type")
    manifest = json.loads((inputs / "train" / "manifest.json").read_text())
    torch.manual_seed(0)
    folder = work / "model"
    LlamaForCausalLM(LlamaConfig(**shape, pad_token_id=manifest["tokenizer"]["pad_token_id"])).save_pretrained(folder)
    for f in (inputs / "train" / "tokenizer").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return str(folder)


def _side_by_side(size: dict, inputs: pathlib.Path, work: pathlib.Path, model: str, steps: int, batch: int,
                  grad_ckpt: bool, trl_order: str, eval_sets: dict, rehearse: bool) -> dict[str, dict]:
    import vs_trl

    gpu = not rehearse
    train_pairs = json.loads((inputs / "train" / "manifest.json").read_text())["splits"]["train"]["pairs"]
    steps = steps or -(-train_pairs // batch)  # 0: one epoch
    base = {"shards": str(inputs / "train"), "model": model, "steps": steps, "batch": batch, "lr": size["lr"],
            "warmup": max(steps // 10, 1), "center": 0.01, "max_length": size["max_length"], "trl_order": trl_order,
            "device": "gpu" if gpu else "cpu", "bf16": gpu, "dtype": "bfloat16" if gpu else "float32",
            "attn": "sdpa", "grad_ckpt": grad_ckpt, "eval_sets": eval_sets, "mode": "pack" if rehearse else "auto"}
    out = {}
    for kind, name in (("trl", "TRL RewardTrainer"), ("rmflow", "rmflow")):
        args = {**base, "work": str(work / f"{kind}-{int(grad_ckpt)}-{trl_order}"), "cache": str(work / "jax-cache")}
        result, launched = vs_trl.launch(kind, args)
        out[name] = vs_trl.summarize(name, result, min(3, steps - 2), launched)
    return out


def _ratios(pair: dict[str, dict]) -> dict:
    trl, rm = pair["TRL RewardTrainer"], pair["rmflow"]
    peak = "peak_device_mib" if rm.get("peak_device_mib") and trl.get("peak_device_mib") else "peak_mib"
    return {"tokens_per_s": rm["tokens_per_s"] / trl["tokens_per_s"], "e2e": trl["e2e"] / rm["e2e"],
            "peak_memory": rm[peak] / trl[peak], "peak_measure": peak}


def _row(name: str, r: dict, **extra) -> dict:
    keep = ("tokens_per_s", "e2e", "wall", "peak_mib", "peak_device_mib", "padding", "compiles", "compile_s", "loss",
            "eval_accuracy", "eval_pairs", "eval_sets", "steps_run")
    return {"trainer": name, **extra, **{k: r.get(k) for k in keep}}


def part_trl(size: dict, inputs: pathlib.Path, work: pathlib.Path, checkpoint: str | None, rehearse: bool) -> list[dict]:
    model = model_folder(work, inputs, checkpoint, rehearse)
    rows = []
    for grad_ckpt in size["checkpointing"]:
        pair = _side_by_side(size, inputs, work, model, size["trl_steps"], size["trl_batch"], grad_ckpt, "same", {},
                             rehearse)
        rows += [_row(name, r, gradient_checkpointing=grad_ckpt) for name, r in pair.items()]
        rows.append({"summary": "rmflow / TRL", "gradient_checkpointing": grad_ckpt, **_ratios(pair)})
    return rows


def length_baseline(folder: pathlib.Path, split: str) -> float:
    """Accuracy of 'the longer reply wins' (ties wrong)."""
    import vs_trl

    recs = vs_trl.records(folder, split)
    return sum((len(r.chosen_ids) > len(r.rejected_ids)) for r in recs) / max(len(recs), 1)


def export_parity(run: str, out: pathlib.Path, rehearse: bool) -> dict:
    """rmflow's export scored by transformers (bfloat16 on the GPU) against rmflow's own scores."""
    import numpy as np
    import torch
    import vs_trl
    from rmflow.trainer.checkpoints import load_trained_model
    from rmflow.trainer.export import export
    from rmflow.trainer.inference import score_sequences
    from transformers import AutoModelForSequenceClassification

    folder = export(run, str(out))
    model, loaded_run, _ = load_trained_model(run)
    recs = vs_trl.records(pathlib.Path(loaded_run.config.data), "eval")[:16]
    seqs = [r.chosen_ids for r in recs] + [r.rejected_ids for r in recs]
    ours = score_sequences(model, seqs, pad_id=loaded_run.pad_id)
    dtype = torch.float32 if rehearse else torch.bfloat16
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).to("cpu" if rehearse else "cuda").eval()
    with torch.no_grad():
        theirs = np.array([float(hf(input_ids=torch.tensor([s.tolist()], device=hf.device)).logits[0, 0]) for s in seqs])
    diff = float(np.max(np.abs(ours - theirs)))
    return {"summary": "export in transformers", "dtype": str(dtype).split(".")[-1], "sequences": len(seqs),
            "max_abs_diff": diff, "limit": 1e-3 if not rehearse else 1e-4}


def part_real(size: dict, inputs: pathlib.Path, work: pathlib.Path, checkpoint: str | None, rehearse: bool) -> list[dict]:
    if not checkpoint and not rehearse:
        return [{"skipped": "no --checkpoint: build SmolLM2-135M-Instruct with ../shared/tools/export_smollm2_hf.py"}]
    model = model_folder(work, inputs, checkpoint, rehearse)
    pair = _side_by_side(size, inputs, work, model, size["real_steps"], size["real_batch"], False, "own",
                         {"llmbar": str(inputs / "llmbar")}, rehearse)
    rows = [_row(name, r) for name, r in pair.items()]
    rows.append({"summary": "length-only baseline", "eval_accuracy": length_baseline(inputs / "train", "eval"),
                 "eval_sets": {"llmbar": length_baseline(inputs / "llmbar", "all")}})
    trl, rm = pair["TRL RewardTrainer"], pair["rmflow"]
    rows.append({"summary": "rmflow - TRL", "eval_accuracy_points": 100 * (rm["eval_accuracy"] - trl["eval_accuracy"]),
                 "llmbar_points": 100 * (rm["eval_sets"]["llmbar"] - trl["eval_sets"]["llmbar"]),
                 "wall_ratio": trl["wall"] / rm["wall"], **_ratios(pair)})
    rows.append(export_parity(rm["run"], work / "export", rehearse))
    return rows


# --------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "", f"Command: `{report['command']}`  ", f"Date: {report['date']}  ",
             f"JAX {report['jax']}; wheels installed: {', '.join(report['wheels']) or 'none'}", ""]
    for part, rows in report["parts"].items():
        lines += [f"## {part}", ""]
        if isinstance(rows, dict) and "error" in rows:
            lines += ["```", rows["error"][-2000:], "```", ""]
            continue
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


def run(inputs: pathlib.Path, out: pathlib.Path, parts: list[str], checkpoint: str | None, rehearse: bool) -> dict:
    """Every part in turn; the report rewritten after each, so what ran survives a later failure."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(BENCH))
    wheels = install_wheels(inputs / "wheels")
    os.environ["JAX_PLATFORMS"] = "cpu" if rehearse else os.environ.get("JAX_PLATFORMS", "")
    import jax

    size = SIZES["rehearse" if rehearse else "gpu"]
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "wheels": wheels,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "rehearse": rehearse, "sizes": size, "parts": {}, "seconds": {}}
    fns = {"parity": part_parity, "speed": part_speed, "trl": part_trl, "real": part_real}
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            start = time.perf_counter()
            try:
                kwargs = {} if part in ("parity", "speed") else {"rehearse": rehearse}
                report["parts"][part] = fns[part](size, inputs, pathlib.Path(tmp), checkpoint, **kwargs)
            except Exception:  # noqa: BLE001 - one part's failure is reported; the others still run
                report["parts"][part] = {"error": traceback.format_exc()}
            report["seconds"][part] = time.perf_counter() - start
            (out / "gpu.json").write_text(json.dumps(report, indent=2, default=str))
            (out / "gpu.md").write_text(markdown(report))
            print(f"{part}: {report['seconds'][part]:.0f} s", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: shards and wheels for the GPU machine")
    p.add_argument("inputs")
    p.add_argument("--no-wheels", action="store_true")
    r = sub.add_parser("run", help="on the GPU machine: every part, into OUT/gpu.json and OUT/gpu.md")
    r.add_argument("inputs")
    r.add_argument("out")
    r.add_argument("--checkpoint", help="the SmolLM2-135M-Instruct checkpoint folder (for the trl and real parts)")
    r.add_argument("--parts", default=",".join(PARTS))
    h = sub.add_parser("rehearse", help="here: prepare and run at toy sizes on CPU")
    h.add_argument("out")
    h.add_argument("--parts", default=",".join(PARTS))
    a = ap.parse_args()
    if a.command == "prepare":
        print(json.dumps(prepare(pathlib.Path(a.inputs), SIZES["gpu"]["max_length"], not a.no_wheels)))
        return
    parts = [x for x in a.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts {','.join(unknown)}: use {','.join(PARTS)}")
    if a.command == "run":
        report = run(pathlib.Path(a.inputs), pathlib.Path(a.out), parts, a.checkpoint, rehearse=False)
    else:
        with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(REPO):
            prepare(pathlib.Path(tmp), SIZES["rehearse"]["max_length"], wheels=False, pairs=40)
            report = run(pathlib.Path(tmp), pathlib.Path(a.out).resolve(), parts, None, rehearse=True)
    failed = [p for p, rows in report["parts"].items() if isinstance(rows, dict) and "error" in rows]
    print(f"wrote {a.out}/gpu.json and gpu.md; parts failed: {', '.join(failed) or 'none'}; "
          f"{statistics.fsum(report['seconds'].values()):.0f} s in all")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

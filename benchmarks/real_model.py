"""A real pretrained model as a user meets it on this machine: compilation, first score, eval, LoRA.

SmolLM2-135M-Instruct (a Llama of 30 layers, hidden 576; build it offline with
``../shared/tools/export_smollm2_hf.py OUT``) on the shared HH-RLHF pairs, preprocessed with its
own tokenizer. Each measurement runs in a process of its own with the persistent compilation
cache off (a user's first run: every shape compiles), once per layer mode and repeat, the modes
alternating (scan, unrolled, scan, ...) so that a slow hour on this shared machine favours
neither. ``scan`` runs the decoder layers as one scanned layer (``scan_layers: on``, what
``auto`` picks with LoRA and for scoring); ``unrolled`` is each layer its own copy in the
compiled program (``off``, what ``auto`` picks for full fine-tuning).

Parts:
- ``full`` / ``lora``: ``rmflow train`` for ``--steps`` steps of ``--batch-size`` pairs (``pack``):
  the first step's seconds (its compilation), the median later step, and the peak resident
  memory while training. ``lora`` is rank 16 on all linear layers, dropout 0.05.
- ``score``: loading the checkpoint and scoring 20 conversations through the Python API's
  scorer (the first call compiles): seconds to load, seconds for the first 20 scores.
- ``eval``: the pairs of ``--eval-pairs`` records scored as ``rmflow eval`` scores them
  (``score_pairs``), from a model freshly loaded: seconds.

    .venv/bin/python benchmarks/real_model.py --model /tmp/smollm2 [--parts full,lora,score,eval]
        [--layers scan,unrolled] [--repeat 1] [--steps 6] [--batch-size 4] [--max-length 512]
        [--eval-pairs 352]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import SHARED_DATA as DATA

START = time.perf_counter()
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PARTS = ("full", "lora", "score", "eval")
LORA = {"rank": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}


def prepare(work: pathlib.Path, model: str, max_length: int) -> str:
    """The HH-RLHF pairs as shards, tokenized by the model's own tokenizer (1% held out: the end-of-run
    evaluation stays short; `eval` scores train pairs)."""
    import logging

    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig

    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    shards = work / "shards"
    preprocess(PreprocessConfig(inputs=(str(DATA / "hh_helpful_base_test_first2000.jsonl.gz"),), output=str(shards),
                                tokenizer=model, max_length=max_length, eval_fraction=0.01))
    return str(shards)


def _records(shards: str, split: str, n: int):
    import grain
    from rmflow.schemas.record import decode

    paths = sorted(str(p) for p in pathlib.Path(shards).glob(f"{split}-*.array_record"))
    source = grain.sources.ArrayRecordDataSource(paths)
    return [decode(source[i]) for i in range(min(n, len(source)))]


def _peak_sampler():
    from train import RssSampler  # benchmarks/train.py

    return RssSampler()


def child_train(args: dict) -> dict:
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.train import run as train

    times, last = [], [time.perf_counter()]

    def on_log(_):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    cfg = TrainConfig(data={"train": args["shards"], "packing": "pack"},
                      model={"path": args["model"], "scan_layers": "on" if args["layers"] == "scan" else "off"},
                      output=args["work"], max_steps=args["steps"], batch_size=args["batch"],
                      optimizer={"learning_rate": 1e-5}, logging={"steps": 1, "report_to": ()}, eval_steps=0,
                      checkpoint={"save_steps": 0}, seed=0, compilation_cache="off",
                      lora=LORA if args["part"] == "lora" else None)
    sampler = _peak_sampler()
    last[0] = time.perf_counter()
    train(cfg, on_log=on_log)
    peak = sampler.stop()
    return {"first_step_s": times[0], "step_s": statistics.median(times[1:]) if len(times) > 1 else float("nan"),
            "peak_mib": peak}


def _loaded(model: str, layers: str):
    """The checkpoint as the API loads it (``trainer.inference.load_model``), with the layer mode asked."""
    from rmflow.trainer.inference import LoadedModel
    from rmflow.trainer.modeling.convert import load_reward_model

    with open(os.path.join(model, "config.json")) as f:
        pad = json.load(f).get("pad_token_id") or 0
    return LoadedModel(load_reward_model(model, scan_layers=layers == "scan"), model, pad, f"checkpoint {model}", model)


def child_score(args: dict) -> dict:
    import gzip

    from rmflow.rendering.formats import parse_hh_transcript
    from transformers import AutoTokenizer

    from rmflow.scoring.api import RewardModel

    with gzip.open(DATA / "hh_helpful_base_test_first2000.jsonl.gz", "rt") as f:
        rows = [json.loads(next(f)) for _ in range(20)]
    conversations = [[{"role": role, "content": text} for role, text in parse_hh_transcript(row["chosen"], "chosen")]
                     for row in rows]
    t0 = time.perf_counter()
    rm = RewardModel(_loaded(args["model"], args["layers"]), AutoTokenizer.from_pretrained(args["model"]))
    t1 = time.perf_counter()
    scores = rm.score(conversations)
    t2 = time.perf_counter()
    again = rm.score(conversations)
    t3 = time.perf_counter()
    return {"load_s": t1 - t0, "first_score_s": t2 - t1, "again_s": t3 - t2, "n": len(scores),
            "same": bool((abs(scores - again) < 1e-5).all())}


def child_eval(args: dict) -> dict:
    from rmflow.trainer.inference import score_pairs

    records = _records(args["shards"], "train", args["eval_pairs"])
    t0 = time.perf_counter()
    loaded = _loaded(args["model"], args["layers"])
    chosen, rejected = score_pairs(loaded.model, records, pad_id=loaded.pad_id)
    return {"eval_s": time.perf_counter() - t0, "pairs": len(records),
            "accuracy": float((chosen > rejected).mean())}


def launch(args: dict) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "RMFLOW_COMPILATION_CACHE": "off"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        raise SystemExit(f"{args['part']} ({args['layers']}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


COLUMNS = {"full": ("first_step_s", "step_s", "peak_mib"), "lora": ("first_step_s", "step_s", "peak_mib"),
           "score": ("load_s", "first_score_s", "again_s"), "eval": ("eval_s",)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face checkpoint folder with its tokenizer (required)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--layers", default="scan,unrolled", help="layer modes to compare, alternated: scan, unrolled")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--eval-pairs", type=int, default=352)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        args = json.loads(a.child)
        fn = {"full": child_train, "lora": child_train, "score": child_score, "eval": child_eval}[args["part"]]
        print(json.dumps(fn(args)))
        return
    if not a.model:
        ap.error("--model: the checkpoint folder to measure (../shared/tools/export_smollm2_hf.py OUT builds SmolLM2)")
    parts = [p for p in a.parts.split(",") if p]
    layers = [m for m in a.layers.split(",") if m]
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        shards = prepare(pathlib.Path(tmp), a.model, a.max_length)
        for part in parts:
            for rep in range(a.repeat):
                for mode in layers if rep % 2 == 0 else layers[::-1]:  # ABBA...: neither side always first
                    args = {"part": part, "layers": mode, "model": a.model, "shards": shards, "steps": a.steps,
                            "batch": a.batch_size, "eval_pairs": a.eval_pairs,
                            "work": f"{tmp}/run-{part}-{mode}-{rep}"}
                    out = launch(args)
                    results.setdefault((part, mode), []).append(out)
                    print(f"  {part} {mode} repeat {rep + 1}: {json.dumps(out)}", flush=True)
    print(f"\n{a.model}: {a.steps} steps of {a.batch_size} pairs, max_length {a.max_length}, CPU "
          f"({os.cpu_count()} cores), compilation cache off; median of {a.repeat} run(s), spread = min..max")
    for part in parts:
        cols = COLUMNS[part]
        print(f"\n| {part} | " + " | ".join(cols) + " |\n| --- |" + " --- |" * len(cols))
        for mode in layers:
            rs = results[(part, mode)]
            cells = [f"{statistics.median(r[c] for r in rs):,.1f} ({min(r[c] for r in rs):,.1f}.."
                     f"{max(r[c] for r in rs):,.1f})" for c in cols]
            print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

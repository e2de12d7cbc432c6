"""rmflow against TRL's RewardTrainer on the same workload, back to back in one run.

The same real HH-RLHF pairs (../shared/data), tokenized once by `rmflow preprocess` with the
SmolLM2 tokenizer and fed to both as the same token ids, in the same batches (TRL reads the
pairs in the order of rmflow's seeded loader; rmflow's `bucket` mode regroups them); the same tiny Llama built once with
transformers and saved (both load it, score head included); the same max_length, pairs per
step, learning-rate schedule (linear warmup, linear decay to 0), AdamW settings, gradient
clipping, centering coefficient and number of steps. Each trainer runs in a process of its
own (so peak memory is its own) and rmflow runs once per packing mode.

Printed for each: real tokens/s (tokens of the chosen and rejected sequences, prompt counted
in both, as TRL counts them; steady state: steps that compiled nothing, after the first
`--skip` steps), compilations and their seconds, padding fraction of the computed batches,
peak resident memory, the mean training loss over the last 10 steps, and accuracy on the
same held-out pairs; then the ratios rmflow / TRL. Besides the steady state, **end to end**: the
wall time from launching the trainer's process to the end of its last training step, so
Python's start-up, imports, data set-up, model loading and every compilation are included
(the held-out evaluation is not: TRL's is this script's own loop). rmflow starts with an
empty persistent compilation cache (a cold start, as a user's first run); ``--warm`` also
times a second rmflow run that finds the first run's cache. The end-to-end ratio compares
real tokens trained per second of that wall time (packing ``fixed``'s steps hold
``batch_size`` pairs on average, not each; for the other modes it is the ratio of wall times).

``--vocab`` picks the tokenizers, each its own workload: ``smollm2`` (SmolLM2's 49,152
tokens) and ``bpe8k`` (an 8,192-token byte-level BPE trained on the same HH-RLHF data,
``benchmarks/vocab.py``): the vocabulary sets the embedding's and optimizer's share of a step.
``--steps 0`` runs one full epoch of the train split.

    .venv/bin/python benchmarks/vs_trl.py [--vocab smollm2,bpe8k] [--steps 40 | --steps 0] [--batch-size 8]
        [--max-length 512] [--modes pack] [--warm] [--repeat 1] [--trl-order same|own]

Needs the `bench` extra (`pip install -e '.[bench]'`: trl, torch CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import SHARED_DATA as DATA

START = time.time()  # this process's start, for a child's end-to-end time
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from vocab import tokenizer_folder  # noqa: E402 - after the verbosity is set: it imports transformers

MODES = ("none", "bucket", "pack", "fixed")
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096)


def records(shards: pathlib.Path, split: str):
    """The records of a shard folder's split (``all``: every split)."""
    import grain
    from rmflow.schemas.record import decode

    paths = sorted(str(p) for p in shards.glob(f"{'*' if split == 'all' else split}-*.array_record"))
    source = grain.sources.ArrayRecordDataSource(paths)
    return [decode(source[i]) for i in range(len(source))]


def rmflow_order(num_records: int, count: int) -> list[int]:
    """The record order of rmflow's loader (seed 0, one process) for packing none and pack."""
    import grain

    sampler = grain.samplers.IndexSampler(num_records=num_records, shard_options=grain.sharding.NoSharding(),
                                          shuffle=True, num_epochs=None, seed=0)
    return [sampler[i].record_key for i in range(count)]


def prepare(work: pathlib.Path, max_length: int, vocab: str) -> dict:
    """Shards (rmflow preprocess) and the initial model (transformers), made once per vocabulary."""
    import torch
    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig
    from rmflow.schemas.manifest import Manifest
    from transformers import LlamaConfig, LlamaForSequenceClassification

    shards = work / "shards"
    preprocess(PreprocessConfig(inputs=(str(DATA / "hh_helpful_base_test_first2000.jsonl.gz"),
                                        str(DATA / "hh_helpful_rejection_sampled_test.jsonl.gz")),
                                output=str(shards), tokenizer=str(tokenizer_folder(vocab, work)),
                                max_length=max_length))
    manifest = json.loads((shards / "manifest.json").read_text())
    tok = manifest["tokenizer"]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok["vocab_size"], num_labels=1, pad_token_id=tok["pad_token_id"],
                         eos_token_id=tok["eos_token_id"], tie_word_embeddings=False, **TINY)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(work / "model")
    for f in (shards / "tokenizer").iterdir():  # the model folder carries the shards' tokenizer
        (work / "model" / f.name).write_bytes(f.read_bytes())
    return {"shards": str(shards), "model": str(work / "model"), "train_pairs": Manifest.from_json((shards / "manifest.json").read_text()).splits["train"].records}


# --------------------------------------------------------------------------- children


def child_trl(args: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    shards = pathlib.Path(args["shards"])
    train = records(shards, "train")
    if args["trl_order"] == "same":  # the pairs in rmflow's order, read in sequence
        order = rmflow_order(len(train), args["steps"] * args["batch"])
    else:  # every train pair, in the split's order: TRL's own seeded sampler shuffles them
        order = list(range(len(train)))
    ds = Dataset.from_dict({"chosen_ids": [train[i].chosen_ids.tolist() for i in order],
                            "rejected_ids": [train[i].rejected_ids.tolist() for i in order]})
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    gpu, bf16 = args.get("device", "cpu") == "gpu", bool(args.get("bf16"))
    extra = {"attn_implementation": args["attn"]} if args.get("attn") else {}
    model = AutoModelForSequenceClassification.from_pretrained(args["model"], dtype=torch.float32, num_labels=1,
                                                               **extra)
    if model.config.pad_token_id is None:  # a causal LM's config may name none: the tokenizer's, as TRL pads
        model.config.pad_token_id = tokenizer.pad_token_id
    steps: list[dict] = []

    class Collator(DataCollatorForPreference):  # records each batch's real and padded token counts
        def torch_call(self, examples):
            out = super().torch_call(examples)
            steps.append({"real": int(out["attention_mask"].sum()), "slots": int(out["attention_mask"].numel())})
            return out

    class Clock(TrainerCallback):  # wall time from one step's end to the next's, data loading included
        def on_train_begin(self, a, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            steps[state.global_step - 1]["seconds"], self.t = now - self.t, now

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class SameOrder(RewardTrainer):  # batches in the dataset's order: rmflow's batches, pair for pair
        def _get_train_sampler(self, *a, **kw):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    # transformers renamed the option (the old name still works there, with a FutureWarning)
    CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in RewardConfig.__dataclass_fields__
                     else "gradient_checkpointing")
    cfg = RewardConfig(output_dir=args["work"] + "/trl", max_steps=args["steps"],
                       per_device_train_batch_size=args["batch"],
                       learning_rate=args["lr"], lr_scheduler_type="linear", warmup_steps=args["warmup"],
                       weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                       center_rewards_coefficient=args["center"], max_length=args["max_length"], logging_steps=1,
                       save_strategy="no", report_to=[], use_cpu=not gpu, seed=0, dataloader_num_workers=0,
                       disable_tqdm=True, bf16=bf16, fp16=False, **{CHECKPOINTING: bool(args.get("grad_ckpt"))})
    trainer_cls = SameOrder if args["trl_order"] == "same" else RewardTrainer
    trainer = trainer_cls(model=model, args=cfg, train_dataset=ds, processing_class=tokenizer,
                            data_collator=Collator(pad_token_id=tokenizer.pad_token_id), callbacks=[Clock(), Losses()])
    start = time.perf_counter()
    trainer.train()
    wall, ended = time.perf_counter() - start, time.time()
    peak_device = torch.cuda.max_memory_allocated() / 2**20 if gpu else None
    model.eval()

    def accuracy(evals) -> float:
        correct = 0
        with torch.no_grad(), torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            for r in evals:
                rc = model(input_ids=torch.tensor([r.chosen_ids.tolist()], device=model.device)).logits[0, 0]
                rr = model(input_ids=torch.tensor([r.rejected_ids.tolist()], device=model.device)).logits[0, 0]
                correct += bool(rc > rr)
        return correct / len(evals)

    evals = records(shards, "eval")
    sets = {name: accuracy(records(pathlib.Path(folder), "all")) for name, folder in args.get("eval_sets", {}).items()}
    return {"steps": steps[: args["steps"]], "compiles": [], "wall": wall, "ended": ended, "losses": losses,
            "eval_accuracy": accuracy(evals), "eval_pairs": len(evals), "eval_sets": sets,
            "peak_device_mib": peak_device, "backend": "gpu" if model.device.type == "cuda" else "cpu"}


def child_rmflow(args: dict) -> dict:
    imported = time.time()
    import jax
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer import train
    from rmflow.trainer.train import run

    eval_seconds = [0.0]  # the held-out evaluation at the end: not part of the training time
    evaluate = train.Run.evaluate

    def timed_evaluate(self, params):
        t0 = time.perf_counter()
        out = evaluate(self, params)
        eval_seconds[0] += time.perf_counter() - t0
        return out

    train.Run.evaluate = timed_evaluate

    # Where a step's time goes, on the training thread: placing the batch on the device, looking at
    # the coming batches' shapes (compile_ahead), dispatching the jitted step (its wait for a
    # compilation included), waiting for the step's result; the rest is the host's own work (the
    # next batch from the loader, metrics).
    phases: dict[str, list[float]] = {"to_device": [], "ahead": [], "dispatch": [], "wait": [], "step": []}
    stepping = [False]

    def timed(fn, phase):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if stepping[0]:
                    phases[phase].append(time.perf_counter() - t0)
        return wrapper

    train.Run.to_device = timed(train.Run.to_device, "to_device")
    train.Run.compile_ahead = timed(train.Run.compile_ahead, "ahead")  # the coming batches' shapes looked at
    train.Trainer.train_step = timed(train.Trainer.train_step, "dispatch")
    train.jax.device_get = timed(train.jax.device_get, "wait")
    train_step = train.Loop.train_step

    def timed_step(self, state, step):
        stepping[0] = True
        t0 = time.perf_counter()
        try:
            return train_step(self, state, step)
        finally:
            stepping[0] = False
            phases["step"].append(time.perf_counter() - t0)

    train.Loop.train_step = timed_step

    compiles: list[tuple[float, float]] = []  # (when, seconds) of each executable compiled
    reads: list[tuple[float, float]] = []  # (when, seconds) of each executable read from the persistent cache
    hit = [False]

    def on_hit(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            hit[0] = True

    def on_event(event, duration, **kw):  # JAX times a cache read as a backend compile too
        if event == "/jax/core/compile/backend_compile_duration":
            if hit[0]:
                reads.append((time.perf_counter(), duration))
                hit[0] = False
            else:
                compiles.append((time.perf_counter(), duration))

    jax.monitoring.register_event_listener(on_hit)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    marks = [time.perf_counter()]
    history: list[dict] = []

    def on_log(rec):
        marks.append(time.perf_counter())
        history.append(rec)

    if args.get("kernel"):  # the packed-row kernels' settings a device measurement chose (benchmarks/gpu.py)
        from device import set_kernel

        set_kernel(**args["kernel"])
    cfg = TrainConfig(data={"train": args["shards"], "packing": args["mode"], "eval": args.get("eval_sets") or None},
                      model={"path": args["model"], "dtype": args.get("dtype", "float32"), "gradient_checkpointing": bool(args.get("grad_ckpt")), "attention": args.get("attention", "auto"), "scan_layers": args.get("scan_layers", "auto")},
                      output=args["work"] + f"/rm-{args['mode']}", max_steps=args["steps"], batch_size=args["batch"],
                      optimizer={"learning_rate": args["lr"], "warmup_steps": args["warmup"], "schedule": "linear", "max_grad_norm": 1.0},
                      center_rewards_coefficient=args["center"], objective=args.get("objective", "bradley-terry"), logging={"steps": 1, "report_to": ()}, seed=0,
                      compilation_cache=args["cache"])
    start = time.perf_counter()
    result = run(cfg, on_log=on_log)
    wall, ended = time.perf_counter() - start - eval_seconds[0], time.time() - eval_seconds[0]
    steps = []
    for i, rec in enumerate(history):
        t0, t1 = marks[i], marks[i + 1]
        n_compiles = sum(1 for when, _ in compiles + reads if t0 <= when <= t1)  # steps that made executables
        seconds = t1 - t0  # wall time from one step's log to the next's, data loading included
        parts = {k: v[i] for k, v in phases.items() if i < len(v)}
        steps.append({"real": rec["real_tokens"], "padding": rec["padding_fraction"], "seconds": seconds, "compiles": n_compiles,
                      "computed_fraction": rec.get("computed_fraction", 1.0), "parts": parts})
    final = result.history[-1]
    stats = jax.devices()[0].memory_stats() or {}
    return {"backend": jax.default_backend(), "steps": steps, "compiles": [d for _, d in compiles],
            "reads": [d for _, d in reads], "wall": wall, "ended": ended,
            "losses": [h["loss"] for h in history], "eval_accuracy": final["eval_accuracy"],
            "eval_pairs": final["eval_pairs"], "run": cfg.output,
            "eval_sets": {name: final[f"eval/{name}/accuracy"] for name in (args.get("eval_sets") or {})},
            "peak_device_mib": stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None,
            # where the time before the first step went: seconds from this script's start in the child
            # to its imports done, to ``run`` called, and to the first step's log
            "timeline": {"imported": round(imported - START, 2),
                         "run_called": round(time.time() - (time.perf_counter() - start) - START, 2),
                         "first_step_logged": round(time.time() - (time.perf_counter() - marks[1]) - START, 2)
                         if len(marks) > 1 else None}}


# --------------------------------------------------------------------------- parent


def summarize(name: str, out: dict, skip: int, launched: float) -> dict:
    steps = out["steps"]
    steady = [s for i, s in enumerate(steps) if i >= skip and not s.get("compiles")]
    # The last step also evaluates (rmflow) or may hold end-of-training work: left out of the steady state.
    steady = steady[:-1] if len(steady) > 1 else steady
    real = sum(s["real"] for s in steady)
    seconds = sum(s["seconds"] for s in steady)
    if "slots" in steps[0]:
        padding = 1 - sum(s["real"] for s in steps) / sum(s["slots"] for s in steps)
    else:
        padding = statistics.fmean(s["padding"] for s in steps)
    return {"name": name, "tokens_per_s": real / seconds if seconds else float("nan"), "steady_steps": len(steady),
            "padding": padding, "peak_mib": out["peak_mib"], "wall": out["wall"], "e2e": out["ended"] - launched,
            # real tokens trained a second, end to end: packing fixed's steps hold batch_size pairs on
            # average, not each, so runs of as many steps are compared by what they trained
            "e2e_rate": sum(s["real"] for s in steps) / (out["ended"] - launched),
            # compile_s sums each compilation's duration: compilations running at once (in the
            # background, on several threads) each count whole, so it can exceed the wall time they took
            "compiles": len(out["compiles"]), "compile_s": sum(out["compiles"]), "reads": len(out.get("reads", [])),
            "loss": statistics.fmean(out["losses"][-10:]), "eval_accuracy": out["eval_accuracy"],
            "eval_pairs": out["eval_pairs"], "losses": out["losses"], "steps_run": len(steps),
            "eval_sets": out.get("eval_sets", {}), "peak_device_mib": out.get("peak_device_mib"), "run": out.get("run"),
            "computed": statistics.fmean(s.get("computed_fraction", 1.0) for s in steps), "step_ms": _step_ms(steady),
            "timeline": out.get("timeline")}


def _step_ms(steady: list[dict]) -> dict | None:
    """Median milliseconds of a steady step's parts (rmflow: ``child_rmflow``'s phases), and the
    host's own share: the step less the device placement, the look at the coming shapes, the dispatch and the wait."""
    parts = [s["parts"] for s in steady if s.get("parts", {}).get("step") is not None]
    if not parts:
        return None
    timed = ("to_device", "ahead", "dispatch", "wait")
    out = {k: 1000 * statistics.median(p.get(k, 0.0) for p in parts) for k in ("step", *timed)}
    out["host_other"] = 1000 * statistics.median(p["step"] - sum(p.get(k, 0.0) for k in timed) for p in parts)
    return out


def launch(kind: str, args: dict, timeout: float | None = None) -> tuple[dict, float]:
    """Run one trainer in a process of its own (stopped after ``timeout`` seconds) on the device
    ``args['device']`` names (``cpu``, the default, or ``gpu``: JAX picks the accelerator);
    returns its output and the launch time."""
    launched = time.time()
    env = dict(os.environ)
    if args.get("device", "cpu") == "cpu":
        env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
    else:
        env.pop("JAX_PLATFORMS", None)
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(args)], capture_output=True,
                              text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"{kind} stopped after {timeout:.0f} s:\n{(e.stderr or b'')[-4000:]!r}") from None
    if proc.returncode:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out.get("backend") and out["backend"] != args.get("device", "cpu"):
        raise SystemExit(f"{kind} ran on {out['backend']}, not on the {args.get('device', 'cpu')} it was launched for")
    return out, launched


def table(runs: dict[str, list[dict]], title: str, same_order: bool = True) -> None:
    print(f"\n{title}")
    trl = runs["TRL RewardTrainer"]
    ref = {k: statistics.median(r[k] for r in trl) for k in ("tokens_per_s", "peak_mib", "e2e", "e2e_rate")}
    head = ("run", "end to end s", "spread", "vs TRL", "steady real tok/s", "spread", "vs TRL", "padding",
            "computed/real", "peak MiB", "vs TRL", "compiles (s)", "from cache", "loss (last 10)", "eval acc")
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k, v in rs[0].items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
        lo, hi = min(r["tokens_per_s"] for r in rs), max(r["tokens_per_s"] for r in rs)
        elo, ehi = min(r["e2e"] for r in rs), max(r["e2e"] for r in rs)
        print(f"| {name} | {med['e2e']:,.0f} | {elo:,.0f}..{ehi:,.0f} | {med['e2e_rate'] / ref['e2e_rate']:.2f}x "
              f"| {med['tokens_per_s']:,.0f} | {lo:,.0f}..{hi:,.0f} | {med['tokens_per_s'] / ref['tokens_per_s']:.2f}x "
              f"| {med['padding']:.3f} | {med['computed']:.2f} | {med['peak_mib']:,.0f} "
              f"| {med['peak_mib'] / ref['peak_mib']:.2f}x | {med['compiles']:.0f} ({med['compile_s']:.1f}) "
              f"| {med['reads']:.0f} | {med['loss']:.4f} | {med['eval_accuracy']:.3f} ({rs[0]['eval_pairs']}) |")
    for name, rs in runs.items():  # the goals: end to end >= 2x TRL, steady >= 2.5x, peak memory <= TRL's
        if name.startswith("rmflow"):
            med = {k: statistics.median(r[k] for r in rs) for k in ("e2e_rate", "tokens_per_s", "peak_mib")}
            e2e, steady, peak = (med["e2e_rate"] / ref["e2e_rate"], med["tokens_per_s"] / ref["tokens_per_s"],
                                 med["peak_mib"] / ref["peak_mib"])
            verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
            print(f"{name}: end to end {e2e:.2f}x TRL ({verdict(e2e >= 2.0)}: goal >= 2x); steady {steady:.2f}x "
                  f"({verdict(steady >= 2.5)}: goal >= 2.5x); peak memory {peak:.2f}x ({verdict(peak <= 1.0)}: "
                  "goal <= 1x)")
    if not same_order:
        return
    trl_losses = trl[0]["losses"]
    for name, rs in runs.items():
        if "packing=none" in name or "packing=pack" in name:  # the same batches as TRL, step for step
            gap = max(abs(a - b) for a, b in zip(rs[0]["losses"], trl_losses))
            print(f"{name}: largest per-step training-loss difference from TRL on the same batches: {gap:.2e}"
                  f" (first steps: rmflow {[round(x, 5) for x in rs[0]['losses'][:4]]}, TRL {trl_losses[:4]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="smollm2", help="tokenizers, comma-separated: smollm2, bpe8k")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps; 0 = one full epoch of the train split")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--center", type=float, default=0.01)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the steady state")
    ap.add_argument("--modes", default=",".join(MODES), help="rmflow packing modes to run")
    ap.add_argument("--warm", action="store_true", help="also rerun each rmflow mode on the cache its first run filled")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each trainer, alternating which goes first "
                    "(TRL, rmflow, rmflow, TRL, ...), so that a slow hour favours neither; medians and spread")
    ap.add_argument("--trl-order", choices=("same", "own"), default="same",
                    help="same: TRL reads rmflow's batches, pair for pair (the losses compare step by step); own: "
                    "TRL shuffles the train split with its own seeded sampler")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, args = a.child[0], json.loads(a.child[1])
        out = child_trl(args) if kind == "trl" else child_rmflow(args)
        out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(out))
        return
    import logging

    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    modes = [m for m in a.modes.split(",") if m]
    for vocab in [v for v in a.vocab.split(",") if v]:
        with tempfile.TemporaryDirectory() as tmp:
            made = prepare(pathlib.Path(tmp), a.max_length, vocab)
            steps = a.steps or -(-made["train_pairs"] // a.batch_size)  # 0: one epoch
            base = {**made, "work": tmp, "steps": steps, "batch": a.batch_size, "lr": a.learning_rate,
                    "warmup": max(steps // 10, 1), "center": a.center, "max_length": a.max_length}
            runs: dict[str, list[dict]] = {}
            for rep in range(a.repeat):
                cache = f"{tmp}/jax-cache-{rep}"  # empty at each repeat's first rmflow run: a cold start
                ordered = modes if rep % 2 == 0 else modes[::-1]  # the modes alternate too
                jobs = [(m, f"rmflow packing={m}") for m in ordered]
                jobs += [(m, f"rmflow packing={m}, warm cache") for m in ordered] if a.warm else []
                # the trainers alternate, neither always first: TRL, rmflow..., then rmflow..., TRL
                jobs = [("trl", "TRL RewardTrainer")] + jobs if rep % 2 == 0 else jobs + [("trl", "TRL RewardTrainer")]
                for kind, name in jobs:
                    args = {**base, "mode": kind, "trl_order": a.trl_order,
                            "work": f"{tmp}/r{rep}-{len(runs.get(name, []))}-{name[-4:]}",
                            "cache": cache}
                    out, launched = launch("trl" if kind == "trl" else "rmflow", args)
                    runs.setdefault(name, []).append(summarize(name, out, a.skip, launched))
                    r = runs[name][-1]
                    print(f"  {vocab} repeat {rep + 1}: {name}: end to end {r['e2e']:,.0f} s, steady "
                          f"{r['tokens_per_s']:,.0f} real tokens/s, {r['compiles']} compiles ({r['compile_s']:.1f} s)"
                          + (f"; timeline {r['timeline']}, step ms {r['step_ms']}" if r.get("timeline") else ""), flush=True)
            vocab_size = json.loads((pathlib.Path(made["shards"]) / "manifest.json").read_text())["tokenizer"]["vocab_size"]
            table(runs, f"{vocab} ({vocab_size:,} tokens): {steps} steps of {a.batch_size} pairs"
                        f"{' (one epoch)' if not a.steps else ''}, max_length {a.max_length}, tiny Llama (hidden "
                        f"256, 4 layers), float32, CPU ({os.cpu_count()} cores); median of {a.repeat} run(s), "
                        "spread = min..max; end to end = process launch to the last training step"
                        + ("" if a.trl_order == "same" else "; TRL in its own random order"), a.trl_order == "same")


if __name__ == "__main__":
    main()

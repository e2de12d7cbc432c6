"""Rows of one fixed shape (packing ``fixed``) against exact-count packed rows (``pack``) on the
shared real data: padding, records a step, and the row shapes a run compiles.

Each set of ``../shared/data`` is preprocessed with the SmolLM2 tokenizer (HH-RLHF's two files,
UltraFeedback's 1,000 pairs, the multi-response files' 1,008 prompts with 6-15 replies, PRM800K's
stepwise solutions), then planned as ``rmflow train`` plans it (``plan_run``: the row shape of
``fixed`` chosen from the data) and read by the training loader for as many steps as an epoch
holds at ``batch_size``. Printed per set and batch size: the fraction of row tokens that are
padding, the records a step holds (mean, min, max), the distinct batch shapes the steps make
(one a program to compile), for both modes, read from the same shuffled stream.

    .venv/bin/python benchmarks/fixed_rows.py [--batch-sizes 8,32] [--max-length 1024]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import pathlib
import statistics
import tempfile

from bench_common import SHARED_DATA

TOKENIZER = SHARED_DATA.parent / "assets" / "smollm2-135m-instruct-tokenizer"
SETS = {
    "HH-RLHF": ["hh_helpful_base_test_first2000.jsonl.gz", "hh_helpful_rejection_sampled_test.jsonl.gz"],
    "UltraFeedback": ["ultrafeedback_binarized_sample1000.jsonl.gz"],
    "multi-response": ["multi_response/arena_bench_v1_dev.jsonl.gz", "multi_response/rmbench_dev.jsonl.gz",
                       "multi_response/nectar_sample_dev.jsonl.gz"],
    "PRM800K": ["prm800k_phase1_test.stepwise.jsonl.gz"],
}


def prepare(work: pathlib.Path, max_length: int) -> dict[str, pathlib.Path]:
    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig

    out = {}
    for name, files in SETS.items():
        shards = work / name
        preprocess(PreprocessConfig(inputs=tuple(str(SHARED_DATA / f) for f in files), output=str(shards),
                                    tokenizer=str(TOKENIZER), max_length=max_length, eval_fraction=0.0,
                                    max_bad_fraction=0.5))
        out[name] = shards
    return out


def measure(shards: pathlib.Path, batch_size: int, packing: str) -> dict:
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.data import LoaderSpec, make_loader
    from rmflow.trainer.plan import plan_run

    cfg = TrainConfig.from_dict({"data": {"train": str(shards), "packing": packing}, "model": "tiny",
                                 "output": "unwritten", "batch_size": batch_size, "num_epochs": 1})
    plan = plan_run(cfg, mesh_shape={"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}, processes=1, backend="cpu")
    spec = LoaderSpec(batch_size=batch_size, max_length=plan.max_length, seed=0, num_epochs=None,
                      shard_by_process=False, packing=plan.packing, rows=plan.rows, objective=plan.objective,
                      pad_id=plan.pad_id, per_doubling=plan.train_rounding,
                      **({"row_tokens": plan.row_shape.tokens, "row_slots": plan.row_shape.slots}
                         if plan.row_shape else {}))
    batches = list(itertools.islice(iter(make_loader(plan.train_sets[0], spec)), plan.total_steps))
    count = plan.objective.count_key
    units = [_records(b) for b in batches]
    slots = sum(b["input_ids"].size for b in batches)
    return {"padding": 1 - sum(int(b["computed_tokens"]) for b in batches) / slots, "steps": len(batches),
            "records": statistics.fmean(units), "least": min(units), "most": max(units),
            "shapes": len({(b["input_ids"].shape, b["reward_index"].shape) for b in batches}),
            "row": plan.row_shape.tokens if plan.row_shape else None, "count": count}


def _records(batch) -> int:
    for key in ("pair_slot", "record_steps", "record_slots"):
        if key in batch:
            return len(batch[key])
    raise KeyError("a batch with no per-record index")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--max-length", type=int, default=1024)
    a = ap.parse_args()
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        sets = prepare(pathlib.Path(tmp), a.max_length)
        print(f"\nmax_length {a.max_length}, SmolLM2 tokenizer, one device; one epoch's steps of each set")
        print("| set | batch_size | packing | row tokens | steps | records a step (min..max) | shapes | padding |")
        print("| --- | ---: | --- | ---: | ---: | --- | ---: | ---: |")
        for name, shards in sets.items():
            for batch_size in (int(x) for x in a.batch_sizes.split(",")):
                for packing in ("fixed", "pack"):
                    m = measure(shards, batch_size, packing)
                    print(f"| {name} | {batch_size} | {packing} | {m['row'] or 'varies'} | {m['steps']} "
                          f"| {m['records']:.1f} ({m['least']}..{m['most']}) | {m['shapes']} "
                          f"| {m['padding']:.1%} |", flush=True)


if __name__ == "__main__":
    main()

"""`rmflow preprocess --decontaminate` (side input and join) and `--near-dedup prompt` against the
same preprocess without them, on real shared data, at 1x and 8x scale, in the same run.

    .venv/bin/python benchmarks/decontaminate.py [--scales 1 8] [--repeat 3] [--variants side-input join near-dedup]

Training data: HH-RLHF (helpful-base test, rejection-sampled test) and UltraFeedback from ../shared;
at 8x every file is repeated 8 times. Evaluation files: LLMBar (RewardBench v1 layout) and
ProcessBench GSM8K and MATH, 13-grams. Runs alternate (with, without) so that the machine's drift
falls on every variant; each is a whole local preprocess (Beam's local runner, start-up included).
"""

from __future__ import annotations

import argparse
import gzip
import os
import pathlib
import shutil
import statistics
import tempfile
import time

from bench_common import REPO

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
SHARED = REPO.parent / "shared" / "data"
TRAIN = ("hh_helpful_base_test_first2000.jsonl.gz", "hh_helpful_rejection_sampled_test.jsonl.gz",
         "ultrafeedback_binarized_sample1000.jsonl.gz")
EVAL = ("llmbar_rewardbench_v1.jsonl.gz", "processbench_gsm8k.jsonl.gz", "processbench_math.jsonl.gz")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["side-input", "join", "near-dedup"],
                    choices=["side-input", "join", "near-dedup"])
    a = ap.parse_args()
    from rmflow.pipelines.preprocess import run
    from rmflow.schemas.config import PreprocessConfig

    tokenizer = str(REPO / "rmflow" / "demo" / "tokenizer")
    work = pathlib.Path(tempfile.mkdtemp(prefix="rmflow-decon-bench-"))
    try:
        for scale in a.scales:
            data = work / f"x{scale}"
            data.mkdir()
            for name in TRAIN:
                rows = gzip.decompress((SHARED / name).read_bytes())
                (data / name.removesuffix(".gz")).write_bytes(rows * scale)
            evals = tuple(str(SHARED / e) for e in EVAL)
            options = {"without": {}, "side-input": {"decontaminate": evals, "decontaminate_method": "side-input"},
                       "join": {"decontaminate": evals, "decontaminate_method": "join"},
                       "near-dedup": {"near_dedup": "prompt"}}
            variants = ["without", *a.variants]
            times: dict[str, list[float]] = {v: [] for v in variants}
            counts = {}
            for r in range(a.repeat):
                for v in variants:
                    cfg = PreprocessConfig(inputs=(str(data),), output=str(work / f"out-{scale}-{v}-{r}"),
                                           tokenizer=tokenizer, max_length=2048, **options[v])
                    t = time.perf_counter()
                    stats = run(cfg).stats
                    times[v].append(time.perf_counter() - t)
                    counts[v] = stats["counts"]
                    shutil.rmtree(cfg.output)
            read = counts["without"]["records_read"]
            wo = statistics.median(times["without"])
            spread = lambda xs: f"{min(xs):.1f}-{max(xs):.1f} s"  # noqa: E731
            print(f"{scale}x: {read:,} records; without {wo:.1f} s ({spread(times['without'])}, "
                  f"{read / wo:,.0f} records/s)", flush=True)
            for v in a.variants:
                t = statistics.median(times[v])
                dropped = counts[v]["contaminated"] if v != "near-dedup" else counts[v]["duplicates"]
                print(f"  {v}: {t:.1f} s ({spread(times[v])}, {read / t:,.0f} records/s), dropped {dropped:,}; "
                      f"throughput ratio with/without {wo / t:.2f}x (median of {a.repeat})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

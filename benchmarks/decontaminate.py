"""`rmflow preprocess --decontaminate` against the same preprocess without it, on real shared data,
at 1x and 8x scale, in the same run.

    .venv/bin/python benchmarks/decontaminate.py [--scales 1 8] [--repeat 3]

Training data: HH-RLHF (helpful-base test, rejection-sampled test) and UltraFeedback from ../shared;
at 8x every file is repeated 8 times. Evaluation files: LLMBar (RewardBench v1 layout) and
ProcessBench GSM8K and MATH, 13-grams. Runs alternate (with, without) so that the machine's drift
falls on both; each is a whole local preprocess (Beam's local runner, start-up included).
"""

from __future__ import annotations

import argparse
import gzip
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared" / "data"
TRAIN = ("hh_helpful_base_test_first2000.jsonl.gz", "hh_helpful_rejection_sampled_test.jsonl.gz",
         "ultrafeedback_binarized_sample1000.jsonl.gz")
EVAL = ("llmbar_rewardbench_v1.jsonl.gz", "processbench_gsm8k.jsonl.gz", "processbench_math.jsonl.gz")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=3)
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
            times: dict[bool, list[float]] = {True: [], False: []}
            counts = {}
            for r in range(a.repeat):
                for decon in (True, False):
                    cfg = PreprocessConfig(inputs=(str(data),), output=str(work / f"out-{scale}-{decon}-{r}"),
                                           tokenizer=tokenizer, max_length=2048,
                                           decontaminate=tuple(str(SHARED / e) for e in EVAL) if decon else ())
                    t = time.perf_counter()
                    stats = run(cfg).stats
                    times[decon].append(time.perf_counter() - t)
                    counts[decon] = stats["counts"]
                    shutil.rmtree(cfg.output)
            read = counts[True]["records_read"]
            w, wo = statistics.median(times[True]), statistics.median(times[False])
            spread = lambda xs: f"{min(xs):.1f}-{max(xs):.1f} s"  # noqa: E731
            print(f"{scale}x: {read:,} records; contaminated {counts[True]['contaminated']:,}; "
                  f"with --decontaminate {w:.1f} s ({spread(times[True])}, {read / w:,.0f} records/s), "
                  f"without {wo:.1f} s ({spread(times[False])}, {read / wo:,.0f} records/s); "
                  f"throughput ratio with/without {wo / w:.2f}x (median of {a.repeat})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

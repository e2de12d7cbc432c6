"""Throughput of `rmflow preprocess` against a plain single-process loop (the ceiling).

The plain loop does the same work without Beam: read and parse the files, render every
conversation with the chat template, batch-encode chosen and rejected with the same fast
tokenizer. The pipeline additionally validates, splits, writes shards, errors and stats.
Both run over all of ../shared/data with the SmolLM2 tokenizer; the ratio is printed.

    .venv/bin/python benchmarks/preprocess.py [--repeat 2] [--workers 1 2] [--scale 8]
    .venv/bin/python benchmarks/preprocess.py --demo --repeat 5 --workers 1   # a small job

``--demo`` times the demo's 500 pairs instead: a job that small is mostly Beam's fixed cost per
job (building and submitting the graph, starting bundle processors), which the ratio shows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import pathlib
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench_common import DEMO_TOKENIZER as TOKENIZER
from bench_common import REPO
from bench_common import SHARED_DATA as DATA
from rmflow.pipelines.preprocess import run
from rmflow.pipelines.tokenizer_files import load_tokenizer_assets
from rmflow.rendering.formats import BadRecord, detect_format, normalize
from rmflow.rendering.tokenize import build_tokenizer
from rmflow.schemas.config import PreprocessConfig

DEMO = REPO / "rmflow" / "demo" / "hh_rlhf_helpful_sample.jsonl.gz"
BATCH = 128


def plain_loop(files: list[pathlib.Path]) -> tuple[float, int, int]:
    """Seconds, pairs and tokens of the plain loop (tokenizer loading excluded)."""
    tok = build_tokenizer(load_tokenizer_assets(str(TOKENIZER)))
    backend = tok.backend_tokenizer
    start = time.perf_counter()
    pairs = tokens = 0
    texts: list[str] = []

    def flush():
        nonlocal tokens
        tokens += sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))
        texts.clear()

    for f in files:
        for i, line in enumerate(gzip.open(f, "rt", encoding="utf-8"), 1):
            rec = json.loads(line)
            try:
                p = normalize(rec, detect_format(rec), source=str(f), line=i)
            except BadRecord:
                continue
            for reply in (p.chosen, p.rejected):
                texts.append(tok.apply_chat_template([{"role": r, "content": c} for r, c in p.prompt + reply],
                                                     tokenize=False))
            pairs += 1
            if len(texts) >= 2 * BATCH:
                flush()
    flush()
    return time.perf_counter() - start, pairs, tokens


def pipeline(data: pathlib.Path, workers: int) -> tuple[float, int, int]:
    with tempfile.TemporaryDirectory() as d:
        cfg = PreprocessConfig(inputs=(str(data),), output=f"{d}/out", tokenizer=str(TOKENIZER),
                               num_workers=workers, max_length=4096)
        start = time.perf_counter()
        result = run(cfg)
        seconds = time.perf_counter() - start
    c = result.stats["counts"]
    return seconds, c["pairs_written"], result.stats["tokens_written"]


def main() -> None:
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="runs of each; the median is reported")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--scale", type=int, default=1,
                    help="process the shared data this many times (copies as separate files), so that "
                         "fixed start-up costs weigh less")
    ap.add_argument("--demo", action="store_true", help="the demo's 500 pairs instead: a small job")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    data = pathlib.Path(tmp.name)
    for k in range(args.scale):
        for f in [DEMO] if args.demo else sorted(DATA.glob("hh_*.jsonl.gz")):  # HH-RLHF pairs only
            shutil.copy(f, data / f"{k:03d}-{f.name}")
    files = sorted(data.glob("*.jsonl.gz"))
    rows = [("plain loop (ceiling)", [plain_loop(files) for _ in range(args.repeat)])]
    for w in args.workers:
        rows.append((f"rmflow preprocess, {w} worker{'s' if w > 1 else ''}",
                     [pipeline(data, w) for _ in range(args.repeat)]))
    base_s = statistics.median(r[0] for r in rows[0][1])
    base_pairs = rows[0][1][0][1]
    what = "the demo's pairs" if args.demo else "the shared data"
    print(f"\n{len(files)} files ({args.scale}x {what}), {base_pairs} pairs, {os.cpu_count()} CPUs, "
          f"median of {args.repeat}\n")
    print(f"{'':38} {'seconds':>8} {'pairs/s':>9} {'tokens/s':>10} {'vs plain':>9}")
    for name, runs in rows:
        s = statistics.median(r[0] for r in runs)
        pairs, tokens = runs[0][1], runs[0][2]
        print(f"{name:38} {s:8.2f} {pairs / s:9.0f} {tokens / s:10.0f} {(pairs / s) / (base_pairs / base_s):8.2f}x")


if __name__ == "__main__":
    main()

"""`rmflow score --runner DirectRunner` (the Beam job) against the in-process core, on the same
real HH-RLHF conversations in the same run.

    .venv/bin/python benchmarks/batch_score.py [--model RUN_OR_EXPORT] [--n 2000] [--repeat 3]

Without --model it trains the tiny preset for 2 steps on the demo data first. The in-process
reference is `rmflow.scoring.scorers.score_file` (what `rmflow score` without --runner runs); both
include loading the model and compiling; the Beam job also starts Beam's local runner.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from serve import conversations, default_model, fits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from rmflow.schemas.config import ScoreConfig

    from rmflow import RewardModel
    from rmflow.scoring.batch import run as batch
    from rmflow.scoring.scorers import score_file

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rmflow-bench-batch-"))
    model = a.model or default_model(str(tmp))
    rm = RewardModel.load(model)
    rm.limit_length(a.max_length)
    convs = [c for c in conversations(a.n * 2) if fits(rm, c)][: a.n]
    tokens = sum(len(rm.encode(c)) for c in convs)
    (tmp / "in.jsonl").write_text("".join(json.dumps({"id": i, "messages": c}) + "\n" for i, c in enumerate(convs)))
    local, beam = [], []
    for _ in range(a.repeat):
        t = time.perf_counter()
        score_file(model, str(tmp / "in.jsonl"), str(tmp / "out.jsonl"))
        local.append(time.perf_counter() - t)
        shutil.rmtree(tmp / "job", ignore_errors=True)
        t = time.perf_counter()
        batch(ScoreConfig(model=model, input=str(tmp / "in.jsonl"), output=str(tmp / "job"), runner="DirectRunner",
                          num_shards=2))
        beam.append(time.perf_counter() - t)
    a_s, b_s = statistics.median(local), statistics.median(beam)
    print(f"{len(convs)} HH-RLHF conversations, {tokens:,} tokens; model: {rm.description}")
    print(f"in-process rmflow score: {len(convs) / a_s:,.1f} conv/s ({', '.join(f'{x:.1f}' for x in local)} s)")
    print(f"Beam job, local runner:  {len(convs) / b_s:,.1f} conv/s ({', '.join(f'{x:.1f}' for x in beam)} s): "
          f"{a_s / b_s:.2f}x the in-process speed")


if __name__ == "__main__":
    main()

"""The embedded demo end to end, as `make demo` runs it (`rmflow run rmflow/demo/workflow.yaml`):
each run in a fresh process with an empty compilation cache (a user's first run), alternating
rmflow as it is with a reference, the same workflow training in exact-count packed rows
(``data.packing: pack``, the default before rows of one fixed shape).

Prints each variant's wall time (median and range), the ratio of the medians, the programs XLA
compiled, those that took a second or more, and the seconds it spent, and the final train loss
and eval metrics (close, not equal: a step in fixed rows holds batch_size pairs on average).

    .venv/bin/python benchmarks/demo.py [--repeat 3] [--warm]
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

from bench_common import REPO

DEMO = REPO / "rmflow" / "demo"

CHILD = r'''
import json, os, sys, time
import yaml
import jax
from jax import monitoring

spec_path, out, variant = sys.argv[1:4]
compiles = {"n": 0, "seconds": 0.0, "long": 0}


def listen(event, seconds, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        compiles["n"] += 1
        compiles["seconds"] += seconds
        compiles["long"] += seconds >= 1.0


monitoring.register_event_duration_secs_listener(listen)
from rmflow.cli import app

start = time.perf_counter()
app(["run", spec_path], standalone_mode=False)
wall = time.perf_counter() - start
last = json.loads(open(os.path.join(out, "run", "metrics.jsonl")).read().splitlines()[-1])
metrics = json.load(open(os.path.join(out, "eval", "eval.json")))["metrics"]
print("RESULT " + json.dumps({"wall": wall, "compiles": compiles["n"], "compile_s": compiles["seconds"],
                              "long_compiles": compiles["long"],
                              "loss": last["loss"], "eval_accuracy": metrics["accuracy"],
                              "eval_loss": metrics["loss"]}))
'''


def demo_spec(folder: pathlib.Path, variant: str) -> pathlib.Path:
    import yaml

    spec = yaml.safe_load((DEMO / "workflow.yaml").read_text())
    if variant == "reference":
        spec["train"]["data"] = {"packing": "pack"}
    spec["output"] = str(folder / "demo")
    spec["preprocess"]["inputs"] = [str(DEMO / p) for p in spec["preprocess"]["inputs"]]
    spec["preprocess"]["tokenizer"] = str(DEMO / spec["preprocess"]["tokenizer"])
    path = folder / "workflow.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_once(variant: str, warm: bool = False) -> list[dict]:
    """One first run of ``variant`` (an empty compilation cache); ``warm``: then a rerun into a
    new output folder that finds the first run's cache."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        env = {**os.environ, "RMFLOW_COMPILATION_CACHE": str(folder / "jax-cache"), "JAX_PLATFORMS": "cpu"}
        for k in range(2 if warm else 1):
            run_folder = folder / f"run{k}"
            run_folder.mkdir()
            proc = subprocess.run([sys.executable, "-c", CHILD, str(demo_spec(run_folder, variant)),
                                   str(run_folder / "demo"), variant], capture_output=True, text=True, env=env, cwd=REPO)
            if proc.returncode:
                raise SystemExit(f"{variant} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
            out.append(json.loads(line[len("RESULT "):]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warm", action="store_true", help="also rerun each rmflow run on its own compilation cache")
    a = ap.parse_args()
    results: dict[str, list[dict]] = {"rmflow": [], "reference": []}
    for i in range(a.repeat):
        for variant in ("rmflow", "reference") if i % 2 == 0 else ("reference", "rmflow"):
            r, *rerun = run_once(variant, warm=a.warm and variant == "rmflow")
            results[variant].append(r)
            if rerun:
                results.setdefault("rerun", []).append(rerun[0])
                print(f"run {i + 1} rerun    : {rerun[0]['wall']:6.1f} s, {rerun[0]['compiles']} compilations "
                      f"({rerun[0]['long_compiles']} of 1 s or more; {rerun[0]['compile_s']:.1f} s in all)", flush=True)
            print(f"run {i + 1} {variant:9s}: {r['wall']:6.1f} s, {r['compiles']} compilations "
                  f"({r['long_compiles']} of 1 s or more; {r['compile_s']:.1f} s in all), loss {r['loss']:.4f}, eval accuracy {r['eval_accuracy']:.4f}, "
                  f"eval loss {r['eval_loss']:.4f}", flush=True)
    med = {}
    for variant, rs in results.items():
        walls = [r["wall"] for r in rs]
        med[variant] = statistics.median(walls)
        print(f"{variant:9s}: median {med[variant]:.1f} s (range {min(walls):.1f}-{max(walls):.1f}), "
              f"median compilations {statistics.median(r['compiles'] for r in rs):.0f} "
              f"({statistics.median(r['long_compiles'] for r in rs):.0f} of 1 s or more, "
              f"{statistics.median(r['compile_s'] for r in rs):.1f} s in all)")
    print(f"rmflow takes {med['rmflow'] / med['reference']:.2f}x the reference's time "
          f"({med['reference'] / med['rmflow']:.2f}x faster)")


if __name__ == "__main__":
    main()

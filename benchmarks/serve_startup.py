"""`rmflow serve` start-up: seconds from launch until GET /health answers 200 (the model loaded
and its start-up shapes compiled: an outcome model's packed shapes, a process model's up to
--startup-length), with the default options and with each
set of other options given (by default --startup-length 4096: every shape to the model's
positions), alternating, without the persistent compilation cache (RMFLOW_COMPILATION_CACHE=off)
unless --cache is given.

    rmflow preprocess -i rmflow/demo/hh_rlhf_helpful_sample.jsonl.gz --tokenizer rmflow/demo/tokenizer \\
        -o /tmp/su/shards --max-length 512 --max-bad-fraction 1
    rmflow train --data /tmp/su/shards --model tiny -o /tmp/su/run --set max_steps=1 --set batch_size=2
    .venv/bin/python benchmarks/serve_startup.py /tmp/su/run --with="--startup-length 4096" \\
        --with=--no-response-units --repeat 2
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import requests


def start_up(model: str, extra: list[str], cache: bool) -> tuple[float, int, int]:
    """(seconds to ready, the startup length, the programs compiled so far: at start-up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           **({} if cache else {"RMFLOW_COMPILATION_CACHE": "off"})}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "rmflow.cli", "serve", model, "--port", str(port), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None:
                raise SystemExit(proc.stdout.read())
            time.sleep(0.2)
        seconds = time.monotonic() - start
        info = requests.get(url + "/v1/model", timeout=5).json()
        return seconds, info["startup_length"], info["compiled_shapes"]
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a run directory or an export")
    ap.add_argument("--with", dest="others", action="append", default=[],
                    help="serve options to start with beside the default ones (repeatable; default: "
                         "--startup-length 4096)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cache", action="store_true", help="keep the persistent compilation cache")
    a = ap.parse_args()
    others = [o.split() for o in a.others or ["--startup-length 4096"]]
    for _ in range(a.repeat):
        for extra in ([], *others):
            seconds, length, shapes = start_up(a.model, extra, a.cache)
            print(f"{' '.join(extra) or 'default':>20}: ready in {seconds:6.1f} s (startup length {length} tokens; "
                  f"programs compiled at start-up: {shapes})", flush=True)


if __name__ == "__main__":
    main()

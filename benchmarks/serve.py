"""The reward server against the offline batched core, on real HH-RLHF conversations.

Starts `rmflow serve` as a process on a free localhost port and sends the conversations from
C concurrent clients (one conversation a request: the hardest case, and how verl's reward loop
calls a server), C = 1, 8, 64; measures sequences/s, real tokens/s and p50 / p99 latency. The
references, in the same run: the same conversations scored offline by the same core over the
same batch shapes, already compiled, from the conversations (rendered with the chat template,
tokenized, batched, run: what the server does for each request) and from their token ids (the
forward passes alone); and one forward pass of a single sequence of the median length. Prints
the server's throughput and latency as ratios of those references. The clients run on the same
machine as the server and take CPU from it (on a machine of few cores, a large share).

    .venv/bin/python benchmarks/serve.py [--model RUN_OR_EXPORT] [--n 512] [--max-length 512] [--repeat 3]
    .venv/bin/python benchmarks/serve.py --overload 200 --concurrency ''   # overload only

``--overload C``: C clients each send requests of ``--overload-items`` conversations for
``--overload-seconds``, waiting at most 30 s for an answer (an RL client's timeout) and, on a
503, ``Retry-After`` seconds before the next; once with the queue bounded by its estimated wait
(``--max-queue-wait-s 10``, the default) and once without (``0``: only the item bound), each on
a fresh server. Prints answers, 503s, timeouts and the latency of the answered requests.

Without --model it trains the tiny preset for 2 steps on the demo data first (a model's
weights do not change its speed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import requests
from bench_common import REPO

DATA = REPO.parent / "shared" / "data" / "hh_helpful_base_test_first2000.jsonl.gz"


def conversations(n: int) -> list[list[dict]]:
    from rmflow.rendering.formats import parse_hh_transcript

    out = []
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        for line in f:
            msgs = parse_hh_transcript(json.loads(line)["chosen"], "chosen")
            if msgs[-1][0] == "assistant":
                out.append([{"role": r, "content": c} for r, c, *_ in msgs])
            if len(out) >= n:
                break
    return out


def default_model(tmp: str) -> str:
    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.train import run as train

    demo = REPO / "rmflow" / "demo"
    preprocess(PreprocessConfig(inputs=(str(demo / "hh_rlhf_helpful_sample.jsonl.gz"),), output=f"{tmp}/shards",
                                tokenizer=str(demo / "tokenizer"), max_length=256, max_bad_fraction=1.0))
    train(TrainConfig(data=f"{tmp}/shards", model="tiny", output=f"{tmp}/run", max_steps=2, batch_size=4))
    return f"{tmp}/run"


def fits(rm, conversation) -> bool:
    from rmflow.scoring.api import BadConversation

    try:
        rm.encode(conversation)  # longer than rm.max_length: BadConversation
        return True
    except BadConversation:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clients(url: str, convs: list, concurrency: int) -> tuple[float, list[float]]:
    """(wall seconds, per-request latencies): each client sends its share, one conversation a request."""
    shares = [convs[i::concurrency] for i in range(concurrency)]

    def client(share):
        session, lat = requests.Session(), []
        for c in share:
            t = time.perf_counter()
            r = session.post(url + "/v1/score", json={"conversations": [c]}, timeout=300)
            lat.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
        return lat

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        lat = [x for part in pool.map(client, shares) for x in part]
    return time.perf_counter() - start, lat


def overload(url: str, convs: list, n_clients: int, seconds: float, items: int,
             timeout: float = 30.0) -> dict[str, float]:
    """C clients sending ``items`` conversations a request for ``seconds``: what they got."""
    stop = time.monotonic() + seconds
    counts = {"answered": 0, "503": 0, "timeouts": 0, "other": 0}
    latencies: list[float] = []
    lock = threading.Lock()

    def count(what: str, latency: float | None = None) -> None:
        with lock:
            counts[what] += 1
            if latency is not None:
                latencies.append(latency)

    def client(k: int) -> None:
        session, i = requests.Session(), k
        while time.monotonic() < stop:
            body = {"conversations": [convs[(i + j) % len(convs)] for j in range(items)]}
            i += items
            t = time.perf_counter()
            try:
                r = session.post(url + "/v1/score", json=body, timeout=timeout)
            except requests.exceptions.Timeout:
                count("timeouts")
                session.close()  # the abandoned connection is closed: the server cancels its items
                session = requests.Session()
                continue
            if r.status_code == 200:
                count("answered", time.perf_counter() - t)
            elif r.status_code == 503:
                count("503")
                time.sleep(float(r.headers.get("Retry-After", 1)))
            else:
                count("other")

    with concurrent.futures.ThreadPoolExecutor(n_clients) as pool:
        list(pool.map(client, range(n_clients)))
    lat = sorted(latencies) or [float("nan")]
    return {**counts, "p50": lat[len(lat) // 2], "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "max": lat[-1]}


def start_server(model: str, a, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rmflow.cli", "serve", model, "--port", str(port),
                             "--max-length", str(a.max_length), "--token-budget", str(a.token_budget),
                             "--max-batch-rows", str(a.max_batch_rows), *extra], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 600
    while time.monotonic() < end:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        if proc.poll() is not None:
            raise SystemExit(proc.stdout.read())
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server was not ready within 600 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a run directory or an export; default: the tiny preset, trained 2 steps")
    ap.add_argument("--n", type=int, default=512, help="conversations")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--max-batch-rows", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--overload", type=int, default=0, help="clients of the overload run (0: none)")
    ap.add_argument("--overload-seconds", type=float, default=60)
    ap.add_argument("--overload-items", type=int, default=16)
    a = ap.parse_args()
    from rmflow import RewardModel

    tmp = tempfile.mkdtemp(prefix="rmflow-bench-serve-")
    model = a.model or default_model(tmp)
    rm = RewardModel.load(model)
    rm.limit_length(a.max_length)
    convs = [c for c in conversations(a.n * 2) if fits(rm, c)][: a.n]
    encoded = [rm.encode(c) for c in convs]
    tokens = sum(map(len, encoded))
    shapes = rm.shapes(a.max_batch_rows, a.token_budget, small_batches=True)  # the server's
    scorer = rm.scorer(shapes)
    scorer.warm_up()
    offline, forwards = [], []
    for _ in range(a.repeat):
        t = time.perf_counter()
        reference = scorer.score([rm.encode(c) for c in convs])
        offline.append(time.perf_counter() - t)
        t = time.perf_counter()
        scorer.score(encoded)
        forwards.append(time.perf_counter() - t)
    median_seq = sorted(encoded, key=len)[len(encoded) // 2]
    single = rm.scorer(rm.shapes(1, packed=False))  # one sequence, one row: "one forward of that length"
    single.run([median_seq])
    one = []
    for _ in range(max(a.repeat, 5)):
        t = time.perf_counter()
        single.run([median_seq])
        one.append(time.perf_counter() - t)
    off_s, fwd_s = statistics.median(offline), statistics.median(forwards)
    print(f"{len(convs)} HH-RLHF conversations, {tokens:,} real tokens (median {len(median_seq)}), "
          f"max_length {a.max_length}, token budget {a.token_budget}; model: {rm.description}")
    print(f"offline core, from conversations: {len(convs) / off_s:,.1f} seq/s, {tokens / off_s:,.0f} tok/s "
          f"(median of {a.repeat}: {', '.join(f'{x:.2f}' for x in offline)} s); from token ids (forwards "
          f"alone): {len(convs) / fwd_s:,.1f} seq/s ({', '.join(f'{x:.2f}' for x in forwards)} s); one forward "
          f"of {len(median_seq)} tokens: {statistics.median(one) * 1000:.1f} ms")

    proc, url = start_server(model, a)
    try:
        got = requests.post(url + "/v1/score", json={"conversations": convs}, timeout=600).json()["scores"]
        print(f"server scores vs offline: max |diff| {np.max(np.abs(np.asarray(got) - reference)):.2e}")
        for c in map(int, filter(None, a.concurrency.split(","))):
            runs = [clients(url, convs, c) for _ in range(a.repeat)]
            walls = [w for w, _ in runs]
            wall = statistics.median(walls)
            lat = sorted(x for _, ls in runs for x in ls)
            p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            line = (f"concurrency {c:>3}: {len(convs) / wall:8,.1f} seq/s {tokens / wall:9,.0f} tok/s "
                    f"({off_s / wall:.2f}x offline, {fwd_s / wall:.2f}x its forwards alone; walls {', '.join(f'{w:.2f}' for w in walls)}"
                    f" s)  p50 {p50 * 1000:7.1f} ms  p99 {p99 * 1000:7.1f} ms")
            if c == 1:
                line += f"  (p50 / one forward: {p50 / statistics.median(one):.2f}x)"
            print(line, flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    for bound in ("10", "0") if a.overload else ():
        proc, url = start_server(model, a, "--max-queue-wait-s", bound)
        try:
            r = overload(url, convs, a.overload, a.overload_seconds, a.overload_items)
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"overload, {a.overload} clients x {a.overload_items} conversations a request, "
              f"{a.overload_seconds:g} s, --max-queue-wait-s {bound}: {r['answered']} answered, {r['503']} 503s, "
              f"{r['timeouts']} timeouts (30 s), {r['other']} other; answered p50 {r['p50']:.1f} s, "
              f"p99 {r['p99']:.1f} s, max {r['max']:.1f} s", flush=True)


if __name__ == "__main__":
    main()

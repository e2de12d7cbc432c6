"""`rmflow serve`: the real server, started as a process on an ephemeral localhost port and
spoken to over HTTP. Its scores equal the Python API's (outcome and process models, all three
protocols); 32 concurrent clients each get exactly their own results; bad input gets a 4xx
naming the item while the server stays up; a full queue answers 503 with Retry-After; SIGTERM
finishes what is in flight, then exits 0. The batching core (shapes, batcher) is tested
without HTTP too."""

import concurrent.futures
import gzip
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
from rmflow.rendering.formats import parse_hh_transcript
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.inference import score_sequences
from rmflow.trainer.train import run as train

REPO = pathlib.Path(__file__).resolve().parents[2]
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LENGTH = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`rmflow serve` in a subprocess; ``url`` once /health said ready (the statuses seen
    before that are kept: 503 while the model loads)."""

    def __init__(self, model, *args: str, env: dict | None = None, deadline: float = 240,
                 max_length: int | None = MAX_LENGTH):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(pathlib.Path(str(model)).parent / f"serve-{self.port}.log", "w+")
        length = ["--max-length", str(max_length)] if max_length else []
        self.proc = subprocess.Popen([sys.executable, "-m", "rmflow.cli", "serve", str(model), "--port",
                                      str(self.port), *length, *args], cwd=REPO,
                                     env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.statuses = []
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}): {self.output()}")
            try:
                r = requests.get(self.url + "/health", headers=AUTH, timeout=5)
                self.statuses.append(r.status_code)
                if r.status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"not ready within {deadline} s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def post(self, path: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(self.url + path, data=data, headers={**AUTH, "Content-Type": "application/json"},
                             timeout=kw.pop("timeout", 120), **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _conversations(shared_data, n: int) -> list[list[dict]]:
    out = []
    with gzip.open(shared_data / "hh_helpful_base_test_first2000.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            for side in ("chosen", "rejected"):
                msgs = parse_hh_transcript(json.loads(line)[side], side)
                if msgs[-1][0] == "assistant":
                    out.append([{"role": r, "content": c} for r, c, *_ in msgs])
            if len(out) >= n:
                return out[:n]
    return out


@pytest.fixture(scope="module")
def outcome(demo_shards, tmp_path_factory):
    base = tmp_path_factory.mktemp("serve")
    train(TrainConfig(data=str(demo_shards), model="micro", output=str(base / "run"), max_steps=1, batch_size=4))
    # At most 16 rows a forward: 25 batch shapes to compile at start-up instead of the default's 32.
    server = Server(base / "run", "--max-queue", "256", "--max-request-items", "128", "--token-budget", "4096",
                    "--max-batch-rows", "16", env={"RMFLOW_API_KEY": KEY})
    from rmflow import RewardModel

    rm = RewardModel.load(str(base / "run"))
    rm.limit_length(MAX_LENGTH)
    yield server, rm
    server.stop()


def _fits(rm, conversation) -> bool:
    from rmflow.scoring.api import BadConversation

    try:
        return len(rm.encode(conversation)) <= MAX_LENGTH  # rm.max_length is MAX_LENGTH: longer ones raise
    except BadConversation:
        return False


@pytest.fixture(scope="module")
def conversations(shared_data, outcome):
    _, rm = outcome
    return [c for c in _conversations(shared_data, 400) if _fits(rm, c)][:200]


@pytest.mark.slow
def test_health_says_loading_until_warm_then_the_model(outcome):
    server, _ = outcome
    assert server.statuses[-1] == 200 and 503 in server.statuses, server.statuses
    info = requests.get(server.url + "/v1/model", headers=AUTH, timeout=10).json()
    assert info["kind"] == "outcome" and info["step"] == 1 and len(info["tokenizer_hash"]) == 64
    assert info["max_length"] == MAX_LENGTH
    # packed rows of the training length (the demo shards' 128 tokens), as many a forward as hold
    # --token-budget, a quarter of them, or one (a lone request); conversations and units share them
    assert info["batch_shapes"] == [[1, 128], [8, 128], [32, 128]]
    assert info["compiled_shapes"] <= 4  # the 3 at start-up, and a longer item's row once one came
    assert info["response_units"] and "3 packed shapes (1 x 128, 8 x 128, 32 x 128 tokens: one row and a full " \
        "forward compiled before ready" in server.output()


def test_native_scores_equal_the_api(outcome, conversations):
    server, rm = outcome
    got = []
    for part in (conversations[:100], conversations[100:]):  # at most 128 a request on this server
        r = server.post("/v1/score", {"conversations": part})
        assert r.status_code == 200, r.text
        got += r.json()["scores"]
        assert r.json()["model"]["step"] == 1 and r.json()["model"]["kind"] == "outcome"
    assert len(conversations) == 200
    np.testing.assert_allclose(got, rm.score(conversations), atol=1e-5, rtol=0)


def test_native_scores_one_prompt_s_k_responses_in_one_item(outcome):
    server, rm = outcome
    records = [{"prompt": "Pick one.", "responses": ["A.", "B, as it is longer.", "C"], "ranks": [2, 1, 3]},
               {"prompt": "Name a colour.", "chosen": ["Blue."], "rejected": ["Seven.", "A colour."]}]
    r = server.post("/v1/score", {"responses": records})
    assert r.status_code == 200, r.text
    body = r.json()
    for record, scores, best in zip(records, body["response_scores"], body["best_responses"]):
        texts = record.get("responses") or record["chosen"] + record["rejected"]
        alone = rm.score([[{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": t}]
                          for t in texts])
        np.testing.assert_allclose(scores, alone, atol=1e-5, rtol=0)
        assert best == int(np.argmax(alone))
    r = server.post("/v1/score", {"responses": [records[0], {"prompt": "p", "chosen": "a", "rejected": "b"}]})
    assert r.status_code == 422 and r.json()["items"][0]["index"] == 1, r.text  # a pair is not K responses


def _metric(server, name: str) -> float:
    text = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    return float(next(x.split()[-1] for x in text.splitlines() if x.startswith(name)))


def test_a_k_response_record_runs_its_prompt_once_in_units_of_compiled_shapes(outcome):
    """Eleven responses to a long prompt, more than a unit's slots and than one row holds: the
    record is cut into units of the prompt once and several responses (a unit left with one
    response runs alone), every score equals the response's scored alone, and the server ran
    the prompt once a unit, not once a response, in shapes it compiled at start-up."""
    from rmflow.trainer.inference import UNIT_RESPONSES, response_units

    server, rm = outcome
    prompt = "Summarise the following notes for a busy reader. " + " ".join(f"note {i}: item {i * 7}." for i in range(12))
    texts = [("Short." if i % 3 else "A longer answer that goes on for a while, " * (1 + i % 4)) + f" ({i})"
             for i in range(11)]
    conversations = [[{"role": "user", "content": prompt}, {"role": "assistant", "content": t}] for t in texts]
    seqs = [rm.encode(c) for c in conversations]
    units = response_units(seqs, rm.max_length)
    assert len(units) > 1 and all(getattr(u, "k", 1) <= UNIT_RESPONSES for u in units)
    assert [getattr(u, "k", 1) for u in units] != [len(seqs)]
    tokens, scored = _metric(server, "rmflow_tokens_scored_total"), _metric(server, "rmflow_sequences_scored_total")
    r = server.post("/v1/score", {"responses": [{"prompt": prompt, "responses": texts}]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["response_scores"][0], rm.score(conversations), atol=1e-5, rtol=0)
    ran = _metric(server, "rmflow_tokens_scored_total") - tokens
    assert ran == sum(u.unit_len if hasattr(u, "unit_len") else len(u) for u in units) < sum(len(s) for s in seqs) - len(seqs[0]), ran
    assert _metric(server, "rmflow_sequences_scored_total") - scored == len(texts)


def test_get_reward_as_openrlhf_sends_it_and_classify_as_verl(outcome, conversations):
    server, rm = outcome
    renderer = rm._record_tokenizer()
    texts = [renderer.render_text(tuple((m["role"], m["content"]) for m in c)) for c in conversations[:24]]
    expected = rm.score(conversations[:24])
    # OpenRLHF's client (openrlhf/utils/remote_rm_utils.py): requests.post(url, json=..., headers=...)
    # with query, prompts and labels, and reads response["rewards"].
    r = requests.post(server.url + "/get_reward", json={"query": texts, "prompts": [t[:20] for t in texts],
                                                        "labels": [""] * len(texts)},
                      headers={"Content-Type": "application/json", **AUTH}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["rewards"], expected, atol=1e-5, rtol=0)
    assert "warnings" not in r.json()
    # verl's reward loop: {"model", "input": one rendered text, "activation": False}, reads data[-1].probs[-1].
    for text, want in zip(texts[:3], expected[:3]):
        r = server.post("/classify", {"model": "rm", "input": text, "activation": False, "add_special_tokens": False})
        assert abs(r.json()["data"][-1]["probs"][-1] - want) < 1e-5
    r = server.post("/classify", {"input": texts[:3], "add_special_tokens": False}).json()
    np.testing.assert_allclose([d["probs"][0] for d in r["data"]], 1 / (1 + np.exp(-expected[:3])), atol=1e-5)
    assert r["usage"]["prompt_tokens"] == sum(len(rm.encode(c)) for c in conversations[:3])
    # A query rendered with another template is scored as sent, and said to be mismatched.
    r = server.post("/get_reward", {"query": ["User: hi\nAssistant: hello"]}).json()
    assert len(r["rewards"]) == 1 and "another template" in r["warnings"][0]


def test_32_concurrent_clients_each_get_their_own_results(outcome, conversations):
    server, rm = outcome
    expected = rm.score(conversations)
    rng = np.random.default_rng(0)
    requests_ = [rng.choice(len(conversations), int(rng.integers(1, 9)), replace=False) for _ in range(96)]

    def client(idx):
        r = server.post("/v1/score", {"conversations": [conversations[i] for i in idx]})
        assert r.status_code == 200, r.text
        return idx, r.json()["scores"]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        for idx, got in pool.map(client, requests_):
            np.testing.assert_allclose(got, expected[idx], atol=1e-5, rtol=0)
    metrics = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    batches = float(next(x.split()[-1] for x in metrics.splitlines() if x.startswith("rmflow_batch_sequences_count")))
    seqs = float(next(x.split()[-1] for x in metrics.splitlines() if x.startswith("rmflow_sequences_scored_total")))
    assert seqs / batches > 1.5, (seqs, batches)  # requests shared forward passes


def test_bad_input_gets_a_4xx_naming_the_item_and_the_server_stays_up(outcome, conversations):
    server, rm = outcome
    good = conversations[0]
    long = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "Fine."}]
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b'{"conversations": ["\xff\xfe"]}', 400, "not valid UTF-8"),
        ([good], 400, "must be a JSON object"),
        ({"conversations": "hi"}, 400, "must be a list"),
        ({"conversations": []}, 400, "is empty"),
        ({}, 400, "missing 'conversations'"),
        ({"conversations": [good, good[:-1]]}, 422, "conversation 1"),
        ({"conversations": [good, [{"role": "user", "content": 5}]]}, 422, "conversation 1"),
        ({"conversations": [good, long]}, 422, "more than"),
        ({"conversations": [good], "truncate": "middle"}, 400, "'truncate'"),
        ({"conversations": [good], "normalized": True}, 400, "reward_normalization"),
        ({"solutions": [{"prompt": "p", "completions": ["a"]}]}, 400, "send 'conversations'"),
        ({"conversations": [good] * 129}, 413, "at most 128"),
        ({"conversations": [good], "responses": [{"prompt": "q", "responses": ["a", "b"]}]}, 400, "not several"),
        ({"responses": [{"prompt": "q", "responses": ["a", "b"]}], "solutions": []}, 400, "not several"),
        ({"responses": [{"prompt": "q", "responses": []}]}, 422, "no responses to score"),
    ]
    for body, status, words in cases:
        r = server.post("/v1/score", body)
        assert r.status_code == status and words in r.json()["error"], (body if len(str(body)) < 300 else "", r.text)
    # every item the checks before tokenizing refuse is named; tokenizing runs only when none is
    r = server.post("/v1/score", {"conversations": [good, long, long[:1], long[:1]]})
    assert [i["index"] for i in r.json()["items"]] == [2, 3]
    r = server.post("/v1/score", {"conversations": [good, long, good, long]})  # tokenizing stops at the first refused
    assert [i["index"] for i in r.json()["items"]] == [1]
    r = server.post("/get_reward", {"query": ["ok", 3]})
    assert r.status_code == 422 and "query 1" in r.json()["error"]
    for path, body, words in (("/v1/embeddings", {"input": "x", "encoding_format": "base64"}, "floats only"),
                              ("/pooling", {"input": "x", "encoding_format": "base64"}, "floats only"),
                              ("/v1/embeddings", {"input": "x", "dimensions": 5}, "1 dimension")):
        r = server.post(path, body)  # what the server cannot produce is refused, not ignored
        assert r.status_code == 400 and words in r.json()["error"], r.text
    assert server.post("/v1/embeddings", {"input": "x", "dimensions": True}).status_code == 400  # not the number 1
    assert server.post("/v1/embeddings", {"input": "x", "encoding_format": "float", "dimensions": 1}).status_code == 200
    # a rendered text is scored only where it ends with an assistant reply, on every rendered-text
    # endpoint (the rule preprocessing and /v1/score apply); one without the template's assistant
    # marker (another template, or no reply) is scored with a warning
    turns = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
    for path, key in (("/get_reward", "query"), ("/classify", "input"), ("/pooling", "input"),
                      ("/v1/embeddings", "input")):
        r = server.post(path, {key: [turns + "<|im_start|>user\nare you sure?<|im_end|>\n"]})
        assert r.status_code == 422 and "ends with a user turn" in r.json()["error"], (path, r.text)
        assert server.post(path, {key: [turns]}).json().get("warnings") is None, path
        r = server.post(path, {key: ["<|im_start|>user\nq<|im_end|>\n", "plain text"]})
        assert r.status_code == 200 and "2 of 2" in r.json()["warnings"][0], (path, r.text)
    r = requests.post(server.url + "/v1/score", json={"conversations": [good]}, timeout=30)
    assert r.status_code == 401  # no API key
    r = server.post("/v1/score", b"[" * 100 + b"]" * 100)
    assert r.status_code == 400
    # Left truncation, when asked: the earliest tokens dropped, the reply kept.
    r = server.post("/v1/score", {"conversations": [long], "truncate": "left"})
    assert r.status_code == 200
    assert abs(r.json()["scores"][0] - rm.score_ids([rm.encode(long, truncate="left")])[0]) < 1e-5
    r = server.post("/v1/score", {"conversations": [good], "truncate": None})  # null: unset, as every option
    assert r.status_code == 200 and requests.get(server.url + "/health", headers=AUTH, timeout=5).status_code == 200


def test_a_request_s_responses_are_counted_before_any_is_rendered(outcome, monkeypatch):
    """200,000 responses in a 2 MB body: 413 at once, nothing tokenized (it took 50 s)."""
    from rmflow.scoring import scorers
    from rmflow.server.protocol import RequestError, read_native

    _, rm = outcome  # reading a record's responses is the first step of encoding them: never before the count
    monkeypatch.setattr(scorers, "responses_of", lambda *a, **k: pytest.fail("read before counting"))
    body = {"responses": [{"prompt": "q", "responses": [f"r{i}" for i in range(200_000)]}]}
    for layout in (body, {"responses": [{"prompt": "q", "chosen": ["a"] * 100_000, "rejected": ["b"] * 100_000}]},
                   {"responses": [{"prompt": "q", "answers": [{"answer": "a", "rank": 1}] * 5000}] * 40}):
        with pytest.raises(RequestError) as e:
            read_native(layout, rm, 2048)
        assert e.value.status == 413 and "at most 2048" in e.value.message
    monkeypatch.undo()
    # every item checked before any is tokenized: one that cannot be scored refuses the request at once
    from rmflow.rendering.tokenize import RecordTokenizer

    from rmflow.server.protocol import read_get_reward

    monkeypatch.setattr(RecordTokenizer, "encode_conversation", lambda *a: pytest.fail("tokenized a conversation"))
    monkeypatch.setattr(RecordTokenizer, "encode_text", lambda *a, **k: pytest.fail("tokenized a text"))
    long = [{"role": "user", "content": "word " * 3000}, {"role": "assistant", "content": "ok"}]
    bad = [{"role": "user", "content": "a question with no reply"}]
    for body, reader in (({"conversations": [long] * 200 + [bad]}, read_native),
                         ({"responses": [{"prompt": "q", "responses": ["a"] * 5}] * 50 + [
                             {"prompt": "q", "responses": [[{"role": "assistant", "content": "a"},
                                                            {"role": "user", "content": "?"}]]}]}, read_native),
                         ({"query": ["text " * 3000] * 200 + [""]}, read_get_reward)):
        with pytest.raises(RequestError) as e:
            reader(body, rm, 2048)
        assert e.value.status == 422 and len(e.value.items) == 1, e.value.message


def test_padding_and_bad_text_never_change_a_reward_or_reach_a_500(outcome, conversations):
    """However an RL batch padded a response (pad = eos, SmolLM2's), it gets one reward; a lone
    surrogate is a 400 on every endpoint, an empty reply a 422, a huge text refused before
    tokenizing, ``"activation": null`` read as unset; no traceback, no internal error."""
    server, rm = outcome
    renderer = rm._record_tokenizer()
    rendered = renderer.render_text(tuple((m["role"], m["content"]) for m in conversations[0]))
    eos, end = rm.tokenizer.eos_token, rm.turn_end
    t = rendered[: -len(end)]  # the reply's text, without the template's turn end
    variants = [t, t + eos, t + eos * 5, eos * 5 + t, rendered, rendered + eos * 3, eos + rendered + eos]
    r = server.post("/get_reward", {"query": variants})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["rewards"], rm.score(conversations[:1])[0], atol=1e-5, rtol=0)
    r = server.post("/classify", {"input": variants[:4], "activation": None, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["probs"][0] for d in r.json()["data"]],
                               1 / (1 + np.exp(-rm.score(conversations[:1])[0])), atol=1e-5)
    surrogate = '"hi \\ud800 there"'
    for path, body in (("/get_reward", '{"query": [%s]}'), ("/classify", '{"input": %s}'),
                       ("/v1/score", '{"conversations": [[{"role": "user", "content": "q"}, '
                                     '{"role": "assistant", "content": %s}]]}')):
        r = server.post(path, body % surrogate)
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"], (path, r.text)
    empty = renderer.render_text((("user", "Hi"), ("assistant", "")))
    assert server.post("/get_reward", {"query": [empty + eos * 3]}).status_code == 422
    r = server.post("/v1/score", {"conversations": [[{"role": "user", "content": "Hi"},
                                                     {"role": "assistant", "content": "  "}]]})
    assert r.status_code == 422 and "empty" in r.json()["error"]
    # every text is bounded by characters before it is tokenized (tokenizing 20 MB takes about a
    # minute), whether the endpoint refuses a text too long or keeps its end
    huge = renderer.render_text((("user", "x " * 10_000_000), ("assistant", "The end.")))
    tail = renderer.render_text((("user", "x " * 2_000), ("assistant", "The end.")))
    for path, body, status in (
            ("/classify", {"input": ["x" * 20_000_000]}, 422),
            ("/get_reward", {"query": [huge]}, 200),  # as OpenRLHF's server: cut, never refused
            ("/classify", {"input": [huge], "truncate_prompt_tokens": -1, "activation": False}, 200),  # as vLLM
            ("/v1/score", {"conversations": [[{"role": "user", "content": "x " * 15_000_000},
                                              {"role": "assistant", "content": "The end."}]], "truncate": "left"}, 200),
            ("/v1/score", {"conversations": [[{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "x " * 5_000_000}]], "truncate": "left"},
             422)):
        start = time.monotonic()
        r = server.post(path, body)
        assert r.status_code == status and time.monotonic() - start < 20, (path, r.text[:300])
        if status == 422:
            assert "refused before tokenizing" in r.json()["error"], r.text
    cut = rm.encode_text(tail)[-rm.max_length:]  # the last tokens, as a long text's left truncation keeps them
    want = float(rm.score_ids([cut])[0])
    assert abs(server.post("/get_reward", {"query": [huge]}).json()["rewards"][0] - want) < 1e-4
    assert abs(server.post("/classify", {"input": [huge], "truncate_prompt_tokens": -1, "activation": False}
                           ).json()["data"][0]["probs"][0] - want) < 1e-4
    assert server.post("/classify", {"input": [huge], "truncate_prompt_tokens": 0}).status_code == 400
    metrics = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    assert 'reason="internal"' not in metrics and "Traceback" not in server.output()


def test_an_abandoned_request_is_cancelled_and_small_requests_pass_big_ones(outcome, conversations):
    """A client that gives up (its timeout) takes its waiting items with it; a client that
    disconnects mid-upload is counted, not a traceback; a second server on the port says so in one line."""
    server, rm = outcome
    big = {"conversations": (conversations * 2)[:128]}

    def metric(prefix: str) -> float:
        text = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(prefix))

    def scored() -> float:
        return metric("rmflow_sequences_scored_total")

    def gone() -> float:
        return metric('rmflow_request_errors_total{endpoint="score",reason="client_disconnected"}')

    before, gone_before = scored(), gone()

    def impatient(_) -> bool:
        try:
            server.post("/v1/score", big, timeout=0.1)
        except requests.exceptions.Timeout:
            return True
        return False

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # queued together (the queue holds 256): 2 x 128
        gave_up = sum(pool.map(impatient, range(2)))
    assert gave_up >= 1
    start = time.monotonic()
    r = server.post("/v1/score", {"conversations": conversations[:2]})
    assert r.status_code == 200 and time.monotonic() - start < 10, time.monotonic() - start
    # each client that gave up was seen to go and its waiting items cancelled (what the cancelling
    # does to the queue is tested on the batcher itself, without HTTP's timing)
    end = time.monotonic() + 30
    while time.monotonic() < end and gone() - gone_before < gave_up:
        time.sleep(0.1)
    assert gone() - gone_before == gave_up, (gave_up, requests.get(server.url + "/metrics", headers=AUTH).text)
    assert scored() - before < 2 + 2 * 128, (before, scored())  # some of them never ran
    with socket.create_connection(("127.0.0.1", server.port)) as s:  # gone mid-upload
        s.sendall(f"POST /v1/score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"conv".encode())
    time.sleep(0.5)
    metrics = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    assert 'reason="client_disconnected"' in metrics and 'reason="internal"' not in metrics
    assert "Traceback" not in server.output()
    second = subprocess.run([sys.executable, "-m", "rmflow.cli", "serve", str(rm._loaded.folder), "--port",
                             str(server.port)], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert second.returncode == 1 and "in use" in second.stderr and len(second.stderr.strip().splitlines()) == 1, \
        second.stderr


def test_a_full_queue_answers_503_with_retry_after(outcome, conversations):
    server, _ = outcome
    body = {"conversations": (conversations * 2)[:128]}

    def client(_):
        r = server.post("/v1/score", body)
        return r.status_code, r.headers.get("Retry-After")

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(client, range(24)))
    assert {s for s, _ in results} <= {200, 503}, results
    assert any(s == 503 and ra == "1" for s, ra in results), results
    assert any(s == 200 for s, _ in results)
    metrics = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    assert 'rmflow_request_errors_total{endpoint="score",reason="queue_full"}' in metrics
    assert server.post("/v1/score", {"conversations": conversations[:2]}).status_code == 200


def test_sigterm_finishes_what_is_in_flight_then_exits(outcome, conversations):
    _, rm = outcome
    server = Server(rm._loaded.folder, "--token-budget", "512", "--max-batch-rows", "2")
    try:
        result = {}

        def client():
            r = server.post("/v1/score", {"conversations": conversations[:128]})
            result["status"], result["scores"] = r.status_code, r.json().get("scores")

        t = threading.Thread(target=client)
        t.start()
        end = time.monotonic() + 30
        while time.monotonic() < end:  # until its items are being scored
            m = requests.get(server.url + "/metrics", timeout=5).text
            if any(x.startswith("rmflow_batch_sequences_count") and float(x.split()[-1]) > 0 for x in m.splitlines()):
                break
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert server.proc.wait(60) == 0, server.output()
        assert result["status"] == 200 and len(result["scores"]) == 128
        np.testing.assert_allclose(result["scores"], rm.score(conversations[:128]), atol=1e-5, rtol=0)
        with pytest.raises(requests.ConnectionError):
            requests.get(server.url + "/health", timeout=5)
    finally:
        server.stop()


def test_sigterm_out_of_time_answers_503_and_the_default_length_is_the_model_s(outcome, conversations):
    """Served without --max-length, a model trained on the demo's 128-token shards scores up to its
    4,096 positions, in packed rows of at most 4 sizes compiled at start-up, the largest holding
    its positions: an OpenRLHF batch with one query past 128 tokens gets every reward. With --no-response-units, a K-response record's responses
    run as conversations, the prompt in each. A SIGTERM that finds more work than
    --shutdown-timeout-s allows answers what has not run with 503 JSON and Retry-After, says so,
    and exits 0."""
    _, rm = outcome
    server = Server(rm._loaded.folder, "--token-budget", "256", "--max-batch-rows", "2", "--shutdown-timeout-s",
                    "0.5", "--no-response-units", max_length=None)
    try:
        info = requests.get(server.url + "/v1/model", timeout=10).json()
        assert info["max_length"] == rm.positions and info["startup_length"] == 128, info
        assert not info["response_units"]
        assert f"up to {rm.positions:,} tokens: the model's positions; " in server.output()
        # packed rows of the training length, 1 or 2 a forward (--token-budget 256); a longer item's
        # row (its power of two, up to the model's positions) compiles when one first comes
        assert info["batch_shapes"] == [[1, 128], [2, 128]] and info["compiled_shapes"] == 2
        renderer = rm._record_tokenizer()
        short_long = [renderer.render_text((("user", "Hi"), ("assistant", "Hello."))),
                      renderer.render_text((("user", "word " * 400), ("assistant", "Hello.")))]
        r = server.post("/get_reward", {"query": short_long})
        assert r.status_code == 200, r.text
        want = score_sequences(rm._loaded.model, [rm.encode_text(t) for t in short_long], pad_id=rm.pad_id)
        np.testing.assert_allclose(r.json()["rewards"], want, atol=1e-5, rtol=0)
        texts = ["A.", "B, as it is longer.", "C"]
        each = [[{"role": "user", "content": "Pick one."}, {"role": "assistant", "content": t}] for t in texts]
        tokens = _metric(server, "rmflow_tokens_scored_total")
        r = server.post("/v1/score", {"responses": [{"prompt": "Pick one.", "responses": texts}]})
        np.testing.assert_allclose(r.json()["response_scores"][0], rm.score(each), atol=1e-5, rtol=0)
        assert _metric(server, "rmflow_tokens_scored_total") - tokens == sum(len(rm.encode(c)) for c in each)
        short = [c for c in conversations if len(rm.encode(c)) <= 128][:64]
        result = {}

        def client():
            r = server.post("/v1/score", {"conversations": (short * 32)[:2048]})  # 1,024 forward passes
            result["status"], result["body"], result["retry"] = r.status_code, r.json(), r.headers.get("Retry-After")

        t = threading.Thread(target=client)
        t.start()
        end = time.monotonic() + 60
        while time.monotonic() < end and not requests.get(server.url + "/health", timeout=5).json()["queue_depth"]:
            time.sleep(0.01)  # until its items are queued
        server.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert server.proc.wait(60) == 0, server.output()
        assert result["status"] == 503 and result["retry"] and "shutting down" in result["body"]["error"], result
        assert "requests cut at --shutdown-timeout-s 0.5 s" in server.output(), server.output()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_process_model_serves_step_scores_equal_to_the_api(process_run):
    run, records = process_run
    from rmflow import RewardModel

    rm = RewardModel.load(str(run))
    solutions = [{"prompt": r["prompt"], "completions": r["completions"]} for r in records]
    solutions = [s for s in solutions if len(rm.encode_steps(s)[0]) <= MAX_LENGTH][:12]
    # At most 4 solutions a forward: 15 batch shapes to compile (16 rows: 25; the default: 35), and
    # the 12 solutions still share forwards.
    server = Server(run, "--max-batch-rows", "4")
    try:
        r = server.post("/v1/score", {"solutions": solutions})
        assert r.status_code == 200, r.text
        want = rm.score_steps(solutions)
        for got, exp in zip(r.json()["step_scores"], want):
            np.testing.assert_allclose(got, exp, atol=1e-5, rtol=0)
        assert r.json()["first_errors"] == [int(np.argmax(p < 0.5)) if (p < 0.5).any() else -1 for p in want]
        assert not requests.get(server.url + "/v1/model", timeout=10).json()["response_units"]  # none to score
        r = server.post("/get_reward", {"query": ["x"]})
        assert r.status_code == 400 and "outcome" in r.json()["error"]
        r = server.post("/v1/score", {"conversations": [[{"role": "user", "content": "q"}]]})
        assert r.status_code == 400 and "'solutions'" in r.json()["error"]
    finally:
        server.stop()


# ---------------------------------------------------------------------------- the core, no HTTP

def test_scoring_shapes_plan_fits_every_batch_shortest_first():
    from rmflow.trainer.inference import ScoringShapes

    shapes = ScoringShapes(300, max_rows=8, token_budget=1024)
    assert shapes.lengths == (16, 32, 64, 128, 256, 300)
    assert shapes.shapes == ((8, 16), (8, 32), (8, 64), (8, 128), (4, 256), (2, 300))
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 301, 500)
    batches = shapes.plan(lengths)
    assert sorted(np.concatenate(batches)) == list(range(500))
    for b in batches:
        assert len(b) <= shapes.rows(shapes.length_for(int(lengths[b].max())))
    longest = [int(lengths[b].max()) for b in batches]
    assert longest == sorted(longest)
    with pytest.raises(ValueError):
        shapes.length_for(301)
    small = ScoringShapes(300, max_rows=8, token_budget=1024, small_batches=True)
    assert small.row_options(64) == (1, 2, 4, 8) and small.row_options(300) == (1, 2)
    assert [small.rows_for(n, 64) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert len(small.shapes) == 4 * 4 + 3 + 2  # 16 ... 128: 1, 2, 4, 8 rows; 256: 1, 2, 4; 300: 1, 2
    groups = rng.integers(0, 3, 500)
    batches = shapes.plan(lengths, one_length=True, groups=groups)  # a batch's shape: its members' own
    assert sorted(np.concatenate(batches)) == list(range(500))
    for b in batches:
        assert len({shapes.length_for(int(n)) for n in lengths[b]}) == 1 and len(set(groups[b])) == 1
        assert len(b) <= shapes.rows(shapes.length_for(int(lengths[b].max())))


def test_a_solution_s_step_scores_do_not_depend_on_its_batch(process_run):
    """The process scorer pads each solution alone into a shape of its own length and step count,
    so its scores are the same to the last bit whatever it is batched with (a Beam job's reruns
    are byte-identical), and each shape compiles once."""
    from rmflow import RewardModel

    run, records = process_run
    rm = RewardModel.load(str(run))
    encoded = [rm.encode_steps({"prompt": r["prompt"], "completions": r["completions"]}) for r in records]
    encoded = [e for e in encoded if len(e[0]) <= MAX_LENGTH][:12]
    together = rm.score_step_ids(encoded, batch_size=8)
    alone = [rm.score_step_ids([e], batch_size=8)[0] for e in encoded[::-1]][::-1]
    for a, b, (_, ends) in zip(together, alone, encoded):
        assert a.dtype == np.float32 and len(a) == len(ends) and np.array_equal(a, b)
    scorer = rm.scorer(rm.shapes(8))
    assert scorer.compiled <= {(8, n, s) for n in scorer.shapes.lengths for s in (8, 16, 32, 64)}


def test_units_of_k_responses_run_in_the_shapes_warmed_at_load_and_score_as_alone():
    """``response_units`` cuts one prompt's conversations into units of at most UNIT_RESPONSES
    responses and max_length tokens (a prompt shared by none: an empty one); a server's batches
    of units, cut by the plan it uses, run in shapes ``warm_up(units=True)`` compiled, and each
    response's reward equals its conversation's scored alone."""
    from flax import nnx
    from rmflow.schemas.record import ResponsesRecord
    from rmflow.trainer import inference
    from rmflow.trainer.inference import UNIT_RESPONSES, ScoringShapes, SequenceScorer, response_units
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer

    model = RewardTransformer(ModelConfig.micro(300), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)

    def group(k, prompt_len):
        prompt = rng.integers(3, 300, prompt_len)
        return [np.concatenate([prompt, rng.integers(3, 300, int(rng.integers(1, 40)))]) for _ in range(k)]

    groups = [group(11, 30), group(3, 5), group(2, 90), group(9, 0), group(17, 12)]
    shapes = ScoringShapes(128, max_rows=4, token_budget=256, small_batches=True)  # 9 shapes
    scorer = SequenceScorer(model, shapes)
    scorer.warm_up(units=True)
    warmed = inference._rewards_and_outputs._cache_size()
    items, owner = [], []
    for g, seqs in enumerate(groups):
        units = response_units(seqs, shapes.max_length)
        assert all(u.k <= UNIT_RESPONSES and u.unit_len <= 128 for u in units if isinstance(u, ResponsesRecord))
        assert sum(getattr(u, "k", 1) for u in units) == len(seqs)
        items += units
        owner += [g] * len(units)
    assert sum(isinstance(u, ResponsesRecord) for u in items) > len(groups)  # some groups were cut
    got: list = [None] * len(items)
    for batch in shapes.plan([getattr(u, "unit_len", None) or len(u) for u in items]):
        units = [i for i in batch if isinstance(items[i], ResponsesRecord)]
        if units:
            for i, r in zip(units, scorer.run_units([items[i] for i in units])[0]):
                got[i] = r
        for i in (i for i in batch if not isinstance(items[i], ResponsesRecord)):
            got[i] = scorer.run([items[i]])
    assert inference._rewards_and_outputs._cache_size() == warmed  # nothing compiled at request time
    for g, seqs in enumerate(groups):
        ours = np.concatenate([got[i] for i in range(len(items)) if owner[i] == g])
        np.testing.assert_allclose(ours, scorer.score(seqs), atol=1e-5, rtol=0)


def test_the_batcher_gives_each_item_its_own_result_and_drains_on_close():
    from rmflow.trainer.inference import ScoringShapes

    from rmflow.server.batcher import Closed, DynamicBatcher, QueueFull

    shapes = ScoringShapes(64, max_rows=4, token_budget=128)
    seen = []

    def run(batch):
        seen.append(len(batch))
        assert len(batch) <= 4
        time.sleep(0.002)
        return [x * 2 for x in batch]

    b = DynamicBatcher(run, shapes.plan, token_budget=128, max_wait_s=0.01, max_queue=64)
    futures = [b.submit([i, i + 1000], [1 + i % 60, 5]) for i in range(20)]
    assert [[f.result(10) for f in fs] for fs in futures] == [[2 * i, 2 * (i + 1000)] for i in range(20)]
    assert max(seen) > 1  # items from different submits shared batches
    with pytest.raises(QueueFull):
        b.submit(list(range(65)), [1] * 65)
    with pytest.raises(QueueFull):  # 9 units of 8 responses: 72 sequences, though 9 items
        b.submit(list(range(9)), [40] * 9, [8] * 9)
    pending = b.submit(list(range(30)), [60] * 30)
    b.close()
    assert [f.result(0) for f in pending] == [2 * i for i in range(30)]
    with pytest.raises(Closed):
        b.submit([1], [1])

    def fails(batch):
        raise RuntimeError("device lost")

    b = DynamicBatcher(fails, shapes.plan, token_budget=128, max_wait_s=0.0)
    with pytest.raises(RuntimeError, match="device lost"):
        b.submit([1], [1])[0].result(10)
    b.close()


def test_the_batcher_is_fair_cancellable_and_bounded_by_the_estimated_wait():
    """A small request submitted behind a big one is done long before it; a cancelled request's
    waiting items never run; once the throughput is measured, a request that would wait longer
    than max_queue_wait_s is refused with a Retry-After, while an empty queue takes anything;
    ``cut`` fails what is waiting with Closed."""
    from rmflow.trainer.inference import ScoringShapes

    from rmflow.server.batcher import Closed, DynamicBatcher, QueueFull

    shapes = ScoringShapes(64, max_rows=4, token_budget=256)
    ran = []

    def run(batch):
        time.sleep(0.01)
        ran.extend(batch)
        return batch

    b = DynamicBatcher(run, shapes.plan, token_budget=256, max_wait_s=0.001, max_queue=10_000, max_queue_wait_s=0.5)
    big = b.submit([("big", i) for i in range(400)], [64] * 400)  # 100 batches, about 1 s
    small = b.submit([("small", 0), ("small", 1)], [64, 64])
    assert [f.result(10) for f in small] == [("small", 0), ("small", 1)]
    assert sum(f.done() for f in big) < 100  # the small request did not wait for the big one
    assert b.cancel(big) > 200 and b.depth == 0
    time.sleep(0.2)
    assert sum(1 for x in ran if x[0] == "big") < 100 and b.tokens_per_second > 0
    lone = b.submit([("lone", i) for i in range(400)], [64] * 400)  # an empty queue takes anything (1 s of work)
    with pytest.raises(QueueFull, match="--max-queue-wait-s") as e:
        b.submit([("late", 0)], [64])
    assert e.value.retry_after >= 1
    assert b.cut("stopping") > 0
    with pytest.raises(Closed, match="stopping"):
        for f in lone:
            f.result(10)
    with pytest.raises(Closed):
        b.submit([1], [1])
    b.close(10)


def test_the_batcher_survives_an_empty_request_and_a_failing_plan():
    from rmflow.server.batcher import DynamicBatcher

    calls = []

    def plan(sizes):
        calls.append(len(sizes))
        if len(calls) == 1:
            raise RuntimeError("a bug in the plan")
        return [list(range(len(sizes)))]

    b = DynamicBatcher(lambda batch: batch, plan, token_budget=8, max_wait_s=0.0)
    assert list(b.submit([], [])) == []
    with pytest.raises(RuntimeError, match="a bug in the plan"):
        b.submit(["a"], [1])[0].result(10)
    assert b.submit(["b"], [1])[0].result(10) == "b"  # the device thread went on
    b.close(10)


def test_unpadded_strips_runs_in_linear_time():
    from types import SimpleNamespace

    from rmflow.server.protocol import unpadded

    rm = SimpleNamespace(tokenizer=SimpleNamespace(pad_token="<pad>", eos_token="<e>"), turn_end="<e>\n")
    assert unpadded("<pad><e>hi<e>\n<e><pad>", rm) == unpadded("hi", rm) == "hi<e>\n"
    start = time.monotonic()
    assert unpadded("<pad>" * 200_000 + "hi" + "<e>" * 200_000, rm) == "hi<e>\n"
    assert time.monotonic() - start < 2  # linear in the text's length (slicing per token: quadratic)


def test_the_plan_pads_the_fewest_tokens():
    """``ScoringShapes.plan`` cuts sorted inputs into the batches that cost the fewest padded
    tokens (plus a fixed cost a batch): checked against every way to cut small random lists, and
    on a server-sized take of real lengths it pads far less than cutting by rows alone."""
    import itertools

    from rmflow.trainer.inference import BATCH_OVERHEAD_TOKENS, ScoringShapes

    shapes = ScoringShapes(300, max_rows=8, token_budget=1024, small_batches=True)

    def cost(batches, lengths):
        return sum(shapes.rows_for(len(b), shapes.length_for(int(lengths[b].max()))) *
                   shapes.length_for(int(lengths[b].max())) + BATCH_OVERHEAD_TOKENS for b in batches)

    rng = np.random.default_rng(1)
    for _ in range(60):
        lengths = rng.integers(1, 301, int(rng.integers(1, 9)))
        plan = shapes.plan(lengths)
        assert sorted(np.concatenate(plan)) == list(range(len(lengths)))
        for b in plan:
            assert len(b) <= shapes.rows(shapes.length_for(int(lengths[b].max())))
        s = np.argsort(lengths, kind="stable")
        best = min(cost(parts, lengths) for cuts in itertools.chain.from_iterable(
            itertools.combinations(range(1, len(s)), r) for r in range(len(s)))
            for parts in [np.split(s, cuts)] if all(len(p) <= shapes.rows(shapes.length_for(int(lengths[p].max())))
                                                    for p in parts))
        assert cost(plan, lengths) == best
    # Server-sized takes (48 queued requests of HH-RLHF-like lengths) on the server benchmark's
    # shapes: never more padding than a greedy cut (sorted, a new batch only when the rows run
    # out), and less in all.
    shapes = ScoringShapes(512, max_rows=64, token_budget=8192, small_batches=True)
    ours = greedy = 0
    for _ in range(20):
        lengths = np.minimum(rng.lognormal(5.2, 0.6, 48).astype(int) + 1, 512)
        by_rows = []
        for i in np.argsort(lengths, kind="stable"):
            if not by_rows or len(by_rows[-1]) + 1 > shapes.rows(shapes.length_for(int(lengths[i]))):
                by_rows.append([])
            by_rows[-1].append(i)
        a, b = cost(shapes.plan(lengths), lengths), cost([np.array(x) for x in by_rows], lengths)
        assert a <= b
        ours, greedy = ours + a, greedy + b
    assert ours < 0.95 * greedy


def test_a_grpo_reward_function_asks_the_server_and_gets_the_api_s_rewards(outcome, conversations):
    """rmflow.scoring.grpo.server_reward_func called as TRL's GRPOTrainer calls a reward
    function (conversational prompts and completions, its other keyword arguments): the
    server's rewards, equal to the API's; an empty completion gets None without being sent; a
    refusal is raised with the server's answer."""
    from rmflow.scoring.grpo import server_reward_func

    server, rm = outcome
    some = conversations[:6]
    fn = server_reward_func(server.url, api_key=KEY)
    prompts = [c[:-1] for c in some] + [some[0][:-1]]
    completions = [[c[-1]] for c in some] + [[{"role": "assistant", "content": "  "}]]
    got = fn(prompts=prompts, completions=completions, completion_ids=[[1]] * 7, trainer_state=None,
             log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)
    assert got[-1] is None
    np.testing.assert_allclose(got[:-1], rm.score(some), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="401"):
        server_reward_func(server.url, api_key="wrong")(prompts=prompts[:1], completions=completions[:1])
    # a completion the server refuses (longer than its positions even truncated) gets None, the rest their rewards
    huge = [{"role": "assistant", "content": "word " * (MAX_LENGTH * 4)}]
    got = fn(prompts=prompts[:3], completions=[completions[0], huge, completions[2]])
    assert got[1] is None and got[0] == pytest.approx(float(rm.score(some[:1])[0]), abs=1e-5)
    assert got[2] == pytest.approx(float(rm.score(some[2:3])[0]), abs=1e-5)
    from rmflow.scoring.grpo import _has_reply  # a reply that calls a tool is a reply, as the API reads it

    assert _has_reply([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                           "tool_calls": [{"function": {"name": "f"}}]}])


def test_verl_s_sglang_and_vllm_pooling_requests_get_the_api_s_rewards(outcome, conversations):
    """verl's reward loop against SGLang (verl/experimental/reward_loop/reward_loop.py): POST
    /v1/embeddings {"model", "input": one rendered text}, reading data[-1].embedding[-1]; vLLM's
    /pooling with the same body, reading data[-1].data[-1]: both the raw reward, equal to the
    API's; token ids instead of text are refused in one line."""
    server, rm = outcome
    renderer = rm._record_tokenizer()
    some = conversations[:3]
    texts = [renderer.render_text(tuple((m["role"], m["content"]) for m in c)) for c in some]
    for text, want in zip(texts, rm.score(some)):
        r = requests.post(server.url + "/v1/embeddings", json={"model": "/path/to/RM", "input": text},
                          headers={"Content-Type": "application/json", **AUTH}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert abs(body["data"][-1]["embedding"][-1] - want) < 1e-5 and body["object"] == "list"
        assert body["data"][-1]["object"] == "embedding" and body["usage"]["prompt_tokens"] > 0
        pooled = server.post("/pooling", {"model": "rm", "input": text}).json()
        assert abs(pooled["data"][-1]["data"][-1] - want) < 1e-5 and pooled["data"][0]["object"] == "pooling"
    many = server.post("/v1/embeddings", {"input": texts}).json()
    np.testing.assert_allclose([d["embedding"][0] for d in many["data"]], rm.score(some), atol=1e-5, rtol=0)
    r = server.post("/v1/embeddings", {"input": [[1, 2, 3]]})
    assert r.status_code == 400 and "rendered text" in r.text
    info = requests.get(server.url + "/v1/model", headers=AUTH, timeout=10).json()
    assert {"/pooling", "/v1/embeddings"} <= set(info["endpoints"])


def test_a_request_of_many_over_long_items_tokenizes_one_of_them():
    """Encoding a request stops at the first item it refuses: items each too long in tokens (but
    not in characters, which are checked first) cost one tokenization a request, not one an item
    (a 20 MB body of 60 such items took 17 s of a core to be refused)."""
    from rmflow.scoring.errors import BadConversation
    from rmflow.server.protocol import RequestError, _encode_all

    calls = []

    def encode(item):
        calls.append(item)
        if item.startswith("long"):
            raise BadConversation("12,000 tokens, more than the server's 512")
        return item

    with pytest.raises(RequestError) as refused:
        _encode_all(["short", *[f"long {i}" for i in range(60)]], encode, "conversation")
    assert calls == ["short", "long 0"] and refused.value.status == 422
    assert "conversation 1: 12,000 tokens" in str(refused.value)
    assert _encode_all(["a", "b"], encode, "conversation") == ["a", "b"]

"""Deterministic scoring (``deterministic=True``, `rmflow score --deterministic`, `rmflow serve
--deterministic`): a conversation's score is the same to the last bit whatever else shares its
batch, in every entry point. The same random batch compositions move the default packed scores
(so the checks below can fail), never the deterministic ones."""

import concurrent.futures
import json

import numpy as np
import pytest
import requests
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train

from tests.compositions import bits, compositions
from tests.scoring.test_serve import MAX_LENGTH, Server, _conversations, _fits


def test_a_sequence_s_score_never_depends_on_its_batch_in_deterministic_shapes():
    """500 sequences of 1 to 250 tokens, scored in 20 random compositions of batches (each cut
    by the shapes' own plan, as the server's batcher cuts what it takes): deterministic shapes give
    every sequence the same bits each time; packed rows, the default, do not."""
    from flax import nnx
    from rmflow.trainer.inference import PackedScorer, PackedShapes, ScoringShapes, SequenceScorer
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer

    model = RewardTransformer(ModelConfig.micro(300), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, 300, int(rng.integers(1, 251))).astype(np.int32) for _ in range(500)]
    deterministic = SequenceScorer(model, ScoringShapes(256, max_rows=16, token_budget=2048, deterministic=True))
    packed = PackedScorer(model, PackedShapes(256, token_budget=2048, row_length=256))

    def scored(scorer, batches):
        out = np.zeros(len(seqs), np.float32)
        for batch in batches:
            for part in scorer.shapes.plan([len(seqs[i]) for i in batch]):
                ids = np.asarray(batch)[part]
                out[ids] = scorer.run([seqs[i] for i in ids])
        return out

    first = scored(deterministic, [np.arange(len(seqs))])
    moved = 0
    packed_first = scored(packed, [np.arange(len(seqs))])
    for k, batches in enumerate(compositions(len(seqs), 20, seed=2)):
        np.testing.assert_array_equal(bits(scored(deterministic, batches)), bits(first))
        if k < 3:  # the same compositions move packed scores (at float rounding)
            again = scored(packed, batches)
            moved += int((bits(again) != bits(packed_first)).sum())
            np.testing.assert_allclose(again, first, atol=1e-5)
    assert moved, "packed rows gave the same bits in every composition: this test could not tell the modes apart"
    assert ScoringShapes(256, deterministic=True).row_options(64) == (ScoringShapes(256).rows(64),)
    with pytest.raises(ValueError, match="no small batches"):
        ScoringShapes(256, small_batches=True, deterministic=True)


@pytest.fixture(scope="module")
def run_and_model(demo_shards, tmp_path_factory):
    from rmflow import RewardModel

    base = tmp_path_factory.mktemp("deterministic")
    train(TrainConfig(data=str(demo_shards), model="micro", output=str(base / "run"), max_steps=1, batch_size=4))
    rm = RewardModel.load(str(base / "run"))
    rm.limit_length(MAX_LENGTH)
    return base / "run", rm


@pytest.fixture(scope="module")
def conversations(shared_data, run_and_model):
    _, rm = run_and_model
    return [c for c in _conversations(shared_data, 1400) if _fits(rm, c)][:1000]


def test_the_api_and_rmflow_score_give_each_conversation_its_bits_whatever_it_is_scored_with(
        run_and_model, conversations, tmp_path):
    from rmflow.scoring.scorers import ScoringMode, score_file

    _, rm = run_and_model
    convs = conversations[:300]
    want = rm.score(convs, deterministic=True)
    # one set of shapes for every caller: the batch size asked for changes no bit
    np.testing.assert_array_equal(bits(rm.score(convs[:40], batch_size=3, deterministic=True)), bits(want[:40]))
    for batches in compositions(len(convs), 4, seed=3):
        for batch in batches:
            np.testing.assert_array_equal(bits(rm.score([convs[i] for i in batch], deterministic=True)),
                                          bits(want[batch]))
    # one prompt's K responses: each scored as its own conversation (no unit shares a row)
    prompt = convs[0][:-1]
    replies = [c[-1] for c in convs[:9]]
    k = [prompt + [r] for r in replies]
    alone = [rm.score([c], deterministic=True)[0] for c in k]
    np.testing.assert_array_equal(bits(rm.score_groups([[rm.encode(c) for c in k]], deterministic=True)[0]),
                                  bits(alone))
    # rmflow score --deterministic: the same bits in a file of K-response records and conversations
    src = tmp_path / "in.jsonl"
    records = [{"prompt": prompt[0]["content"], "responses": [r["content"] for r in replies]}, *convs[:20]]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    score_file(str(run_and_model[0]), str(src), str(tmp_path / "out.jsonl"), mode=ScoringMode(deterministic=True))
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    single = [[{"role": "user", "content": prompt[0]["content"]}, r] for r in replies]
    np.testing.assert_array_equal(bits(rows[0]["response_scores"]), bits(rm.score(single, deterministic=True)))
    np.testing.assert_array_equal(bits([r["score"] for r in rows[1:]]), bits(want[:20]))


@pytest.mark.slow
def test_the_server_gives_each_conversation_its_bits_under_16_concurrent_clients(run_and_model, conversations):
    """1,000 conversations sent by 16 concurrent clients, each its own random requests, twice:
    every score is the API's deterministic one, to the last bit."""
    run, rm = run_and_model
    want = rm.score(conversations, deterministic=True)
    server = Server(run, "--deterministic", "--token-budget", "4096", "--max-batch-rows", "16", "--max-queue-wait-s", "0")
    try:
        info = requests.get(server.url + "/v1/model", timeout=10).json()
        assert info["deterministic"] and not info["response_units"]
        requests_ = [batch for batches in compositions(len(conversations), 2, seed=4) for batch in batches]

        def send(batch):
            r = server.post("/v1/score", {"conversations": [conversations[i] for i in batch]})
            assert r.status_code == 200, r.text
            return batch, r.json()["scores"]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for batch, scores in pool.map(send, requests_):
                np.testing.assert_array_equal(bits(scores), bits(want[batch]))
        # one prompt's K responses: each its conversation's bits
        replies = [c[-1]["content"][:300] for c in conversations[:5]]
        r = server.post("/v1/score", {"responses": [{"prompt": "Say something helpful.", "responses": replies}]})
        assert r.status_code == 200, r.text
        alone = [[{"role": "user", "content": "Say something helpful."}, {"role": "assistant", "content": x}]
                 for x in replies]
        np.testing.assert_array_equal(bits(r.json()["response_scores"][0]), bits(rm.score(alone, deterministic=True)))
    finally:
        server.stop()

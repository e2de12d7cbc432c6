"""The reward server's reward-hacking signals (``rmflow.server.monitor``): a simulated policy that
games length makes the score-length warning fire (and drift, as its scores climb past the held-out
ones); a policy that does not, however long it runs, raises none; through `rmflow serve`, the
signals are in /v1/model and /metrics and a stream of over-long conversations is warned of."""

import numpy as np
import requests

from rmflow.server.monitor import MIN_SEQUENCES, RewardMonitor, sequence_tokens
from tests.scoring.test_serve import AUTH, Server


def run_policy(monitor, rounds, gaming, seed=0):
    """A policy's requests, 64 conversations a round. Gaming: its replies grow longer each round and
    the reward model, biased to length, scores them higher; else lengths and scores vary at random
    around the held-out distribution."""
    rng = np.random.default_rng(seed)
    for t in range(rounds):
        tokens = rng.integers(80, 240, 64) + (6 * t if gaming else 0)
        quality = rng.normal(0.0, 1.0, 64)
        scores = quality + (0.02 * (tokens - 160) if gaming else 0.0)
        monitor.observe(scores, tokens)


def test_a_length_gaming_policy_is_warned_of_and_an_honest_one_is_not():
    lines = []
    honest = RewardMonitor(2048, reference={"mean": 0.0, "std": 1.0}, trained_length=512, emit=lines.append)
    run_policy(honest, 100, gaming=False)
    assert honest.seen == 6400 and not honest.warnings and not lines
    s = honest.summary()
    assert abs(s["drift"]) < 0.1 and abs(s["length_correlation"]) < 0.1 and s["over_trained_length"] == 0

    gamed = RewardMonitor(2048, reference={"mean": 0.0, "std": 1.0}, trained_length=512, emit=lines.append)
    run_policy(gamed, 100, gaming=True)
    s = gamed.summary()
    assert "length_correlation" in s["warning"] and "drift" in s["warning"], s
    assert any("WARNING length correlation" in x for x in lines) and any("WARNING drift" in x for x in lines)
    assert len([x for x in lines if "length correlation" in x]) == 1  # said once while it lasts


def test_an_ensemble_whose_members_part_ways_is_warned_of():
    lines = []
    m = RewardMonitor(1000, reference={"mean": 0.0, "std": 1.0, "member_std": 0.2}, emit=lines.append)
    rng = np.random.default_rng(0)
    for t in range(40):  # the members' disagreement grows from the held-out level to 3x it
        m.observe(rng.normal(size=50), rng.integers(80, 200, 50), np.full(50, 0.2 * (1 + t / 20)))
    s = m.summary()
    assert s["spread_ratio"] > 1.5 and "spread_ratio" in s["warning"]
    assert [x for x in lines if "WARNING spread ratio" in x] and not [x for x in lines if "drift" in x]
    quiet = RewardMonitor(1000, reference={"mean": 0.0, "std": 1.0, "member_std": 0.2}, emit=lines.append)
    quiet.observe(rng.normal(size=500), rng.integers(80, 200, 500), np.full(500, 0.21))
    assert not quiet.warnings and RewardMonitor(10).summary()["spread"] is None


def test_nothing_is_said_before_the_window_holds_enough():
    lines = []
    m = RewardMonitor(4096, reference={"mean": 0.0, "std": 1.0}, emit=lines.append)
    m.observe(np.arange(MIN_SEQUENCES - 1, dtype=float), np.arange(MIN_SEQUENCES - 1))  # r = 1, drift huge
    assert not lines and m.summary()["length_correlation"] > 0.99
    m.observe([1000.0], [1000])
    assert any("length correlation" in x for x in lines)
    assert RewardMonitor(0).summary()["sequences"] == 0  # off: observes nothing
    assert RewardMonitor(10).summary()["drift"] is None  # no reference: no drift


def test_the_server_reports_its_signals_and_warns_of_over_long_conversations(demo_shards, tmp_path):
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.train import run as train

    train(TrainConfig(data=str(demo_shards), model="micro", output=str(tmp_path / "run"), max_steps=1, batch_size=4))
    server = Server(tmp_path / "run", "--monitor-window", "400", "--monitor-log-every", "200", max_length=None)
    try:
        info = requests.get(server.url + "/v1/model", timeout=10).json()
        trained = info["monitor"]["trained_length"]
        assert trained and info["monitor"]["sequences"] == 0
        long_reply = " ".join(["word"] * (trained + 50))
        convs = [[{"role": "user", "content": f"Say it {i}."}, {"role": "assistant", "content": long_reply}]
                 for i in range(MIN_SEQUENCES + 10)]
        r = server.post("/v1/score", {"conversations": convs})
        assert r.status_code == 200, r.text
        info = requests.get(server.url + "/v1/model", timeout=10).json()["monitor"]
        assert info["over_trained_length"] == 1.0 and "over_trained_length" in info["warning"]
        metrics = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
        assert "rmflow_monitor_over_trained_length 1.0" in metrics and "rmflow_monitor_length_correlation" in metrics
        out = server.output()
        assert "WARNING over trained length" in out and "monitor: 210 conversations" in out
    finally:
        server.stop()


def test_a_unit_s_conversations_each_count_their_prompt():
    from rmflow.schemas.record import ResponsesRecord

    unit = ResponsesRecord(prompt_ids=np.arange(5), responses=[np.arange(3), np.arange(7)], lasts=[7, 11],
                           scores=np.zeros(2), record_id="0" * 32)
    assert sequence_tokens(unit) == [8, 12] and sequence_tokens(np.arange(9)) == [9]

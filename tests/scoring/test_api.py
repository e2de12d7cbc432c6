"""The Python API: `from rmflow import RewardModel`; its docstring example runs as written, its
scores equal `rmflow score` (a thin wrapper over it) and the model's own forward pass."""

import doctest
import json
import os
import shutil

import numpy as np
import pytest
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train
from typer.testing import CliRunner

from rmflow.cli import app

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
CONVS = [[U("How do I boil an egg?"), A("Eight minutes in boiling water.")],
         [U("Hi"), A("Hello!")],
         [{"role": "system", "content": "Be brief."}, U("Name a colour."), A("Blue"), U("Another?"), A("Green.")]]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, demo_shards):
    base = tmp_path_factory.mktemp("api")
    shutil.copytree(demo_shards, base / "shards")  # the demo at max_length 128, preprocessed once per worker
    train(TrainConfig(data=str(base / "shards"), model="micro", output=str(base / "runs" / "rm1"), max_steps=2, batch_size=4, optimizer={"learning_rate": 1e-3}))
    return base


def test_docstring_example_runs(workdir, monkeypatch):
    import rmflow.scoring.api

    monkeypatch.chdir(workdir)  # the example loads "runs/rm1"
    failures, tried = doctest.testmod(rmflow.scoring.api, raise_on_error=False, verbose=False)
    assert tried >= 6 and failures == 0


def test_scores_equal_the_cli_and_keep_order(workdir, tmp_path):
    from rmflow import RewardModel

    rm = RewardModel.load(str(workdir / "runs" / "rm1"))
    scores = rm.score(CONVS, batch_size=2)
    assert scores.dtype == np.float32 and scores.shape == (3,)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS))
    r = CliRunner().invoke(app, ["score", "--model", str(workdir / "runs" / "rm1"), "-i", str(tmp_path / "in.jsonl"),
                                 "-o", str(tmp_path / "out.jsonl")])
    assert r.exit_code == 0, r.output
    cli = [json.loads(x)["score"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(scores, cli, atol=1e-6)
    # Sorted by length inside, returned in input order: reversing the input reverses the output.
    np.testing.assert_allclose(rm.score(CONVS[::-1]), scores[::-1], atol=1e-6)
    rc, rr = rm.score_pairs(CONVS[:2], CONVS[1:])
    np.testing.assert_allclose(rc, scores[:2], atol=1e-6)
    np.testing.assert_allclose(rr, scores[1:], atol=1e-6)


def test_a_model_loaded_again_scores_with_the_programs_already_compiled(workdir):
    """The scoring forwards are jitted once per process, the model's structure a static argument
    and its weights an ordinary one: loading the run again (a Beam worker's next DoFn, a second
    job in one process, the API after eval) traces and compiles nothing new, for single sequences
    and for eval's packed pairs, and scores the same."""
    import grain
    from rmflow.schemas.manifest import Manifest
    from rmflow.schemas.record import decode
    from rmflow.trainer import inference

    from rmflow import RewardModel

    def traced_programs():  # one a row (_rewards) and packed rows (_rewards_and_outputs: segments and branches)
        return inference._rewards._cache_size() + inference._rewards_and_outputs._cache_size()

    run = str(workdir / "runs" / "rm1")
    first = RewardModel.load(run).score(CONVS)
    traced = traced_programs()
    again = RewardModel.load(run).score(CONVS)
    assert traced_programs() == traced > 0
    np.testing.assert_array_equal(again, first)

    shards = workdir / "shards"
    manifest = Manifest.from_json((shards / "manifest.json").read_text())
    source = grain.sources.ArrayRecordDataSource([str(shards / s.file) for s in manifest.splits["eval"].shards])
    records = [decode(source[i]) for i in range(min(len(source), 6))]
    first = inference.score_pairs(inference.load_model(run).model, records, batch_size=4)
    traced = inference._packed_pair_rewards._cache_size()
    again = inference.score_pairs(inference.load_model(run).model, records, batch_size=4)
    assert inference._packed_pair_rewards._cache_size() == traced > 0
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def test_bad_conversations_say_which(workdir):
    from rmflow import RewardModel
    from rmflow.scoring.api import BadConversation

    rm = RewardModel.load(str(workdir / "runs" / "rm1"))
    with pytest.raises(BadConversation, match="conversation 1: 'messages' ends with a user message"):
        rm.score([CONVS[0], [U("Hi")]])
    with pytest.raises(ValueError, match="2 chosen but 1 rejected"):
        rm.score_pairs(CONVS[:2], CONVS[:1])
    with pytest.raises(ValueError, match="rmflow eval --normalize"):
        rm.score(CONVS, normalized=True)


def test_a_length_limit_is_the_model_s_own_to_set(workdir):
    """``limit_length`` lowers the most tokens the model scores (the server's --max-length): the
    batch shapes stop there, scorers built for the old limit are dropped, a conversation over it
    is refused, and a limit past the model's positions is refused."""
    from rmflow import RewardModel
    from rmflow.scoring.api import BadConversation

    rm = RewardModel.load(str(workdir / "runs" / "rm1"))
    before = rm.score(CONVS[:2])
    rm.limit_length(64)
    assert rm.max_length == 64 and rm.shapes().max_length == 64 and not rm._scorers
    assert max(rm.shapes(packed=False).lengths) == 64
    with pytest.raises(BadConversation, match="more than the model's 64 positions"):
        rm.score([[U("word " * 80), A("ok")]])
    with pytest.raises(ValueError, match="from 1 to the model's 4096 positions"):
        rm.limit_length(rm.positions + 1)
    rm.limit_length(rm.positions)
    np.testing.assert_allclose(rm.score(CONVS[:2]), before, rtol=1e-6)


def test_left_truncation_cuts_text_where_the_tokens_it_keeps_stay_the_same(workdir):
    """A text past the characters its tokens could fill is cut before it is tokenized, at a word's
    start, so the tokens kept are those the whole text ends with, even where BPE segments a long
    run of one letter by its length; a text with nowhere to cut is refused, never scored wrong."""
    from rmflow import RewardModel
    from rmflow.scoring.api import BadConversation

    rm = RewardModel.load(str(workdir / "runs" / "rm1"))
    rm.limit_length(64)
    rng = np.random.default_rng(0)
    words = " ".join("a" * int(n) for n in rng.integers(1, 40, 4000))  # runs BPE merges by their length
    words += " " + "a" * (rm.max_chars * 3 // 2)  # a last word longer than the characters kept: cut before it
    conversation = [U(words), A("b" * 37 + " fine")]
    whole = rm._record_tokenizer().encode_conversation((("user", words), ("assistant", conversation[1]["content"])))
    np.testing.assert_array_equal(rm.encode(conversation, truncate="left"), whole[-64:])
    with pytest.raises(BadConversation, match="without a space to cut it at"):
        rm.encode([U("a" * (3 * rm.max_chars)), A("ok")], truncate="left")
    from rmflow.rendering.tokenize import left_cut

    assert left_cut("hello world foo bar", 5) == " foo bar" and left_cut("a" * 100, 10) is None
    assert left_cut("abc def", 100) == "abc def"


def test_the_cli_does_not_load_jax_for_help():
    import subprocess
    import sys

    code = "import sys, rmflow, rmflow.cli; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip() == "False", out.stderr


def _trl_kwargs(n):
    """The keyword arguments TRL's GRPOTrainer passes a reward function besides prompts and
    completions (GRPOTrainer._calculate_rewards): the ids, the dataset's other columns, its state
    and logging hooks."""
    return {"completion_ids": [[1, 2, 3]] * n, "answer": ["x"] * n, "trainer_state": None,
            "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None}


def test_as_reward_func_is_called_as_trl_s_grpo_trainer_calls_it(workdir):
    """Conversational and plain prompts and completions, TRL's other arguments ignored; the
    rewards equal the API's on the same conversations; an empty completion gets None (TRL's
    'no reward'); the name TRL logs it under."""
    from trl.trainer.utils import get_callable_name

    from rmflow import RewardModel

    rm = RewardModel.load(str(workdir / "runs" / "rm1"))
    fn = rm.as_reward_func()
    assert get_callable_name(fn) == "rmflow_reward"
    prompts = [c[:-1] for c in CONVS] + [CONVS[0][:-1]]
    completions = [[c[-1]] for c in CONVS] + [[A("")]]  # the last one empty: no reward
    got = fn(prompts=prompts, completions=completions, **_trl_kwargs(4))
    assert got[-1] is None and all(isinstance(x, float) for x in got[:-1])
    np.testing.assert_allclose(got[:-1], rm.score(CONVS), atol=1e-6, rtol=0)
    plain = fn(prompts=["How do I boil an egg?", "Hi"], completions=["Eight minutes in boiling water.", "Hello!"],
               **_trl_kwargs(2))  # standard format: a user turn and the reply, in the model's chat template
    np.testing.assert_allclose(plain, rm.score(CONVS[:2]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="reward_normalization"):
        rm.as_reward_func(normalized=True)

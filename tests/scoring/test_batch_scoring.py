"""`rmflow score --runner`: scoring a dataset as a Beam job (Beam's RunInference with rmflow's
ModelHandler), run here on the local runner. Its scores equal the in-process core's, for
conversations and for preference pairs (both sides, the margin, agreement with the label), from
JSONL and Parquet; bad records are counted with their reasons and the counts reconcile exactly;
best-of-n picks each group's highest-scoring candidate; an existing output is refused unless
told; a rerun is byte-identical."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rmflow.rendering.formats import parse_hh_transcript
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train
from typer.testing import CliRunner

from rmflow.cli import app


def _messages(transcript: str, side: str) -> list[dict]:
    return [{"role": r, "content": c} for r, c, *_ in parse_hh_transcript(transcript, side)]


@pytest.fixture(scope="module")
def job(demo_shards, shared_data, tmp_path_factory):
    base = tmp_path_factory.mktemp("batch-scoring")
    train(TrainConfig(data=str(demo_shards), model="micro", output=str(base / "run"), max_steps=1, batch_size=4))
    with gzip.open(shared_data / "hh_helpful_base_test_first2000.jsonl.gz", "rt", encoding="utf-8") as f:
        raw = [json.loads(next(f)) for _ in range(40)]
    lines, convs = [], []
    for i, r in enumerate(raw[:20]):  # conversations, 4 candidates a prompt group
        conv = _messages(r["chosen"] if i % 2 else r["rejected"], "chosen")
        if conv[-1]["role"] != "assistant":
            continue
        convs.append(conv)
        lines.append(json.dumps({"id": f"c{i}", "prompt_id": i // 4, "messages": conv}))
    pairs = [{"id": f"p{i}", "chosen": r["chosen"], "rejected": r["rejected"]} for i, r in enumerate(raw[20:])]
    lines += [json.dumps(p) for p in pairs]
    lines += ["{not json", json.dumps({"id": "bad", "messages": [{"role": "user", "content": "no reply"}]}),
              json.dumps([{"role": "user", "content": "a bare list"}, {"role": "assistant", "content": "fine"}])]
    (base / "in").mkdir()
    (base / "in" / "part-0.jsonl").write_text("\n".join(lines[:25]) + "\n", encoding="utf-8")
    (base / "in" / "part-1.jsonl").write_text("\n".join(lines[25:]) + "\n", encoding="utf-8")
    from rmflow import RewardModel

    rm = RewardModel.load(str(base / "run"))
    r = CliRunner().invoke(app, ["score", "--model", str(base / "run"), "-i", str(base / "in"), "-o",
                                 str(base / "out"), "--runner", "DirectRunner", "--num-shards", "3",
                                 "--group-by", "prompt_id"])
    return base, rm, convs, pairs, r


def _rows(folder):
    return [json.loads(x) for p in sorted(folder.glob("scores-*.jsonl")) for x in p.read_text().splitlines()]


def test_scores_equal_the_in_process_core_and_counts_reconcile(job):
    base, rm, convs, pairs, r = job
    assert r.exit_code == 0, r.output  # 2 bad records of 43: under --max-bad-fraction (5%), counted and written
    out = base / "out"
    assert (out / "COMPLETED").exists() and len(list(out.glob("scores-*-of-00003.jsonl"))) == 3
    rows = _rows(out)
    summary = json.loads((out / "summary.json").read_text())
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert summary["records_read"] == len(convs) + len(pairs) + 3 == summary["scored"] + summary["errors"]
    assert summary["scored"] == len(rows) and summary["errors"] == len(errors) == 2
    assert summary["errors_by_reason"] == {"bad_conversation": 1, "bad_json": 1}
    assert {e["code"] for e in errors} == {"bad_json", "bad_conversation"} and all(e["source"] for e in errors)
    assert summary["model"]["step"] == 1 and summary["model"]["kind"] == "outcome"
    by_id = {row.get("id"): row for row in rows}
    got = [by_id[f"c{i}"]["score"] for i in range(20) if f"c{i}" in by_id]
    np.testing.assert_allclose(got, rm.score(convs), atol=1e-5, rtol=0)
    assert "messages" not in by_id["c1"] and by_id["c1"]["prompt_id"] == 0  # the ids kept, the content not
    chosen = [_messages(p["chosen"], "chosen") for p in pairs]
    rejected = [_messages(p["rejected"], "rejected") for p in pairs]
    rc, rr = rm.score_pairs(chosen, rejected)
    np.testing.assert_allclose([by_id[p["id"]]["score_chosen"] for p in pairs], rc, atol=1e-5, rtol=0)
    np.testing.assert_allclose([by_id[p["id"]]["score_rejected"] for p in pairs], rr, atol=1e-5, rtol=0)
    assert [by_id[p["id"]]["agrees"] for p in pairs] == list(rc > rr)
    bare = [row for row in rows if row.get("id") is None]
    assert len(bare) == 1 and abs(bare[0]["score"] - rm.score([[{"role": "user", "content": "a bare list"},
                                                               {"role": "assistant", "content": "fine"}]])[0]) < 1e-5


def test_a_record_s_own_fields_never_overwrite_the_job_s_and_bad_text_is_a_counted_error(job, tmp_path):
    """A record's ``source`` / ``line`` / ``score`` are kept as ``input_<name>``; a lone surrogate or a
    NaN is a bad record (the job publishes the rest); an empty output folder is taken; above
    --max-bad-fraction the job publishes nothing and says why in one line."""
    base, rm, convs, _, _ = job
    k = {"prompt": "Pick one.", "responses": ["A.", "B, because it is longer.", "C"], "ranks": [2, 1, 3]}
    rows = [{"id": "sharegpt", "source": "sharegpt", "line": 7, "score": 0.5, "messages": convs[0]},
            {"id": "null", "source": None, "messages": convs[1]}, {"id": "k", **k},
            {"id": "surrogate", "note": "hi \ud800 there", "messages": convs[2]}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"id": NaN, "messages": ' + json.dumps(convs[3]) + '}\n'
    (tmp_path / "in.jsonl").write_text(text)  # json.dumps wrote the surrogate as the escape \\ud800, as JSON allows
    (tmp_path / "out").mkdir()  # empty: taken
    args = ["score", "--model", str(base / "run"), "-i", str(tmp_path / "in.jsonl"), "--runner", "DirectRunner"]
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "out"), "--max-bad-fraction", "0.5"])
    assert r.exit_code == 0, r.output
    by_id = {row["id"]: row for row in _rows(tmp_path / "out")}
    assert set(by_id) == {"sharegpt", "null", "k"}
    alone = rm.score([[{"role": "user", "content": "Pick one."}, {"role": "assistant", "content": r}]
                      for r in k["responses"]])  # one prompt's K responses: each scored as its own conversation
    np.testing.assert_allclose(by_id["k"]["response_scores"], alone, atol=1e-5, rtol=0)
    assert by_id["k"]["best_response"] == int(np.argmax(alone)) and by_id["k"]["ranks"] == [2, 1, 3]
    assert "responses" not in by_id["k"] and "prompt" not in by_id["k"]  # the content is not echoed back
    assert by_id["sharegpt"]["source"] == by_id["null"]["source"] == str(tmp_path / "in.jsonl")
    assert (by_id["sharegpt"]["input_source"], by_id["sharegpt"]["input_line"], by_id["sharegpt"]["input_score"]) \
        == ("sharegpt", 7, 0.5) and by_id["null"]["input_source"] is None and by_id["sharegpt"]["line"] == 1
    np.testing.assert_allclose(by_id["sharegpt"]["score"], rm.score([convs[0]])[0], atol=1e-5)
    errors = {e["line"]: e for e in map(json.loads, (tmp_path / "out" / "errors.jsonl").read_text().splitlines())}
    assert errors[4]["code"] == "bad_text" and "note" in errors[4]["reason"] and "NaN" in errors[5]["reason"]
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "strict"), "--max-bad-fraction", "0.1"])
    assert r.exit_code == 1 and "2 of 5 records (40.0%) cannot be scored" in r.output, r.output
    assert not (tmp_path / "strict").exists() and len(r.output.strip().splitlines()) == 1, r.output


def test_best_of_n_picks_each_group_s_highest(job):
    base, rm, convs, _, _ = job
    rows = [r for r in _rows(base / "out") if "prompt_id" in r]
    best = {json.loads(x)["prompt_id"]: json.loads(x) for x in (base / "out" / "best.jsonl").read_text().splitlines()}
    for group in {r["prompt_id"] for r in rows}:
        members = [r for r in rows if r["prompt_id"] == group]
        top = max(members, key=lambda r: r["score"])
        assert best[group]["id"] == top["id"] and best[group]["group_size"] == len(members)
        assert best[group]["messages"][-1]["role"] == "assistant"  # the candidate itself, to train on
    pairs = [json.loads(x) for x in (base / "out" / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["score_chosen"] > p["score_rejected"] for p in pairs)


def test_a_rerun_is_byte_identical_and_an_existing_output_is_refused_unless_told(job, tmp_path):
    base, *_ = job
    args = ["score", "--model", str(base / "run"), "-i", str(base / "in"), "--runner", "DirectRunner",
            "--num-shards", "3", "--group-by", "prompt_id"]
    r = CliRunner().invoke(app, [*args, "-o", str(base / "out")])
    assert r.exit_code == 1 and "--overwrite" in r.output
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "again")])
    assert r.exit_code == 0, r.output
    for name in ["errors.jsonl", "best.jsonl", "pairs.jsonl", *(f"scores-0000{i}-of-00003.jsonl" for i in range(3))]:
        assert (tmp_path / "again" / name).read_bytes() == (base / "out" / name).read_bytes(), name
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "again"), "--overwrite"])
    assert r.exit_code == 0 and (tmp_path / "again" / "COMPLETED").exists()
    r = CliRunner().invoke(app, ["score", "--model", str(base / "run"), "-i", "x.jsonl", "-o", "y.jsonl",
                                 "--group-by", "id"])
    assert r.exit_code == 2 and "only with --runner" in r.output
    r = CliRunner().invoke(app, ["score", "--model", str(base / "run"), "-i", "x.jsonl", "-o", "y",
                                 "--runner", "DirectRunner", "--output-format", "csv"])
    assert r.exit_code == 2 and "jsonl, parquet" in r.output


def test_parquet_input_scores_the_same(job, tmp_path):
    base, rm, convs, _, _ = job
    table = pa.table({"id": [f"q{i}" for i in range(len(convs))],
                      "messages": [[{"role": m["role"], "content": m["content"]} for m in c] for c in convs]})
    pq.write_table(table, tmp_path / "convs.parquet")
    r = CliRunner().invoke(app, ["score", "--model", str(base / "run"), "-i", str(tmp_path / "convs.parquet"), "-o",
                                 str(tmp_path / "out"), "--runner", "DirectRunner"])
    assert r.exit_code == 0, r.output
    rows = sorted(_rows(tmp_path / "out"), key=lambda r: int(r["id"][1:]))
    np.testing.assert_allclose([x["score"] for x in rows], rm.score(convs), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_process_model_job_scores_steps_as_the_core_and_reruns_byte_identical(process_run, tmp_path):
    from rmflow import RewardModel

    run, records = process_run
    rm = RewardModel.load(str(run))
    solutions = [{"id": f"s{i}", "prompt": r["prompt"], "completions": r["completions"]} for i, r in enumerate(records)]
    # Up to 512 tokens (21 of the 40): the model's positions would admit solutions of 2048 tokens,
    # which the API's 16-row batches would make the test's costliest forwards.
    solutions = [s for s in solutions if len(rm.encode_steps(s)[0]) <= 512]
    assert len(solutions) >= 20
    lines = [json.dumps(s) for s in solutions] + [json.dumps({"id": "empty", "prompt": "q", "completions": []})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    outs = []
    for name in ("a", "b"):
        r = CliRunner().invoke(app, ["score", "--model", str(run), "-i", str(tmp_path / "in.jsonl"), "-o",
                                     str(tmp_path / name), "--runner", "DirectRunner", "--num-shards", "2"])
        assert r.exit_code == 0, r.output  # the empty solution is an error, counted (1 of 22: under 5%)
        outs.append(tmp_path / name)
    summary = json.loads((outs[0] / "summary.json").read_text())
    assert summary["scored"] == len(solutions) and summary["errors"] == 1 and summary["model"]["kind"] == "process"
    by_id = {row["id"]: row for row in _rows(outs[0])}
    want = rm.score_steps([{"prompt": s["prompt"], "completions": s["completions"]} for s in solutions])
    for s, p in zip(solutions, want):
        np.testing.assert_allclose(by_id[s["id"]]["step_scores"], p, atol=1e-5, rtol=0)
        assert by_id[s["id"]]["first_error"] == (int(np.argmax(p < 0.5)) if (p < 0.5).any() else -1)
    for name in ["errors.jsonl", "scores-00000-of-00002.jsonl", "scores-00001-of-00002.jsonl"]:
        assert (outs[1] / name).read_bytes() == (outs[0] / name).read_bytes(), name


def test_parquet_output_has_one_schema_and_the_jsonl_rows(job, tmp_path):
    """--output-format parquet: every shard has one schema (source, line, the input's fields by
    name, the scores); the rows are the JSONL output's; a field whose types differ between
    records (an id that is a number here, a string there) is JSON text; a rerun is byte-identical."""
    base, *_ = job
    args = ["score", "--model", str(base / "run"), "-i", str(base / "in"), "--runner", "DirectRunner",
            "--num-shards", "3", "--output-format", "parquet"]
    for name in ("pq", "pq-again"):
        r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / name)])
        assert r.exit_code == 0, r.output  # the input's two bad records: under --max-bad-fraction
    shards = sorted((tmp_path / "pq").glob("scores-*-of-00003.parquet"))
    assert len(shards) == 3 and not list((tmp_path / "pq").glob("scores-*.jsonl"))
    schemas = {pq.read_schema(p).remove_metadata() for p in shards}
    assert len(schemas) == 1
    [schema] = schemas
    assert schema.names[:2] == ["source", "line"]
    assert schema.names[-5:] == ["score_chosen", "score_rejected", "margin", "agrees", "score"]
    assert schema.field("score").type == pa.float64() and schema.field("agrees").type == pa.bool_()
    rows = [{k: v for k, v in row.items() if v is not None} for p in shards for row in pq.read_table(p).to_pylist()]
    key = lambda r: (r["source"], r["line"])  # noqa: E731
    assert sorted(rows, key=key) == sorted(_rows(base / "out"), key=key)
    for p in shards:
        assert (tmp_path / "pq-again" / p.name).read_bytes() == p.read_bytes(), p.name
    summary = json.loads((tmp_path / "pq" / "summary.json").read_text())
    assert [s["file"] for s in summary["shards"]] == [p.name for p in shards]

    mixed = tmp_path / "mixed.jsonl"
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    mixed.write_text("".join(json.dumps({"id": i if i % 2 else f"x{i}", "messages": conv}) + "\n" for i in range(6)))
    r = CliRunner().invoke(app, [*args[:3], "-i", str(mixed), *args[5:], "-o", str(tmp_path / "mixed")])
    assert r.exit_code == 0, r.output
    tables = [pq.read_table(p) for p in sorted((tmp_path / "mixed").glob("scores-*.parquet"))]
    assert {t.schema.field("id").type for t in tables} == {pa.string()}
    assert json.loads(tables[0].schema.metadata[b"rmflow_json_columns"]) == ["id"]
    ids = sorted((json.loads(v) for t in tables for v in t.column("id").to_pylist()), key=str)
    assert ids == sorted([1, 3, 5, "x0", "x2", "x4"], key=str)


def test_the_scoring_template_entry_point_runs_locally_with_the_launchers_arguments(job, tmp_path):
    """The scoring Flex Template's entry point, given exactly the launcher's arguments, runs the
    job on the local runner into a dated folder: the same scores as `rmflow score --runner`."""
    from rmflow.pipelines.template import launch_body

    from rmflow.scoring.template import SCORE, main

    base, *_ = job
    params = {"model": str(base / "run"), "input": str(base / "in"), "output": str(tmp_path / "scores" / "{date}"),
              "num_shards": "3", "group_by": "prompt_id"}
    body = launch_body("gs://b/templates/rmflow-score.json", params, spec=SCORE)
    main([f"--{k}={v}" for k, v in body["launchParameter"]["parameters"].items()] + ["--runner=DirectRunner"])
    (dated,) = (tmp_path / "scores").iterdir()
    assert (dated / "COMPLETED").exists()
    for name in ["errors.jsonl", "best.jsonl", *(f"scores-0000{i}-of-00003.jsonl" for i in range(3))]:
        assert (dated / name).read_bytes() == (base / "out" / name).read_bytes(), name


K_LINES = [{"prompt": "Pick one.", "responses": ["A.", "B, because it is longer.", "C"], "scores": [1, 3, 2]},
           {"prompt": "Pick one.", "responses": ["Only this."]},  # K = 1: one conversation, as the server scores it
           {"prompt": "Pick one.", "answers": [{"answer": "A lone Nectar answer."}]},  # no rank: not needed to score
           {"instruction": "Pick one.", "completions": [{"response": "One completion."}]},  # nor ratings
           {"prompt": "Pick one.", "response": "A HelpSteer row.", "helpfulness": 3},  # its one conversation
           {"prompt": "Pick one.", "chosen": "A.", "rejected": "B."},  # a pair, in process too
           {"prompt": "Pick one.", "chosen": ["A RewardBench 2 answer."], "rejected": []}]  # K = 1 of that layout


def _alone(rm, replies):
    return rm.score([[{"role": "user", "content": "Pick one."}, {"role": "assistant", "content": r}] for r in replies])


def _check_k_lines(rm, fields):
    """The fields of K_LINES, each as the responses scored alone."""
    np.testing.assert_allclose(fields[0]["response_scores"], _alone(rm, K_LINES[0]["responses"]), atol=1e-5, rtol=0)
    assert fields[0]["best_response"] == int(np.argmax(_alone(rm, K_LINES[0]["responses"])))
    for f, reply in zip(fields[1:4], ("Only this.", "A lone Nectar answer.", "One completion.")):
        np.testing.assert_allclose(f["response_scores"], _alone(rm, [reply]), atol=1e-5, rtol=0)
        assert f["best_response"] == 0
    np.testing.assert_allclose(fields[4]["score"], _alone(rm, ["A HelpSteer row."])[0], atol=1e-5, rtol=0)
    c, r = _alone(rm, ["A.", "B."])
    np.testing.assert_allclose([fields[5]["score_chosen"], fields[5]["score_rejected"]], [c, r], atol=1e-5, rtol=0)
    np.testing.assert_allclose(fields[6]["response_scores"], _alone(rm, ["A RewardBench 2 answer."]), atol=1e-5,
                               rtol=0)


def test_every_record_is_scored_as_the_server_scores_it_and_none_takes_the_others_down(job, monkeypatch, tmp_path):
    """In process and in the Beam job's model handler alike (``scorers.score_encoded``): K
    responses with their prompt once, K = 1 as its one conversation, a row, a pair; a record whose
    scoring fails (a bug) gets an error and the others their scores."""
    from rmflow.trainer.inference import PackedScorer, SequenceScorer

    from rmflow.scoring.batch import JobSpec, RewardModelHandler
    from rmflow.scoring.scorers import score_file

    base, rm, convs, _, _ = job
    units = []
    real = SequenceScorer.run_units
    monkeypatch.setattr(SequenceScorer, "run_units", lambda self, us: units.append(len(us)) or real(self, us))
    spec = JobSpec(model=str(base / "run"), step=None, staging="", output="", num_shards=1, token_budget=1024,
                   batch_rows=8, group_by=None, started=0.0)
    batch = [("in", i, json.dumps(x)) for i, x in enumerate(K_LINES, 1)]
    results = RewardModelHandler(spec).run_inference([*batch, ("in", 9, json.dumps({"messages": convs[0]}))], rm)
    assert units == [1]  # the K = 3 line, its prompt once
    _check_k_lines(rm, [r.inference["fields"] for r in results][:-1])
    [ids] = RewardModelHandler(spec).run_inference([("in", 1, json.dumps({"chosen_ids": [1, 2], "rejected_ids": [1]}))],
                                                   rm)
    assert "give the pair as text" in ids.inference["error"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in K_LINES))
    assert score_file(str(base / "run"), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")) == \
        {"scored": len(K_LINES), "errors": 0}
    _check_k_lines(rm, [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()])

    real_run, real_items = SequenceScorer.run_outputs, PackedScorer.run_items  # a forward that fails on one
    poison = len(rm.encode(convs[1]))  # conversation's length (a bug, say): one item a row (the Beam job), packed

    def failing(self, seqs):
        if any(len(x) == poison for x in seqs):
            raise RuntimeError("boom")
        return real_run(self, seqs)

    def failing_items(self, items):
        if any(len(x) == poison for x in items):
            raise RuntimeError("boom")
        return real_items(self, items)

    monkeypatch.setattr(SequenceScorer, "run_outputs", failing)
    monkeypatch.setattr(PackedScorer, "run_items", failing_items)
    lines = [{"id": i, "messages": c} for i, c in enumerate(convs[:4])]
    (tmp_path / "in2.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert score_file(str(base / "run"), str(tmp_path / "in2.jsonl"), str(tmp_path / "out2.jsonl")) == \
        {"scored": 3, "errors": 1}
    rows = [json.loads(x) for x in (tmp_path / "out2.jsonl").read_text().splitlines()]
    assert "RuntimeError: boom" in rows[1]["error"] and rows[1]["line"] == 2 and rows[1]["id"] == 1
    np.testing.assert_allclose([rows[i]["score"] for i in (0, 2, 3)], [r[0] for r, _ in real_items(
        rm.scorer(), [rm.encode(convs[i]) for i in (0, 2, 3)])], atol=1e-5, rtol=0)
    results = RewardModelHandler(spec).run_inference([("in", i, json.dumps(x)) for i, x in enumerate(lines)], rm)
    assert [r.inference.get("code") for r in results] == [None, "internal_error", None, None]


def test_a_record_whose_keys_fit_two_layouts_is_an_error_line_in_every_scoring_path(job, tmp_path):
    """One rule for what a record is: K responses beside a pair (scored or not) fit two layouts,
    and preprocess refuses them as ambiguous; scoring (in process, the Beam job's handler, and
    the server through ``responses_of``) makes each an error line, never a score of either."""
    from rmflow.scoring.batch import JobSpec, RewardModelHandler
    from rmflow.scoring.errors import BadConversation
    from rmflow.scoring.scorers import responses_of, score_file

    base, rm, _, _, _ = job
    both = [{"prompt": "q", "responses": ["a", "b"], "chosen": "a", "rejected": "b"},
            {"prompt": "q", "responses": ["a", "b", "c"], "scores": [3, 1, 2], "chosen": "a", "rejected": "b"}]
    ok = {"prompt": "q", "responses": ["a", "b"]}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [*both, ok]))
    assert score_file(str(base / "run"), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")) == \
        {"scored": 1, "errors": 2}
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert all("fit several layouts" in r["error"] for r in rows[:2]) and len(rows[2]["response_scores"]) == 2
    spec = JobSpec(model=str(base / "run"), step=None, staging="", output="", num_shards=1, token_budget=1024,
                   batch_rows=8, group_by=None, started=0.0)
    results = RewardModelHandler(spec).run_inference([("in", i, json.dumps(x)) for i, x in enumerate(both)], rm)
    assert all("fit several layouts" in r.inference["error"] for r in results)
    for record in both:
        with pytest.raises(BadConversation, match="fit several layouts"):
            responses_of(record)


def test_deterministic_scores_are_the_api_s_bits_in_the_job_and_in_process(job, tmp_path):
    """`rmflow score --deterministic`, as a Beam job and in process: each conversation's and each
    pair side's score is ``RewardModel.score(..., deterministic=True)``'s to the last bit."""
    base, rm, convs, pairs, _ = job
    bits = lambda x: np.asarray(x, np.float32).view(np.int32)  # noqa: E731
    chosen = [_messages(p["chosen"], "chosen") for p in pairs]
    rejected = [_messages(p["rejected"], "rejected") for p in pairs]
    rc, rr = rm.score_pairs(chosen, rejected, deterministic=True)
    r = CliRunner().invoke(app, ["score", "--model", str(base / "run"), "-i", str(base / "in"), "-o",
                                 str(tmp_path / "job"), "--runner", "DirectRunner", "--deterministic"])
    assert r.exit_code == 0, r.output
    by_id = {row.get("id"): row for row in _rows(tmp_path / "job")}
    got = [by_id[f"c{i}"]["score"] for i in range(20) if f"c{i}" in by_id]
    np.testing.assert_array_equal(bits(got), bits(rm.score(convs, deterministic=True)))
    np.testing.assert_array_equal(bits([by_id[p["id"]]["score_chosen"] for p in pairs]), bits(rc))
    np.testing.assert_array_equal(bits([by_id[p["id"]]["score_rejected"] for p in pairs]), bits(rr))
    (tmp_path / "in.jsonl").write_text((base / "in" / "part-1.jsonl").read_text())
    r = CliRunner().invoke(app, ["score", "--model", str(base / "run"), "-i", str(tmp_path / "in.jsonl"), "-o",
                                 str(tmp_path / "out.jsonl"), "--deterministic", "--max-bad-fraction", "1"])
    assert r.exit_code == 0, r.output
    rows = {row.get("id"): row for row in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    np.testing.assert_array_equal(bits([rows[p["id"]]["score_chosen"] for p in pairs if p["id"] in rows]),
                                  bits([c for c, p in zip(rc, pairs) if p["id"] in rows]))

"""K rated or ranked responses per prompt (rendering.responses): each published layout read,
bad input refused with its reason, pairs made from it (--pairs-from), and the pairs of one
prompt kept in one split by `rmflow preprocess`."""

import dataclasses
import gzip
import json
import pathlib

import numpy as np
import pytest
from rmflow.rendering.formats import BadRecord, Tie, detect_format, normalize
from rmflow.rendering.responses import normalize_all, read_responses, to_pairs
from rmflow.schemas.config import ConfigError, PreprocessConfig

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "multi_response"

# One record of each layout, as published (the shared README spells them out).
LAYOUTS = {
    "responses": {"prompt": "Name a colour.", "responses": ["Blue.", "A colour.", "Seven."], "scores": [9, 5, 1],
                  "subset": "chat"},
    "rewardbench2": {"prompt": "2+2?", "chosen": ["4", "Four."], "rejected": ["5", "22", "3"]},
    "nectar": {"prompt": "\n\nHuman: Say hi.\n\nAssistant: ",
               "answers": [{"answer": "Hello!", "rank": 2, "model": "a"}, {"answer": "Hi there!", "rank": 1, "model": "b"},
                           {"answer": "Go away.", "rank": 3, "model": "c"}]},
    "ultrafeedback-raw": {"instruction": "Explain rain.", "completions": [
        {"response": "Water falls from clouds.", "fine-grained_score": 4.25, "overall_score": 7},
        {"response": "It is wet.", "annotations": {"helpfulness": {"Rating": "2"}, "honesty": {"Rating": "3"},
                                                   "truthfulness": {"Rating": "N/A"}}},
        {"response": "Clouds cry.", "annotations": {"helpfulness": {"Rating": "1"}}, "overall_score": 2}]},
}


def test_each_layout_is_detected_and_read_with_its_scores():
    for fmt, record in LAYOUTS.items():
        assert detect_format(record) == fmt, fmt
        r = read_responses(record, fmt, source="s", line=1)
        assert len(r.responses) == len(r.scores) >= 3 and r.prompt[-1][0] == "user", fmt
    nectar = read_responses(LAYOUTS["nectar"], "nectar", source="s", line=1)
    assert nectar.prompt == (("user", "Say hi."),) and nectar.scores == (-2.0, -1.0, -3.0)  # rank r scores -r
    uf = read_responses(LAYOUTS["ultrafeedback-raw"], "ultrafeedback-raw", source="s", line=1)
    assert uf.scores == (4.25, 2.5, 1.0)  # fine-grained_score, else the annotations' mean (N/A left out)
    rb = read_responses(LAYOUTS["rewardbench2"], "rewardbench2", source="s", line=1)
    assert rb.scores == (1.0, 1.0, 0.0, 0.0, 0.0)
    ranked = read_responses({"prompt": [{"role": "user", "content": "q"}], "responses": ["a", "b"], "ranks": [2, 1]},
                            "responses", source="s", line=1)
    assert ranked.scores == (-2.0, -1.0)
    # a pair layout's text reply is not mistaken for a list of responses
    assert detect_format({"prompt": "p", "chosen": "c", "rejected": "r"}) == "text"


@pytest.mark.parametrize("record, code", [
    ({"prompt": "p", "responses": ["a"], "scores": [1]}, "one_response"),  # unranked, no error
    ({"prompt": "p", "responses": ["a", "a", "b"], "scores": [1, 0, 0]}, "duplicate_response"),  # 'a' contradicts
    ({"prompt": "p", "responses": ["a", "a"], "scores": [1, 1]}, "one_response"),  # one distinct response
    ({"prompt": "p", "responses": ["a", "b"], "scores": [1, 1]}, "all_tied"),
    ({"prompt": "p", "responses": ["a", "b"], "scores": [1, "high"]}, "bad_value"),
    ({"prompt": "p", "responses": ["a", "b"], "scores": [1, None]}, "missing_score"),
    ({"prompt": "p", "responses": ["a", "b"], "scores": [1, float("nan")]}, "bad_value"),
    ({"prompt": "p", "responses": ["a", "b"], "scores": [1]}, "bad_value"),
    ({"prompt": "p", "responses": ["a", "b"], "ranks": [1, 0]}, "bad_value"),
    ({"prompt": "p", "responses": ["a", "b"], "ranks": [1, 2], "scores": [0, 1]}, "bad_value"),  # they disagree
    ({"prompt": "p", "responses": ["a", ""], "scores": [1, 0]}, "one_response"),  # the empty one left out
    ({"prompt": "", "responses": ["a", "b"], "scores": [1, 0]}, "empty_prompt"),
])
def test_bad_records_are_refused_with_their_reason(record, code):
    with pytest.raises(BadRecord) as e:
        normalize_all(record, detect_format(record), source="s", line=1, options={"pairs_from": "expand"})
    assert e.value.code == code
    assert isinstance(e.value, Tie) == (code == "all_tied")
    assert e.value.category == {"all_tied": "tie", "one_response": "unranked"}.get(code, "error")


def test_a_response_given_twice_with_one_score_is_kept_once_and_counted():
    pairs, responses = normalize_all({"prompt": "p", "responses": ["a", "a", "b", " ", "c", "c"],
                                      "scores": [1, 1, 0, 3, 2, 0]}, "responses", source="s", line=1,
                                     options={"pairs_from": "expand"})
    # the repeat kept once; the empty one, and both copies of the text scored two ways, left out
    assert (responses.merged, responses.dropped, responses.contradicted) == (1, 1, 2)
    assert [(p.chosen[0][1], p.rejected[0][1]) for p in pairs] == [("a", "b")]


def test_pairs_from_expand_best_worst_and_best_random():
    rb = read_responses(LAYOUTS["rewardbench2"], "rewardbench2", source="s", line=1)
    pairs = to_pairs(rb, "expand")
    assert len(pairs) == 2 * 3 and {p.chosen[0][1] for p in pairs} == {"4", "Four."}  # every chosen x rejected
    assert len({p.group for p in pairs}) == 1 and pairs[0].split_key == rb.group != pairs[0].pair_id
    scored = read_responses(LAYOUTS["responses"], "responses", source="s", line=1)
    expanded = to_pairs(scored, "expand", margin_from_scores=True)
    assert [(p.chosen[0][1], p.rejected[0][1], p.margin) for p in expanded] == \
        [("Blue.", "A colour.", 4.0), ("Blue.", "Seven.", 8.0), ("A colour.", "Seven.", 4.0)]
    assert [p.subset for p in expanded] == ["chat"] * 3 and expanded[0].score_gap == 4.0
    assert len(to_pairs(scored, "expand", min_score_gap=5)) == 1
    (bw,) = to_pairs(scored, "best-worst")
    assert (bw.chosen[0][1], bw.rejected[0][1], bw.margin) == ("Blue.", "Seven.", None)
    (br,) = to_pairs(scored, "best-random")
    assert br.chosen[0][1] == "Blue." and br == to_pairs(scored, "best-random")[0]  # deterministic
    with pytest.raises(BadRecord, match="min-score-gap"):
        to_pairs(scored, "best-worst", min_score_gap=100)


def test_a_multi_response_layout_is_kept_whole_unless_made_pairs_and_capped_at_max_responses():
    from rmflow.rendering.responses import CanonicalResponses, cap_responses

    [whole], responses = normalize_all(LAYOUTS["nectar"], "nectar", source="s", line=1)
    assert whole is responses and isinstance(whole, CanonicalResponses) and len(whole.responses) >= 3
    assert whole.split_key == to_pairs(whole, "expand")[0].split_key  # one split, as records or as pairs
    with pytest.raises(BadRecord, match="K responses"):  # the one-pair reader says what it is
        normalize(LAYOUTS["nectar"], "nectar", source="s", line=1)
    with pytest.raises(ConfigError, match="pairs_from 'all'"):
        PreprocessConfig(inputs=("x",), output="o", tokenizer="t", pairs_from="all")
    with pytest.raises(ConfigError, match="max_responses 1"):
        PreprocessConfig(inputs=("x",), output="o", tokenizer="t", max_responses=1)
    with pytest.raises(ConfigError, match="min_score_gap acts on pairs"):
        PreprocessConfig(inputs=("x",), output="o", tokenizer="t", format="nectar", min_score_gap=1.0)
    # what the shards hold depends on it: a workflow's preprocess hash covers it
    assert PreprocessConfig(inputs=("x",), output="o", tokenizer="t", max_responses=4).output_affecting()[
        "max_responses"] == 4
    ten = CanonicalResponses("s", 1, (("user", "q"),), tuple((("assistant", f"a{i}"),) for i in range(10)),
                             tuple(float(x) for x in (3, 9, 1, 7, 5, 0, 8, 2, 6, 4)))
    capped = cap_responses(ten, 4)  # the best (9), the worst (0) and two spread between, in their order
    assert capped.scores == (3.0, 9.0, 0.0, 6.0) and capped.capped == 6
    assert cap_responses(ten, 10) is ten
    [one], _ = normalize_all({"prompt": "q", "responses": [f"a{i}" for i in range(10)], "scores": list(ten.scores)},
                             "responses", source="s", line=1, options={"max_responses": 4})
    assert len(one.responses) == 10 and one.most == 4  # kept whole: capped among those that fit (below)
    import dataclasses

    import numpy as np
    from rmflow.rendering.length import TooLong
    from rmflow.rendering.tokenize import TokenizedResponses

    five = dataclasses.replace(ten, responses=ten.responses[:5], scores=(5.0, 4.0, 3.0, 2.0, 1.0), most=4)
    seqs = tuple(np.arange(3 + n, dtype=np.int32) for n in (2, 2, 2, 2, 30))  # prompt 3; the worst is long
    tr = TokenizedResponses(five, seqs, 3, 1)
    assert tr.fitting(16, "drop") == [0, 1, 2, 3]
    rec = tr.fit(16, "drop")  # the long worst is left out first, then 4 of 4 kept: none lost to the cap
    assert rec.k == 4 and rec.scores.tolist() == [5.0, 4.0, 3.0, 2.0] and rec.prompt_len == 3
    assert tr.fit(64, "drop").scores.tolist() == [5.0, 4.0, 2.0, 1.0]  # all fit: the spread of the ranking
    cut = tr.fit(32, "truncate-prompt")  # the long one fits with one prompt token cut (after the head)
    assert cut.prompt_len == 2 and cut.k == 4 and 1.0 in cut.scores.tolist()
    with pytest.raises(TooLong, match="0 of 5 responses"):
        tr.fit(4, "drop")
    pairs, made_of = normalize_all({"prompt": "q", "responses": [f"a{i}" for i in range(10)], "scores": list(ten.scores)},
                                   "responses", source="s", line=1, options={"max_responses": 4, "pairs_from": "expand"})
    assert made_of.capped == 6 and len(pairs) == 6  # expanded after the cap: 4 responses, 6 pairs
    [m], _ = normalize_all(LAYOUTS["nectar"], "nectar", source="s", line=1, options={"margin_from_scores": True})
    assert m.margin_from_scores  # kept whole: Bradley-Terry's margins from the scores, in the record


@pytest.mark.slow
def test_preprocess_expands_real_rm_bench_prompts_and_keeps_each_prompt_in_one_split(tmp_path, tokenizer_dir):
    """30 RM-Bench prompts (every 18th: several subsets; 3 chosen, 3 rejected each) from the shared data: 9 pairs a prompt
    (less what the length policy drops), every pair of a prompt in the same split."""
    import grain
    from rmflow.pipelines.preprocess import run
    from rmflow.schemas.config import EvalConfig
    from rmflow.schemas.record import decode
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.model_setup import read_manifest, shard_paths
    from rmflow.trainer.train import run as train

    from rmflow.eval.evaluation import run_eval

    N = 30
    rows = gzip.open(SHARED / "rmbench_dev.jsonl.gz", "rt").read().splitlines()[::18][:N]
    src = tmp_path / "rmbench.jsonl"
    src.write_text("\n".join(rows) + "\n")
    result = run(PreprocessConfig(inputs=(str(src),), output=str(tmp_path / "out"), tokenizer=tokenizer_dir,
                                  max_length=1024, eval_fraction=0.3, pairs_from="expand", num_shards=1))
    counts = result.stats["counts"]
    made, merged = counts["pairs_from_responses"], counts["responses_merged"]
    assert counts["records_read"] == N and counts["errors"] == 0 and merged > 0, counts  # RM-Bench repeats some
    # every record's pairs, its chosen x rejected (9, fewer where a response was given twice), written or too long
    assert counts["pairs_written"] + counts["dropped_too_long"] == N + made and N + made > N * 8, counts
    files = result.stats["per_file"]
    assert sum(f["read"] + f["made"] - f["written"] for f in files.values()) == counts["dropped_too_long"]
    assert counts["pairs_written_eval"] > 0 and counts["pairs_written_train"] > 0
    prompts = {}
    manifest = read_manifest(str(tmp_path / "out"))
    for split in ("train", "eval"):
        for path in shard_paths(str(tmp_path / "out"), manifest, split):
            for raw in grain.sources.ArrayRecordDataSource([path]):
                rec = decode(raw)
                prompts.setdefault(split, set()).add(tuple(rec.chosen_ids[:rec.prompt_len]))
    assert not prompts["train"] & prompts["eval"]  # no prompt in both splits
    assert N * 0.1 < len(prompts["eval"]) < N * 0.6
    # trained on those pairs, a model is evaluated on the raw file's every pair of responses (the
    # eval preprocesses raw files in-process with the same --pairs-from)
    train(TrainConfig(data=str(tmp_path / "out"), model="micro", output=str(tmp_path / "run"), max_steps=2,
                      batch_size=4))
    metrics = run_eval(EvalConfig(model=str(tmp_path / "run"), data=(str(src),), output=str(tmp_path / "eval"),
                                  pairs_from="expand"))
    # (every pair: a raw file is read at the model's own positions, which hold every pair of these)
    assert metrics["pairs"] == N + made and 0 <= metrics["accuracy"] <= 1
    # --mode responses: each prompt's responses scored and ranked against their labels, beside length alone
    ranked = run_eval(EvalConfig(model=str(tmp_path / "run"), data=(str(src),), output=str(tmp_path / "ranked"),
                                 mode="responses"))["ranking"]
    assert ranked["prompts"] == N and ranked["scored_pairs"] == counts["pairs_written"] + counts["dropped_too_long"]
    assert 0 <= ranked["pair_accuracy"] <= 1 and 0 <= ranked["best_of_k_accuracy"] <= 1
    assert len(ranked["subsets"]) > 1 and "length_baseline" in ranked
    assert "best-of-K accuracy" in (tmp_path / "ranked" / "report.md").read_text()
    # rmflow score: a record of K responses scored in one call, each response as its own conversation scores
    from rmflow.scoring.scorers import score_file

    record = json.loads(rows[0])
    alone = [[{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": r}]
             for r in record["responses"]]
    unscored = {"prompt": record["prompt"], "responses": record["responses"]}  # to score: no scores needed
    lines = [record, unscored, *alone, {"responses": 3}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    counts = score_file(str(tmp_path / "run"), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert counts == {"scored": 2 + len(alone), "errors": 1} and "error" in out[-1]
    assert out[0]["response_scores"] == pytest.approx([o["score"] for o in out[2:-1]], abs=1e-5)
    assert out[1]["response_scores"] == pytest.approx(out[0]["response_scores"], abs=1e-5)
    assert out[0]["best_response"] == max(range(len(alone)), key=lambda k: out[0]["response_scores"][k])


def _helpsteer_rows():
    rows = []
    for prompt, scored in (("Name a fruit.", [("Apple.", 4, 4), ("A fruit.", 1, 3), ("Carrot.", 0, 2)]),
                           ("Say hi.", [("Hi!", 3, 4), ("Bye.", 1, 4)]),
                           ("Alone?", [("Yes.", 2, 2)])):
        rows += [{"prompt": prompt, "response": text, "helpfulness": h, "correctness": c, "coherence": 4,
                  "complexity": 1, "verbosity": 1} for text, h, c in scored]
    rows.insert(3, {"prompt": "Say hi.", "response": "Hey.", "correctness": 4})  # no helpfulness: a bad row
    return rows


def test_response_rows_are_read_scored_by_weights_and_grouped():
    from rmflow.rendering.responses import group_rows, read_row

    rows = [read_row(r, source="h", line=i + 1, weights={"helpfulness": 0.5, "correctness": 1.0})
            for i, r in enumerate(_helpsteer_rows()) if "helpfulness" in r]
    assert detect_format(_helpsteer_rows()[0]) == "helpsteer" and rows[0].score == 6.0
    first = [r for r in rows if r.key == rows[0].key]
    record = group_rows(first[::-1])  # in file order whatever order the group comes in
    assert detect_format(record) == "responses" and record["scores"] == [6.0, 3.5, 2.0]
    assert [m[0]["content"] for m in record["responses"]] == ["Apple.", "A fruit.", "Carrot."]
    with pytest.raises(BadRecord, match="attribute 'helpfulness'"):
        read_row(_helpsteer_rows()[3], source="h", line=4, weights={"helpfulness": 1.0})
    with pytest.raises(ConfigError, match="attribute_weights"):
        PreprocessConfig(inputs=("x",), output="o", tokenizer="t", attribute_weights="helpfulness=high")


def test_preprocess_groups_a_prompt_s_rows_and_counts_every_row(tmp_path, tokenizer_dir):
    """HelpSteer-style rows: 7 read; the rows of each prompt made one record (4 grouped into
    another's); a bad row is an error; a prompt with one response is unranked, no error, and
    kept when its ratings are (a regression head fits them); every row accounted for."""
    import grain
    from rmflow.pipelines.preprocess import run
    from rmflow.schemas.record import decode
    from rmflow.trainer.model_setup import read_manifest, shard_paths

    src = tmp_path / "helpsteer.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _helpsteer_rows()))
    result = run(PreprocessConfig(inputs=(str(src),), output=str(tmp_path / "out"), tokenizer=tokenizer_dir,
                                  max_length=128, eval_fraction=0.0, pairs_from="expand", max_bad_fraction=1.0))
    c = result.stats["counts"]
    assert (c["records_read"], c["rows_grouped"], c["errors"], c["unranked"]) == (7, 3, 1, 1), c  # 'Alone?': K = 1
    assert c["pairs_written"] == 3 + 1 and c["pairs_from_responses"] == 2, c  # 3 pairs of the fruits, 1 hi/bye
    codes = {d["code"] for d in result.stats["dead_letters"]}
    assert codes == {"missing_score", "one_response"}, codes
    (f,) = result.stats["per_file"].values()
    assert f["read"] + f["made"] - f["grouped"] - f["written"] == c["errors"] + c["unranked"]
    rated = run(PreprocessConfig(inputs=(str(src),), output=str(tmp_path / "rated"), tokenizer=tokenizer_dir,
                                 max_length=128, eval_fraction=0.0, attributes="correctness,coherence",
                                 max_bad_fraction=1.0)).stats["counts"]
    assert (rated["pairs_written"], rated["unranked_kept"], rated["unranked"]) == (3, 1, 0), rated
    m = read_manifest(str(tmp_path / "rated"))
    kept = [decode(raw) for path in shard_paths(str(tmp_path / "rated"), m, "train")
            for raw in grain.sources.ArrayRecordDataSource([path])]
    assert sorted(r.k for r in kept) == [1, 2, 3] and m.scored_by_weights and m.layouts == ("helpsteer",)
    # without --pairs-from each prompt is one responses record: the fruits' 3 responses, hi/bye's 2
    whole = run(PreprocessConfig(inputs=(str(src),), output=str(tmp_path / "whole"), tokenizer=tokenizer_dir,
                                 max_length=128, eval_fraction=0.0, max_bad_fraction=1.0)).stats
    assert whole["kind"] == "multi-response" and whole["counts"]["pairs_written"] == 2, whole["counts"]
    assert whole["lengths"]["train"]["responses"]["max"] == 3 and whole["lengths"]["train"]["responses"]["count"] == 2
    from rmflow.pipelines.finalize import PreprocessError

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(PreprocessError, match=r"holds K responses per prompt \(layout helpsteer\) and .*pairs.jsonl "
                                              r"text records: one output holds one kind"):
        run(PreprocessConfig(inputs=(str(src), str(pairs)), output=str(tmp_path / "none"), tokenizer=tokenizer_dir))


def test_ranking_metrics_by_hand():
    import numpy as np

    from rmflow.eval.figures import kendall_tau_b, ranking_metrics, spearman

    # prompt 1: labels 3 > 2 > 1, rewards order two of its three pairs right; prompt 2: a reward tie at the top
    m = ranking_metrics([np.array([0.9, 0.1, 0.5]), np.array([1.0, 1.0, 0.0])],
                        [np.array([3.0, 2.0, 1.0]), np.array([1.0, 0.0, 0.0])])
    assert m["scored_pairs"] == 3 + 2
    assert m["pair_accuracy"] == pytest.approx((2 + 0 + 1) / 5)  # 1-2 right, 1-3 right, 2-3 wrong; tie, right
    assert m["ties"] == 1 and m["tie_rate"] == pytest.approx(1 / 5)  # a reward tie is not right (schemas.metrics)
    assert m["best_of_k_accuracy"] == pytest.approx((1 + 0.5) / 2)  # the top reward shared with a worse response
    assert kendall_tau_b(np.array([0.9, 0.1, 0.5]), np.array([3.0, 2.0, 1.0])) == pytest.approx(1 / 3)
    assert spearman(np.array([0.9, 0.1, 0.5]), np.array([3.0, 2.0, 1.0])) == pytest.approx(0.5)
    assert kendall_tau_b(np.array([1.0, 1.0]), np.array([1.0, 0.0])) is None  # a constant side: no tau


def test_what_a_break_it_pass_found_in_multi_response_data_stays_fixed(tmp_path):
    """Inputs easy to mishandle, each read as meant or refused with its reason."""
    scored = read_responses(LAYOUTS["responses"], "responses", source="/a/x.jsonl", line=1)
    moved = read_responses(LAYOUTS["responses"], "responses", source="gs://b/y.jsonl", line=9)
    # best-random picks by the record's content, not by where the file is
    assert to_pairs(scored, "best-random")[0].rejected == to_pairs(moved, "best-random")[0].rejected
    with pytest.raises(BadRecord, match="beyond 1000"):
        to_pairs(read_responses({"prompt": "p", "responses": ["a", "b"], "scores": [5000, 0]}, "responses",
                                source="s", line=1), "expand", margin_from_scores=True)
    for bad in ({"prompt": "p", "responses": ["a", "b"], "scores": ["1_0", 0]},
                {"prompt": "p", "responses": ["a", "b"], "scores": [10 ** 400, 0]},
                {"prompt": "p", "responses": ["a", "b"], "scores": [1e300, 0]}):
        with pytest.raises(BadRecord) as e:
            read_responses(bad, "responses", source="s", line=1)
        assert e.value.code == "bad_value"
    mixed = {"instruction": "q", "completions": [{"response": "a", "annotations": {"h": {"Rating": "4"}}},
                                                 {"response": "b", "overall_score": 7}]}
    with pytest.raises(BadRecord) as e:
        read_responses(mixed, "ultrafeedback-raw", source="s", line=1)
    assert e.value.code == "mixed_scores"
    # detection: the pair layouts read as before
    assert detect_format({"prompt": "p", "chosen": [{"role": "assistant", "content": "c"}],
                          "rejected": [{"role": "assistant", "content": "r"}]}) == "text"
    assert detect_format({"prompt": "p", "completions": ["s1"], "labels": [True], "instruction": "x"}) == "stepwise"


def test_bad_fraction_counts_in_the_unit_errors_count_in(tmp_path):
    """Errors after expansion count pairs: the fraction is over records read plus pairs made."""
    from rmflow.pipelines.finalize import PreprocessError, check_quality

    cfg = PreprocessConfig(inputs=("x",), output="o", tokenizer="t", pairs_from="expand", max_bad_fraction=0.6)
    stats = {"counts": {"records_read": 20, "pairs_from_responses": 20, "rows_grouped": 0, "errors": 21,
                        "pairs_written": 19},
             "dead_letters": [{"category": "error", "code": "template", "count": 21,
                               "example": {"source": "s", "line": 1, "reason": "r"}}]}
    check_quality(stats, cfg, str(tmp_path))  # 21 of 40, under 60%
    with pytest.raises(PreprocessError, match="21 of 40"):
        check_quality(stats, PreprocessConfig(inputs=("x",), output="o", tokenizer="t", pairs_from="expand",
                                              max_bad_fraction=0.5), str(tmp_path))


@pytest.mark.slow
def test_near_dedup_and_both_decontamination_methods_take_a_prompt_s_pairs(tmp_path, tokenizer_dir):
    """The pairs of one prompt are not each other's near-duplicates (nor did the chain of them end),
    and a reply's contamination drops only the pairs that hold that reply, whichever method."""
    from rmflow.pipelines.preprocess import run

    hit = "the quick brown fox jumps over the lazy dog near the old river bank today"
    records = [{"prompt": f"Question {i} about topic {i}?", "responses": [f"Answer {i} one.", f"Answer {i} two.",
                                                                          f"Answer {i} three."], "scores": [3, 2, 1]}
               for i in range(6)]
    records[0]["responses"][2] = hit
    src, evals = tmp_path / "multi.jsonl", tmp_path / "eval.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    evals.write_text(json.dumps({"prompt": hit, "chosen": "x", "rejected": "y"}) + "\n")
    base = dict(inputs=(str(src),), tokenizer=tokenizer_dir, max_length=128, eval_fraction=0.0, pairs_from="expand")
    near = run(PreprocessConfig(output=str(tmp_path / "near"), near_dedup="pair", **base)).stats["counts"]
    assert near["pairs_written"] == 6 * 3 and near["duplicates"] == 0, near
    written = {}
    for method in ("side-input", "join"):
        c = run(PreprocessConfig(output=str(tmp_path / method), decontaminate=(str(evals),),
                                 decontaminate_replies=True, decontaminate_method=method, **base)).stats["counts"]
        written[method] = (c["pairs_written"], c["contaminated"])
    assert written["side-input"] == written["join"] == (6 * 3 - 2, 2)  # the two pairs holding the reply


def test_attribute_ratings_are_read_beside_the_scores_or_the_record_is_a_counted_bad_record():
    """attributes (names, in order): a responses record's per-response objects (scoring it by the
    weights when it has no scores), UltraFeedback's aspects; a missing or "N/A" rating, a layout
    without ratings: BadRecord missing_attribute; the same text rated two ways contradicts."""
    from rmflow.rendering.responses import cap_responses

    names = ("helpfulness", "honesty")
    rated = {"prompt": "p", "responses": ["a", "b", "c"], "scores": [3, 1, 2],
             "attributes": [{"helpfulness": 4, "honesty": "5"}, {"helpfulness": 1, "honesty": 2},
                            {"helpfulness": 3, "honesty": 3, "other": 9}]}
    r = read_responses(rated, "responses", source="s", line=1, attributes=names)
    assert r.attribute_names == names and r.attributes == ((4.0, 5.0), (1.0, 2.0), (3.0, 3.0)) and r.scores == (3, 1, 2)
    assert read_responses(rated, "responses", source="s", line=1).pair_id != r.pair_id  # ratings are content
    capped = cap_responses(r, 2)  # the best and the worst, each with its ratings
    assert capped.scores == (3, 1) and capped.attributes == ((4.0, 5.0), (1.0, 2.0))
    unscored = {k: v for k, v in rated.items() if k != "scores"}  # scored by the weights of its ratings
    u = read_responses(unscored, "responses", source="s", line=1, attributes=names,
                       weights={"helpfulness": 0.5, "honesty": 1.0})
    assert u.scores == (7.0, 2.5, 4.5)
    for bad, code in (({**rated, "attributes": [{"helpfulness": 4}, {"helpfulness": 1, "honesty": 2},
                                                 {"helpfulness": 3, "honesty": 3}]}, "missing_attribute"),
                      ({**rated, "attributes": [{"helpfulness": "high", "honesty": 1}] * 3}, "bad_value"),
                      ({k: v for k, v in rated.items() if k != "attributes"}, "missing_attribute")):
        with pytest.raises(BadRecord) as e:
            read_responses(bad, "responses", source="s", line=1, attributes=names)
        assert e.value.code == code
    twice = {"prompt": "p", "responses": ["a", "a", "b", "c"], "scores": [3, 3, 1, 2],
             "attributes": [{"helpfulness": 4, "honesty": 5}, {"helpfulness": 1, "honesty": 5},
                            {"helpfulness": 1, "honesty": 2}, {"helpfulness": 3, "honesty": 3}]}
    t = read_responses(twice, "responses", source="s", line=1, attributes=names)
    assert t.contradicted == 2 and t.scores == (1, 2)  # "a" rated two ways: both copies left out
    with pytest.raises(BadRecord, match="no attribute ratings"):  # a completion scored without annotations
        read_responses(LAYOUTS["ultrafeedback-raw"], "ultrafeedback-raw", source="s", line=1, attributes=("helpfulness",))
    rated_uf = {"instruction": "x", "completions": [
        {"response": "one", "annotations": {"helpfulness": {"Rating": "4"}, "honesty": {"Rating": "2"}}},
        {"response": "two", "annotations": {"helpfulness": {"Rating": "2"}, "honesty": {"Rating": "N/A"}}}]}
    got = read_responses(rated_uf, "ultrafeedback-raw", source="s", line=1, attributes=("helpfulness",))
    assert got.attributes == ((4.0,), (2.0,)) and got.scores == (3.0, 2.0)  # the mean of the rated aspects
    with pytest.raises(BadRecord, match="no rating 'honesty'"):
        read_responses(rated_uf, "ultrafeedback-raw", source="s", line=1, attributes=names)
    for layout in ("rewardbench2", "nectar"):
        with pytest.raises(BadRecord, match="carries no attribute ratings"):
            read_responses(LAYOUTS[layout], layout, source="s", line=1, attributes=names)
    for bad in ({"attributes": "a,a"}, {"attributes": "a,,b"}, {"attributes": "a", "pairs_from": "expand"},
                {"attributes": "a", "format": "nectar"}):
        with pytest.raises(ConfigError, match="attributes"):
            PreprocessConfig(inputs=("x",), output="o", tokenizer="t", **bad)


def test_preprocess_keeps_each_response_s_attribute_ratings_in_its_record(tmp_path, tokenizer_dir):
    """HelpSteer rows with --attributes: each prompt's record holds its responses' ratings in the
    order asked, the manifest names them; a row without one is a counted bad record."""
    import grain
    from rmflow.pipelines.preprocess import run
    from rmflow.schemas.record import decode
    from rmflow.trainer.model_setup import read_manifest, shard_paths

    src = tmp_path / "helpsteer.jsonl"
    rows = _helpsteer_rows()
    del rows[0]["coherence"]  # the fruits' first row lacks a rating asked for: a bad row, the other two a record
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run(PreprocessConfig(inputs=(str(src),), output=str(tmp_path / "out"), tokenizer=tokenizer_dir,
                                  max_length=128, eval_fraction=0.0, max_bad_fraction=1.0,
                                  attributes="correctness,coherence"))
    codes = {d["code"] for d in result.stats["dead_letters"]}
    assert "missing_attribute" in codes, codes
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest.attributes == ("correctness", "coherence")
    records = [decode(raw) for path in shard_paths(str(tmp_path / "out"), manifest, "train")
               for raw in grain.sources.ArrayRecordDataSource([path])]
    by_k = {tuple(r.scores): r for r in records}  # scored by helpfulness (the default weights)
    assert set(by_k) == {(1.0, 0.0), (3.0, 1.0), (2.0,)}, by_k  # the fruits' other two rows; hi and bye; 'Alone?'
    np.testing.assert_array_equal(by_k[2.0, ].attributes, [[2.0, 4.0]])  # kept for its ratings: nothing to rank
    np.testing.assert_array_equal(by_k[1.0, 0.0].attributes, [[3.0, 4.0], [2.0, 4.0]])  # correctness, coherence
    np.testing.assert_array_equal(by_k[3.0, 1.0].attributes, [[4.0, 4.0], [4.0, 4.0]])


def test_only_a_prompt_with_its_responses_and_nothing_else_is_scored_as_k_responses():
    """A prompt with unscored responses is K responses to score; a conversation is one, whatever
    extra ``responses`` it carries; a preference pair that also carries ``responses`` fits two
    layouts and is refused, as preprocess refuses it (never scored as whichever one)."""
    from rmflow.scoring.scorers import BadConversation, responses_of

    assert len(responses_of({"prompt": "q", "responses": ["a", "b", "c"]})) == 3
    assert len(responses_of({"prompt": "q", "responses": ["a", "b"], "scores": [1, 0]})) == 2
    with pytest.raises(BadConversation, match="fit several layouts"):
        responses_of({"prompt": "q", "chosen": "a", "rejected": "b", "responses": ["x", "y"]})
    assert responses_of({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                         "prompt": "q", "responses": ["x", "y"]}) is None


def test_scores_are_compared_as_stored_and_a_figure_over_nothing_is_absent():
    """Scores one float32 holds are a tie (the record stores float32: it would train on nothing);
    a metric over no pair whose scores differ is absent, never 0."""
    from rmflow.trainer.loss import RANKING_SUM_KEYS, ranking_metrics_of_sums

    with pytest.raises(Tie, match="as stored"):
        read_responses({"prompt": "p", "responses": ["a", "b", "c"], "scores": [1.0, 1.00000001, 1.00000002]},
                       "responses", source="s", line=1)
    with pytest.raises(Tie):
        read_responses({"prompt": "p", "responses": ["a", "b"], "scores": [2 ** 25, 2 ** 25 + 1]},
                       "responses", source="s", line=1)
    none = ranking_metrics_of_sums({**dict.fromkeys(RANKING_SUM_KEYS, 0.0), "prompts": 4.0, "responses": 12.0})
    assert "accuracy" not in none and "kendall_tau" not in none and "best_of_k_accuracy" not in none
    assert none["pairs"] == 0 and none["prompts"] == 4


@pytest.mark.parametrize("mode, options, words", [
    ("responses", {"pairs_from": "expand"}, "--pairs-from: --mode responses ranks"),
    ("responses", {"margin_from_scores": True}, "--margin-from-scores: --mode responses"),
    ("rewardbench-v2", {"attribute_weights": "helpfulness=1"}, "--attribute-weights: --mode rewardbench-v2"),
    ("rewardbench-v2", {"format": "nectar"}, "--format: --mode rewardbench-v2")])
def test_eval_options_that_cannot_act_in_a_mode_are_refused(mode, options, words):
    from rmflow.schemas.config import EvalConfig
    from rmflow.schemas.options import ConfigError

    with pytest.raises(ConfigError, match=words):
        EvalConfig(model="m", data=("d",), output="o", mode=mode, **options)


@pytest.mark.parametrize("option, layout", [
    ({"attributes": "helpfulness"}, "text"),  # pairs carry no ratings
    ({"attribute_weights": "helpfulness=2"}, "text"),
    ({"attribute_weights": "helpfulness=2"}, "nectar"),  # ranks, never ratings
    ({"drop_score_ties": True}, "responses"),  # equal scores never make a pair
    ({"drop_score_ties": True, "pairs_from": "expand"}, "responses"),
    ({"margin_from_scores": True}, "text")])
def test_a_preprocess_option_that_would_do_nothing_on_the_inputs_is_refused(option, layout, tmp_path):
    from rmflow.pipelines.preprocess import PreprocessError, check_score_options

    record = {"text": {"prompt": "p", "chosen": "a", "rejected": "b"}, **LAYOUTS}[layout]
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n")
    cfg = PreprocessConfig(inputs=(str(tmp_path / "in.jsonl"),), output="o", tokenizer="t", **option)
    with pytest.raises(PreprocessError, match="it would do nothing"):
        check_score_options(cfg, [str(tmp_path / "in.jsonl")])
    acting = {"attributes": "helpsteer", "attribute_weights": "helpsteer", "drop_score_ties": "ultrafeedback",
              "margin_from_scores": "responses"}[next(iter(option))]
    conversation = [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}]
    examples = {**LAYOUTS, "helpsteer": _helpsteer_rows()[0],
                "ultrafeedback": {"prompt": "p", "chosen": conversation, "rejected": [conversation[0], conversation[0]],
                                  "score_chosen": 2, "score_rejected": 1}}
    (tmp_path / "ok.jsonl").write_text(json.dumps(examples[acting]) + "\n")
    check_score_options(dataclasses.replace(cfg, pairs_from=""), [str(tmp_path / "ok.jsonl")])


def test_preprocess_bounds_every_text_by_characters_before_tokenizing(tmp_path, tokenizer_dir, monkeypatch):
    """A text whose characters alone are more than max_length tokens ever hold is never tokenized:
    under drop its record is too long, under truncate-prompt a reply that long is, and a response
    that long is left out of its record (counted) as one too long in tokens is."""
    from rmflow.pipelines.preprocess import run
    from rmflow.rendering.tokenize import RecordTokenizer

    huge = "word " * 400_000  # 2 MB: about a minute for the tokenizer
    lines = [{"prompt": huge, "chosen": "a", "rejected": "b"},
             {"prompt": "p", "chosen": huge, "rejected": "b"},
             {"prompt": "q", "chosen": "fine", "rejected": "also fine"}]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "k.jsonl").write_text(json.dumps({"prompt": "r", "responses": ["a", huge, "b"], "scores": [1, 3, 2]})
                                      + "\n" + json.dumps({"prompt": "s", "responses": ["c", "d"], "scores": [1, 2]})
                                      + "\n")
    tokenized_huge = []  # the texts of 2 MB or more the tokenizer was given
    real = RecordTokenizer._encode
    monkeypatch.setattr(RecordTokenizer, "_encode", lambda self, texts: tokenized_huge.extend(
        t for t in texts if len(t) >= len(huge)) or real(self, texts))
    for policy, code, tokenized in (("drop", "too_long", 0), ("truncate-prompt", "replies_too_long", 2)):
        tokenized_huge.clear()
        stats = run(PreprocessConfig(inputs=(str(tmp_path / "pairs.jsonl"),), output=str(tmp_path / policy),
                                     tokenizer=tokenizer_dir, max_length=128, eval_fraction=0.0, max_bad_fraction=1.0,
                                     length_policy=policy, num_workers=1)).stats
        assert stats["counts"]["dropped_too_long"] == (2 if policy == "drop" else 1), stats["counts"]
        assert code in {d["code"] for d in stats["dead_letters"]}
        assert len(tokenized_huge) == tokenized  # truncate-prompt cuts a long prompt's tokens: it tokenizes it
    tokenized_huge.clear()
    k = run(PreprocessConfig(inputs=(str(tmp_path / "k.jsonl"),), output=str(tmp_path / "k"), tokenizer=tokenizer_dir,
                             max_length=128, eval_fraction=0.0, num_workers=1)).stats["counts"]
    assert (k["pairs_written"], k["responses_too_long"], len(tokenized_huge)) == (2, 1, 0), k

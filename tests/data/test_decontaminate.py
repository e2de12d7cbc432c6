"""Decontamination: a training record sharing an n-gram with an evaluation prompt is dropped, named
in the errors file with the evaluation file, its item and the n-gram, and counted per evaluation
file; near misses are kept; case, Unicode form, punctuation and whitespace do not hide an overlap."""

import dataclasses
import gzip
import json
import pathlib

import pytest
from rmflow.pipelines.decontaminate import EvalIndex, index_file, ngrams, prompt_text, words
from rmflow.pipelines.preprocess import PreprocessError, run
from rmflow.rendering.formats import BadRecord
from rmflow.schemas.config import ConfigError, PreprocessConfig

from tests.conftest import SHARED_DATA

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"
TOKENIZER = str(DEMO / "tokenizer")
LONG = ("the quick brown fox jumps over the lazy dog while seven wizards quietly judge "
        "boxing matches near an old stone bridge")


def test_words_ignore_case_unicode_form_punctuation_and_whitespace():
    assert words("The  QUICK\u00a0brown—fox,\tjumps!") == ["the", "quick", "brown", "fox", "jumps"]
    assert words("ｆｕｌｌ－ｗｉｄｔｈ Ｔｅｘｔ") == ["full", "width", "text"]  # NFKC
    assert words("Straße café naïve 東京 2024") == ["strasse", "café", "naïve", "東京", "2024"]
    assert words("snake_case") == ["snake", "case"]


def test_the_index_finds_an_overlap_and_only_a_real_one():
    index = EvalIndex(13)
    index.add(LONG, "eval.jsonl", 7)
    ws = LONG.split()
    hit = index.first_overlap([f"Prefix words here. {' '.join(ws[3:16]).upper()} and more"])
    assert hit == (tuple(ws[3:16]), "eval.jsonl", 7)
    assert index.first_overlap([" ".join(ws[3:15])]) is None  # 12 words: a near miss
    changed = ws[3:16]
    changed[6] = "cat"
    assert index.first_overlap([" ".join(changed)]) is None  # 13 words, one differs
    short = EvalIndex(13)
    short.add("What is 2 + 2?", "e", 1)  # shorter than n: the whole prompt is one n-gram
    assert short.first_overlap(["what is 2 2"]) is not None and short.first_overlap(["what is 2 3"]) is None
    assert list(ngrams([], 13)) == []


def test_prompts_are_read_from_every_layout_and_from_prompt_lists(tmp_path):
    assert prompt_text({"prompt": "p1", "chosen": "a", "rejected": "b"}, "f", 1) == "p1"
    assert prompt_text({"chosen": "\n\nHuman: hi there\n\nAssistant: a", "rejected": "\n\nHuman: hi there\n\n"
                        "Assistant: b"}, "f", 1) == "hi there"
    assert prompt_text({"problem": "solve x"}, "f", 1) == "solve x"
    pb = {"id": "gsm8k-0", "problem": "Sue has 18 flamingos.", "steps": ["a", "b"], "label": -1,
          "final_answer_correct": True}
    assert prompt_text(pb, "f", 1) == "Sue has 18 flamingos."  # ProcessBench
    stepwise = {"prompt": "Three pencils cost $1.24.", "completions": ["p = 1", "so 2"], "labels": [True, False]}
    assert prompt_text(stepwise, "f", 1) == "Three pencils cost $1.24."
    with pytest.raises(BadRecord, match="f:3: no prompt found"):
        prompt_text({"nothing": 1}, "f", 3)
    assert prompt_text("a bare prompt", "f", 1) == "a bare prompt"
    (tmp_path / "prompts.txt").write_text(f"{LONG}\nanother prompt\n")
    (tmp_path / "prompts.jsonl").write_text(json.dumps(LONG) + "\n")
    for name in ("prompts.txt", "prompts.jsonl"):
        assert index_file(str(tmp_path / name), 13).first_overlap([LONG]) == (tuple(LONG.split()[:13]),
                                                                             str(tmp_path / name), 1)


def _demo_records(n: int) -> list[dict]:
    lines = gzip.decompress((DEMO / "hh_rlhf_helpful_sample.jsonl.gz").read_bytes()).decode().splitlines()
    return [json.loads(x) for x in lines[:n]]


def _hh_prompt(record: dict) -> str:
    return record["chosen"].split("\n\nHuman: ", 1)[1].split("\n\nAssistant:", 1)[0]


def test_preprocess_drops_planted_contamination_and_counts_it_per_eval_file(tmp_path):
    records = _demo_records(200)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = [_hh_prompt(r) for r in records]
    long_ones = [i for i, p in enumerate(prompts) if len(words(p)) >= 20][:4]
    assert len(long_ones) == 4
    a, b, c, d = long_ones
    # eval file 1 (RewardBench-style): one prompt verbatim, one with case, whitespace and full-width changes
    twisted = "  ".join(prompts[b].upper().split()).replace("A", "Ａ")
    (tmp_path / "rb.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [
        {"prompt": "Unrelated question about the weather in spring?", "chosen": "x", "rejected": "y"},
        {"prompt": prompts[a], "chosen": "x", "rejected": "y"},
        {"prompt": f"Context first. {twisted}", "chosen": "x", "rejected": "y"},
    ]))
    # eval file 2 (a prompt list): 13 words of one prompt inside other text; 12 words of another (a near miss)
    wc, wd = words(prompts[c]), words(prompts[d])
    (tmp_path / "list.txt").write_text(f"zzz {' '.join(wc[2:15])} yyy\nqqq {' '.join(wd[0:12])} qqq\n")
    cfg = PreprocessConfig(inputs=(str(train),), output=str(tmp_path / "out"), tokenizer=TOKENIZER,
                           decontaminate=(str(tmp_path / "rb.jsonl"), str(tmp_path / "list.txt")))
    stats = run(cfg).stats
    counts = stats["counts"]
    dropped = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()
               if json.loads(x)["category"] == "contaminated"]
    # every training record with the same prompt is dropped (HH has prompts that repeat)
    expected = {i + 1 for i, p in enumerate(prompts) if p in (prompts[a], prompts[b], prompts[c])}
    assert {d["line"] for d in dropped} == expected
    assert counts["contaminated"] == len(expected)
    assert counts["records_read"] == counts["pairs_written"] + sum(
        counts[k] for k in ("dropped_too_long", "ties", "duplicates", "contaminated", "errors"))
    assert stats["decontaminated_against"][str(tmp_path / "list.txt")] == {"items": 2, "ngrams": 3 + 2}  # 15 and 14 words
    assert stats["decontaminated_against"][str(tmp_path / "rb.jsonl")]["items"] == 3
    by_file = stats["contaminated_by_eval_file"]
    assert sum(by_file.values()) == len(expected) and set(by_file) == {str(tmp_path / "rb.jsonl"),
                                                                        str(tmp_path / "list.txt")}
    first_c = min(i for i in expected if prompts[i - 1] == prompts[c])
    said = next(d for d in dropped if d["line"] == first_c)
    assert said["reason"] == f"shares the 13-gram {' '.join(wc[2:15])!r} with {tmp_path / 'list.txt'}:1"
    assert said["stage"] == "decontaminate" and json.loads(said["record"]) == records[first_c - 1]

    # The join (for evaluation sets no worker could hold) finds the same records, with the same reasons
    joined = run(dataclasses.replace(cfg, output=str(tmp_path / "joined"), decontaminate_method="join")).stats
    assert joined["counts"] == counts and joined["contaminated_by_eval_file"] == by_file
    errors = [(tmp_path / o / "errors.jsonl").read_text().splitlines() for o in ("out", "joined")]
    assert sorted(errors[0]) == sorted(errors[1])
    for shard in (tmp_path / "out").glob("*.array_record"):
        assert shard.read_bytes() == (tmp_path / "joined" / shard.name).read_bytes()


def test_the_join_is_chosen_for_large_evaluation_sets():
    from rmflow.pipelines.decontaminate import JOIN_ABOVE_BYTES, use_join

    small, large = [("a.jsonl", 2**20)], [("a.jsonl.gz", JOIN_ABOVE_BYTES // 4 + 1)]  # gzip counted four-fold
    assert not use_join("auto", small) and use_join("auto", large)
    assert use_join("join", small) and not use_join("side-input", large)
    with pytest.raises(ValueError, match="use one of auto, side-input, join"):
        use_join("map", small)


def test_replies_are_checked_only_when_asked(tmp_path):
    records = _demo_records(40)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    reply = records[5]["chosen"].rsplit("\n\nAssistant: ", 1)[1]  # the last turn: the reply
    assert len(words(reply)) >= 13
    (tmp_path / "eval.txt").write_text(" ".join(words(reply)[:13]) + "\n")
    base = dict(inputs=(str(train),), tokenizer=TOKENIZER, decontaminate=(str(tmp_path / "eval.txt"),))
    assert run(PreprocessConfig(**base, output=str(tmp_path / "a"))).stats["counts"]["contaminated"] == 0
    c = run(PreprocessConfig(**base, output=str(tmp_path / "b"), decontaminate_replies=True)).stats["counts"]
    assert c["contaminated"] >= 1


def test_decontaminate_against_llmbar_on_real_data(tmp_path):
    """LLMBar (RewardBench v1 layout) as the evaluation set, UltraFeedback plus a planted LLMBar item
    as training data: the planted item, and only items that really overlap, are dropped."""
    llmbar = SHARED_DATA / "llmbar_rewardbench_v1.jsonl.gz"
    uf = SHARED_DATA / "ultrafeedback_binarized_sample1000.jsonl.gz"
    if not llmbar.exists() or not uf.exists():
        pytest.skip("../shared data is not here")
    item = json.loads(gzip.decompress(llmbar.read_bytes()).decode().splitlines()[10])
    planted = tmp_path / "planted.jsonl"
    planted.write_text(json.dumps({"prompt": item["prompt"], "chosen": "a", "rejected": "b"}) + "\n")
    cfg = PreprocessConfig(inputs=(str(uf), str(planted)), output=str(tmp_path / "out"), tokenizer=TOKENIZER,
                           decontaminate=(str(llmbar),), max_length=4096)
    stats = run(cfg).stats
    dropped = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    dropped = [d for d in dropped if d["category"] == "contaminated"]
    assert any(d["source"] == str(planted) for d in dropped)
    index = index_file(str(llmbar), 13)
    for d in dropped:  # each is a real overlap, recomputed here from the record itself
        record = json.loads(d["record"])
        text = record["prompt"] if isinstance(record["prompt"], str) else record["prompt"][0]["content"]
        assert index.first_overlap([text]) is not None
    assert stats["counts"]["contaminated"] == len(dropped)


def test_bad_decontaminate_options_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="decontaminate_ngram"):
        PreprocessConfig(inputs=("x",), output="o", tokenizer="t", decontaminate=("e",), decontaminate_ngram=0)
    train = tmp_path / "t.jsonl"
    train.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(PreprocessError, match="^--decontaminate: input .*missing.* matches no data files"):
        run(PreprocessConfig(inputs=(str(train),), output=str(tmp_path / "o"), tokenizer=TOKENIZER,
                             decontaminate=(str(tmp_path / "missing*.jsonl"),)))
    # an evaluation file with no items, or a malformed one: refused before the job, naming file and line
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "fine"}) + "\n{broken\n")
    for name, words_ in (("empty.jsonl", "holds no evaluation items"), ("bad.jsonl", "bad.jsonl:2: malformed JSON")):
        with pytest.raises(PreprocessError, match=words_):
            run(PreprocessConfig(inputs=(str(train),), output=str(tmp_path / "o"), tokenizer=TOKENIZER,
                                 decontaminate=(str(tmp_path / name),)))
    assert not (tmp_path / "o").exists()
    # options that do nothing without the one they modify are refused, not ignored
    for option in (dict(near_dedup_threshold=0.9), dict(decontaminate_ngram=8), dict(decontaminate_replies=True)):
        with pytest.raises(ConfigError, match=f"{next(iter(option))}: does nothing without"):
            PreprocessConfig(inputs=("x",), output="o", tokenizer="t", **option)
    for option in (dict(drop_score_ties=True), dict(min_score_gap=1.0)):  # HH-RLHF-style data has no scores
        with pytest.raises(PreprocessError, match=r"acts on (layouts with scores|pairs that carry scores).* and the "
                                                  r"inputs are text: it would do nothing"):
            run(PreprocessConfig(inputs=(str(train),), output=str(tmp_path / "o"), tokenizer=TOKENIZER, **option))


def test_a_solution_is_checked_by_its_problem_and_with_replies_by_its_steps():
    from rmflow.pipelines.decontaminate import record_texts
    from rmflow.rendering.formats import CanonicalSteps

    sol = CanonicalSteps("s", 1, (("system", "be brief"), ("user", "the problem")), ("step one", "step two"),
                         (True, False))
    assert record_texts(sol, replies=False) == ["the problem"]
    assert record_texts(sol, replies=True) == ["the problem", "step one\nstep two"]


def test_mark_only_keeps_the_records_and_lists_them(tmp_path):
    records = _demo_records(60)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    k = next(i for i, r in enumerate(records) if len(words(_hh_prompt(r))) >= 13 and "\n" not in _hh_prompt(r))
    (tmp_path / "eval.txt").write_text(_hh_prompt(records[k]) + "\n")
    base = dict(inputs=(str(train),), tokenizer=TOKENIZER, decontaminate=(str(tmp_path / "eval.txt"),))
    dropped = run(PreprocessConfig(**base, output=str(tmp_path / "a"))).stats["counts"]
    kept = run(PreprocessConfig(**base, output=str(tmp_path / "b"), decontaminate_mark_only=True)).stats
    n = dropped["contaminated"]
    assert n >= 1 and kept["counts"]["contaminated"] == 0 and kept["counts"]["contaminated_marked"] == n
    assert kept["counts"]["pairs_written"] == dropped["pairs_written"] + n
    listed = [json.loads(x) for x in (tmp_path / "b" / "contamination.jsonl").read_text().splitlines()]
    assert len(listed) == n and all(d["category"] == "contaminated" for d in listed)
    assert k + 1 in {d["line"] for d in listed}
    assert kept["contaminated_by_eval_file"] == {str(tmp_path / "eval.txt"): n}
    assert not (tmp_path / "a" / "contamination.jsonl").exists()

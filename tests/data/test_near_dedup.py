"""Near-duplicate prompts and pairs (--near-dedup): MinHash similarity tracks Jaccard, planted
near-duplicates are dropped naming the kept record (chains followed), distinct records stay,
counts reconcile and reruns are identical."""

import json

import numpy as np
import pytest
from rmflow.pipelines.decontaminate import words
from rmflow.pipelines.near_dedup import SHINGLE, signature, similarity
from rmflow.pipelines.preprocess import run
from rmflow.schemas.config import ConfigError, PreprocessConfig

from tests.conftest import TOKENIZER_DIR

TEXT = ("the quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence and "
        "wonders whether the rain will come before the harvest is finished this year in the valley")


def shingles(text):
    ws = words(text)
    return {" ".join(ws[i:i + SHINGLE]) for i in range(len(ws) - SHINGLE + 1)}


def test_signatures_estimate_jaccard_similarity():
    ws = TEXT.split()
    for changed in (1, 3, 8):
        other = " ".join(w if i % (len(ws) // changed) else "zebra" for i, w in enumerate(ws))
        a, b = shingles(TEXT), shingles(other)
        jaccard = len(a & b) / len(a | b)
        assert similarity(signature(TEXT), signature(other)) == pytest.approx(jaccard, abs=0.12)
    assert similarity(signature(TEXT), signature(TEXT.upper().replace(" ", "  "))) == 1.0  # normalised words
    assert signature("...") is None
    assert np.array_equal(signature(TEXT), signature(TEXT))  # fixed permutations: comparable across workers


def pair(prompt, i):
    return {"prompt": prompt, "chosen": f"answer {i} is good", "rejected": f"answer {i} is bad"}


def test_near_duplicate_prompts_are_dropped_naming_the_kept_record(tmp_path):
    a = TEXT
    a_near = TEXT.replace("quick", "fast")  # one word: shingles mostly shared
    a_near2 = a_near.replace("harvest", "crop")  # near a_near; less near a
    b = "how do I bake sourdough bread at home with a starter that my neighbour gave me last spring " * 2
    records = [pair(a, 0), pair(b, 1), pair(a_near, 2), pair("an unrelated question about tax law " * 3, 3),
               pair(a_near2, 4), pair(a, 5)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = PreprocessConfig(inputs=(str(data),), output=str(tmp_path / "out"), tokenizer=str(TOKENIZER_DIR),
                           near_dedup="prompt", near_dedup_threshold=0.7, eval_fraction=0.0)
    stats = run(cfg).stats
    errors = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    near = {e["line"]: e for e in errors if e["code"] == "near_duplicate"}
    assert set(near) == {3, 5, 6}  # lines 1 (a), 2 (b) and 4 (unrelated) are kept
    for e in near.values():  # every one names the record kept, line 1, chains included
        assert e["category"] == "duplicate" and e["reason"].endswith(f"of {data}:1, which is kept")
    c = stats["counts"]
    assert c["duplicates"] == 3 and c["pairs_written"] == 3
    assert c["records_read"] == c["pairs_written"] + sum(c[k] for k in ("dropped_too_long", "ties", "weak_labels",
                                                                        "duplicates", "contaminated", "errors"))
    again = run(PreprocessConfig(**{**cfg.to_dict(), "output": str(tmp_path / "again")})).stats
    assert again["counts"] == c
    for shard in (tmp_path / "out").glob("*.array_record"):
        assert shard.read_bytes() == (tmp_path / "again" / shard.name).read_bytes()
    # pair mode: same prompts with different replies are not duplicates as pairs
    pairs = run(PreprocessConfig(**{**cfg.to_dict(), "output": str(tmp_path / "pairs"), "near_dedup": "pair",
                                    "near_dedup_threshold": 0.95})).stats
    assert pairs["counts"]["duplicates"] == 0
    with pytest.raises(ConfigError, match="near_dedup 'yes'"):
        PreprocessConfig(inputs=("x",), output="o", tokenizer="t", near_dedup="yes")


def test_a_chain_of_near_duplicates_names_the_record_kept():
    from rmflow.pipelines.near_dedup import _DropFn
    from rmflow.rendering.formats import CanonicalPair

    near = {("f", 3): (("f", 2), 0.9), ("f", 2): (("f", 1), 0.85)}  # 3 near 2, 2 near 1, 1 kept
    out = list(_DropFn("prompt").process((("f", 3), CanonicalPair("f", 3)), near))
    assert out[0].value["reason"].endswith("0.90 of 5-word shingles) of f:1, which is kept")
    kept = CanonicalPair("f", 1)
    assert list(_DropFn("prompt").process((("f", 1), kept), near)) == [kept]

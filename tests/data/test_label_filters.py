"""Weak labels and ties in layouts that carry scores (--min-score-gap, --drop-score-ties), and the
per-input-file statistics (read, written, not written by reason, chosen-longer fraction)."""

import json

import pytest
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.rendering.formats import Tie, WeakLabel, normalize
from rmflow.schemas.config import ConfigError, PreprocessConfig


def uf(i, sc, sr, chosen="yes", rejected="no"):
    return {"prompt": f"question {i}?", "score_chosen": sc, "score_rejected": sr,
            "chosen": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": chosen}],
            "rejected": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": rejected}]}


def test_the_score_gap_decides_weak_labels_and_ties():
    kw = dict(source="f", line=1)
    assert normalize(uf(0, 8.0, 6.5), "ultrafeedback", **kw).score_gap == 1.5
    assert normalize(uf(0, 7.0, 7.0), "ultrafeedback", **kw).score_gap == 0.0  # kept by default
    with pytest.raises(Tie, match="--drop-score-ties") as e:
        normalize(uf(0, 7.0, 7.0), "ultrafeedback", drop_score_ties=True, **kw)
    assert e.value.code == "score_tie"
    with pytest.raises(Tie, match="--min-score-gap"):  # a zero gap is a tie, whichever option drops it
        normalize(uf(0, 7.0, 7.0), "ultrafeedback", min_score_gap=0.5, **kw)
    with pytest.raises(WeakLabel, match=r"8 - score_rejected 7.75 = 0.25 is under --min-score-gap 0.5"):
        normalize(uf(0, 8.0, 7.75), "ultrafeedback", min_score_gap=0.5, **kw)
    assert normalize(uf(0, 8.0, 7.5), "ultrafeedback", min_score_gap=0.5, **kw).score_gap == 0.5  # at the gap: kept
    with pytest.raises(ConfigError, match="min_score_gap -1"):
        PreprocessConfig(inputs=("x",), output="o", tokenizer="t", min_score_gap=-1)


@pytest.mark.parametrize("drop_ties", [False, True])
def test_filters_count_per_file_and_reconcile(tmp_path, tokenizer_dir, drop_ties):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with open(a, "w") as f:  # 6 pairs: 2 score ties, 1 weak (gap 0.25), 1 text tie, 2 good; chosen longer in 2
        for rec in (uf(0, 8, 7, chosen="a much longer and better answer"), uf(1, 7, 7), uf(2, 6, 6),
                    uf(3, 8, 7.75), uf(4, 9, 5, chosen="same", rejected="same"),
                    uf(5, 9, 2, chosen="a long detailed careful answer here")):
            f.write(json.dumps(rec) + "\n")
    with open(b, "w") as f:  # 3 pairs: 1 good (rejected longer), 1 not JSON, 1 score tie
        f.write(json.dumps(uf(6, 5, 1, chosen="ok", rejected="a rejected reply that is far longer")) + "\n")
        f.write("{not json\n")
        f.write(json.dumps(uf(7, 3, 3)) + "\n")
    out = tmp_path / "out"
    stats = preprocess(PreprocessConfig(inputs=(str(a), str(b)), output=str(out), tokenizer=tokenizer_dir,
                                        max_length=64, min_score_gap=0.5 if drop_ties else 0.0,
                                        drop_score_ties=drop_ties, max_bad_fraction=1.0)).stats
    c = stats["counts"]
    assert c["weak_labels"] == (1 if drop_ties else 0)
    assert c["ties"] == (4 if drop_ties else 1)  # the text tie always; the score ties when asked
    assert c["score_ties_kept"] == (0 if drop_ties else 3)
    files = stats["per_file"]
    for f in files.values():  # each file reconciles on its own
        assert f["read"] == f["written"] + sum(f[k] for k in ("dropped_too_long", "ties", "weak_labels",
                                                             "duplicates", "contaminated", "errors"))
    fa, fb = files[str(a)], files[str(b)]
    assert (fa["read"], fa["written"], fb["read"], fb["written"]) == (6, 2 if drop_ties else 5, 3, 1 if drop_ties else 2)
    assert fb["errors"] == 1
    if drop_ties:  # the two good pairs of a both have the longer chosen reply; b's one good pair does not
        assert (fa["chosen_longer_fraction"], fb["chosen_longer_fraction"]) == (1.0, 0.0)
    codes = {(e["category"], e["code"]) for e in map(json.loads, (out / "errors.jsonl").read_text().splitlines())}
    assert (("weak_label", "score_gap") in codes) == drop_ties and (("tie", "score_tie") in codes) == drop_ties

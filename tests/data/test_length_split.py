import numpy as np
import pytest
from rmflow.pipelines.splitting import assign_shard, assign_split
from rmflow.rendering.length import TooLong, apply_length_policy

PROMPT = np.arange(100, 120, dtype=np.int32)  # 20 prompt tokens, the first 4 are the "head"
C = np.r_[PROMPT, [1, 2, 3, 4, 5]].astype(np.int32)  # 25
R = np.r_[PROMPT, [7, 8, 9]].astype(np.int32)  # 23


def test_fitting_pairs_pass_unchanged():
    for policy in ("drop", "truncate-prompt"):
        c, r, p = apply_length_policy(C, R, 20, 4, 25, policy)
        assert c is C and r is R and p == 20


def test_drop_policy_counts_the_longer_side():
    with pytest.raises(TooLong) as e:
        apply_length_policy(C, R, 20, 4, 24, "drop")
    assert e.value.category == "too_long" and "25" in e.value.message


def test_truncate_prompt_cuts_oldest_prompt_tokens_after_the_head():
    c, r, p = apply_length_policy(C, R, 20, 4, 20, "truncate-prompt")
    assert len(c) == 20 and len(r) == 18 and p == 15
    assert c[:4].tolist() == [100, 101, 102, 103]  # template head kept
    assert c[4:15].tolist() == list(range(109, 120))  # the newest prompt tokens kept
    assert c[15:].tolist() == [1, 2, 3, 4, 5] and r[15:].tolist() == [7, 8, 9]  # replies whole
    assert c[:p].tolist() == r[:p].tolist()  # still one shared prompt


def test_truncate_prompt_drops_when_replies_alone_do_not_fit():
    # 5 reply tokens + 4 head tokens = 9 > 8: the end of a reply is never cut.
    with pytest.raises(TooLong) as e:
        apply_length_policy(C, R, 20, 4, 8, "truncate-prompt")
    assert e.value.code == "replies_too_long"
    c, r, p = apply_length_policy(C, R, 20, 4, 9, "truncate-prompt")
    assert c.tolist() == [100, 101, 102, 103, 1, 2, 3, 4, 5] and p == 4


def test_split_is_deterministic_and_close_to_the_fraction():
    ids = [f"{i:032x}" for i in range(20000)]
    splits = [assign_split(i, 0.1) for i in ids]
    assert splits == [assign_split(i, 0.1) for i in ids]
    assert 0.09 < splits.count("eval") / len(ids) < 0.11
    assert splits != [assign_split(i, 0.1, seed=1) for i in ids]  # the seed reshuffles
    assert all(assign_split(i, 0.0) == "train" for i in ids[:100])
    shards = {assign_shard(i, 4) for i in ids[:200]}
    assert shards == {0, 1, 2, 3}

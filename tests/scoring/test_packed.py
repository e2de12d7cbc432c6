"""Scoring in packed rows (``trainer.inference.packed``): at most 4 row sizes, every item in one
row within its tokens and reward slots, a handful of programs compiled once, and each
conversation's and each unit's response's score its own scored alone."""

import time

import numpy as np
import pytest
from flax import nnx
from rmflow.schemas.record import ResponsesRecord
from rmflow.trainer.inference import PackedScorer, PackedShapes, ScoringShapes, SequenceScorer
from rmflow.trainer.modeling.decoder import RewardTransformer

from tests.training.test_step import CFG


def test_rows_of_the_training_length_as_many_as_the_budget_holds_and_longer_items_by_power_of_two():
    shapes = PackedShapes(4096, 16384, row_length=512)  # a model of 4,096 positions trained at 512
    assert shapes.shapes == ((1, 512), (8, 512), (32, 512))  # compiled at start-up
    assert [shapes.long_size(n) for n in (513, 1024, 1025, 4000)] == [1024, 1024, 2048, 4096]
    assert (shapes.slots(512), shapes.slots(4096)) == (64, 256)
    assert PackedShapes(512, 4096).shapes == ((1, 512), (2, 512), (8, 512))  # nothing longer than a row
    assert PackedShapes(300, 256).shapes == ((1, 384),)


def test_a_plan_puts_every_item_in_one_row_within_its_tokens_and_slots():
    rng = np.random.default_rng(0)
    shapes = PackedShapes(2048, 8192, row_length=512)
    lengths = rng.integers(1, 256, 300).tolist() + [900, 2048, 600]
    slots = rng.integers(1, 9, 303).tolist()
    batches = shapes.plan(lengths, groups=slots)
    assert sorted(np.concatenate(batches).tolist()) == list(range(303))
    rows = shapes.place(lengths, slots)
    for r in rows:
        size = 512 if max(lengths[i] for i in r) <= 512 else 2048
        assert sum(lengths[i] for i in r) <= size and sum(slots[i] for i in r) <= shapes.slots(size)
    short = [r for r in rows if max(lengths[i] for i in r) <= 512]
    assert sum(lengths[:300]) / (len(short) * 512) > 0.9  # rows nearly full
    assert sum(len(b) for b in batches if max(lengths[i] for i in b) > 512) == 3  # the long ones apart
    with pytest.raises(ValueError, match="packed rows cannot score each item in a shape of its own"):
        shapes.plan(lengths, one_length=True)
    assert {shapes.long_size(lengths[i]) for b in batches for i in b if lengths[i] > 512} == {1024, 2048}
    with pytest.raises(ValueError, match="an item of 2049 tokens"):
        shapes.plan([2049])


def test_packed_scores_equal_each_item_alone_and_compile_once_per_row_size():
    model = RewardTransformer(CFG, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, 64, int(n)).astype(np.int32) for n in [*rng.integers(2, 120, 40), 200, 250]]
    units = []
    for k in (2, 3, 5):
        prompt = rng.integers(3, 64, 9).astype(np.int32)
        responses = tuple(rng.integers(3, 64, int(n)).astype(np.int32) for n in rng.integers(1, 30, k))
        units.append(ResponsesRecord(prompt, responses, np.asarray([8 + len(r) for r in responses]), np.zeros(k),
                                     "0" * 32))
    packed = PackedScorer(model, PackedShapes(256, 1024, row_length=128))
    packed.warm_up()
    assert {(1, 128), (8, 128)} <= packed.compiled  # one row and a full forward before it returns
    while packed.warming:  # the count between them right after, in the background
        time.sleep(0.05)
    shapes = {(1, 128), (2, 128), (8, 128)}  # rows of 128 tokens, 1, 2 or 8 a forward
    assert packed.compiled == shapes
    alone = SequenceScorer(model, ScoringShapes(256, max_rows=1))
    items = seqs + units
    got = [None] * len(items)
    for batch in packed.shapes.plan([len(x) if isinstance(x, np.ndarray) else x.unit_len for x in items],
                                    groups=[1] * len(seqs) + [u.k for u in units]):
        for i, (rewards, _) in zip(batch, packed.run_items([items[i] for i in batch])):
            got[i] = rewards
    assert packed.compiled == shapes | {(1, 256)}  # the row of the two items over 128 tokens, nothing else
    for s, r in zip(seqs, got):
        np.testing.assert_allclose(r, alone.run([s]), atol=1e-5, rtol=0)
    for u, r in zip(units, got[len(seqs):]):
        want = [alone.run([np.concatenate([u.prompt_ids, x])])[0] for x in u.responses]
        np.testing.assert_allclose(r, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed.score(seqs), [alone.run([s])[0] for s in seqs], atol=1e-5, rtol=0)

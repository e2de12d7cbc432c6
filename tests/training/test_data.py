import numpy as np
import pytest
from rmflow.pipelines.io import write_array_record_shard
from rmflow.schemas.record import PairRecord, encode
from rmflow.trainer.data import Collate, LoaderSpec, bucket_length, make_loader


def rec(i: int, n_c: int, n_r: int, margin=None) -> PairRecord:
    c = np.arange(1, n_c + 1, dtype=np.int32) + i
    r = np.r_[c[:2], np.full(n_r - 2, 7)].astype(np.int32)
    return PairRecord(c, r, n_c - 1, n_r - 1, 2, f"{i:032x}", "s", margin)


@pytest.fixture()
def shards(tmp_path):
    paths = []
    for s in range(2):
        p = str(tmp_path / f"train-{s:05d}-of-00002.array_record")
        write_array_record_shard(p, [encode(rec(10 * s + k, 5 + k, 3 + k, margin=float(k))) for k in range(10)])
        paths.append(p)
    return paths


def test_collate_layout_padding_and_explicit_indices():
    b = Collate(batch_size=3, max_length=512, pad_id=2)([rec(0, 5, 3, 1.5), rec(1, 70, 4)])
    assert b["input_ids"].shape == (6, 128)  # 70 tokens -> bucket 128; 2 pairs + 1 filler -> 6 rows
    assert b["weight"].tolist() == [1, 1, 0]
    assert b["reward_index"][:4, 0].tolist() == [4, 2, 69, 3]  # chosen, rejected, chosen, rejected
    assert b["input_ids"][0, :5].tolist() == [1, 2, 3, 4, 5] and (b["input_ids"][0, 5:] == 2).all()
    assert b["segment_ids"][1].sum() == 3 and b["margin"][:2].tolist() == [1.5, 0.0]
    assert b["real_tokens"] == 5 + 3 + 70 + 4


def test_bucket_lengths():
    assert [bucket_length(n, 1024) for n in (1, 17, 64, 65, 300, 1024)] == [16, 32, 64, 128, 512, 1024]
    assert bucket_length(90, 96) == 96
    with pytest.raises(ValueError, match="max_length 96"):
        bucket_length(100, 96)


def test_loader_epochs_shuffle_and_exact_resume(shards):
    def run(seed, steps=None, state=None):
        loader = make_loader(shards, LoaderSpec(batch_size=4, max_length=64, seed=seed, num_epochs=2, shard_by_process=False))
        it = iter(loader)
        if state is not None:
            it.set_state(state)
        out = []
        for b in it:
            out.append(b["input_ids"].copy())
            if steps is not None and len(out) == steps:
                return out, it.get_state()
        return out, None

    full, _ = run(0)
    assert len(full) == 10  # 20 pairs x 2 epochs / 4
    assert not all(np.array_equal(a, b) for a, b in zip(full, run(1)[0]))  # the seed shuffles
    first, state = run(0, steps=3)
    rest, _ = run(0, state=state)
    assert len(first) + len(rest) == len(full)
    for a, b in zip(first + rest, full):  # resumed exactly on the next batch
        assert np.array_equal(a, b)


def test_decoding_in_worker_processes_is_deterministic_and_resumable(shards):
    def batches(state=None, n=4):
        it = iter(make_loader(shards, LoaderSpec(batch_size=2, max_length=64, seed=5, num_epochs=1, worker_count=2,
                              shard_by_process=False)))
        if state is not None:
            it.set_state(state)
        out = [next(it)["input_ids"].copy() for _ in range(n)]
        return out, it.get_state()

    full, _ = batches(n=6)
    again, _ = batches(n=6)
    assert all(np.array_equal(a, b) for a, b in zip(full, again))
    here = iter(make_loader(shards, LoaderSpec(batch_size=2, max_length=64, seed=5, num_epochs=1, shard_by_process=False)))
    assert all(np.array_equal(a, next(here)["input_ids"]) for a in full)  # the same batches as in-process
    first, state = batches(n=3)
    rest, _ = batches(state, n=3)
    assert all(np.array_equal(a, b) for a, b in zip(first + rest, full))

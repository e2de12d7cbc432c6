"""Rows of one fixed shape (packing ``fixed``, ``trainer.data.rows``): every batch one shape,
every record served once a pass, resumed exactly from any batch (in this process and in loader
workers), a step's loss the mean over the records it holds however they are split, a record
that fits no row refused in one line, and a run compiling one train and one eval program."""

import logging

import jax
import numpy as np
import pytest
from rmflow.pipelines.io import write_array_record_shard
from rmflow.schemas.record import ResponsesRecord, StepRecord, encode
from rmflow.trainer.batching import stack_micro_batches
from rmflow.trainer.data import LoaderSpec, PackCollate, make_loader
from rmflow.trainer.data.rows import RowShape, first_fit, packed_batches, row_shape_for, target_tokens
from rmflow.trainer.objective import PROCESS, RESPONSES

from tests.training.test_packing import rec
from tests.training.test_step import records, trainer
from tests.training.test_train import config, synthetic  # noqa: F401 (synthetic: a fixture, used by name)


def _write(tmp_path, recs, name="train"):
    path = str(tmp_path / f"{name}-00000-of-00001.array_record")
    write_array_record_shard(path, [encode(r) for r in recs])
    return [path]


def _pairs(tmp_path, n=60, seed=3):
    rng = np.random.default_rng(seed)
    return _write(tmp_path, [rec(k, int(rng.integers(2, 20)), int(rng.integers(1, 30)), int(rng.integers(1, 30)),
                                 rng=rng) for k in range(n)])


def _solutions(tmp_path, n=40, seed=4):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        steps = int(rng.integers(1, 6))
        ends = np.cumsum(rng.integers(2, 8, steps)) + 3
        out.append(StepRecord(rng.integers(3, 90, int(ends[-1]) + 1).astype(np.int32), ends.astype(np.int32),
                              rng.integers(0, 2, steps).astype(np.int32), 3, f"{k:032x}"))
    return _write(tmp_path, out)


def _units(tmp_path, n=30, seed=5):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        responses = tuple(rng.integers(3, 90, int(rng.integers(2, 9))).astype(np.int32)
                          for _ in range(int(rng.integers(2, 6))))
        prompt = rng.integers(3, 90, int(rng.integers(2, 10))).astype(np.int32)
        out.append(ResponsesRecord(prompt, responses, np.asarray([len(prompt) + len(x) - 1 for x in responses]),
                                   rng.normal(size=len(responses)).astype(np.float32), f"{k:032x}"))
    return _write(tmp_path, out)


def test_first_fit_places_each_unit_once_in_order_within_a_row_s_tokens_and_slots():
    sizes = [(5, 1), (9, 2), (3, 1), (8, 1), (2, 3), (7, 1)]
    shape = RowShape(2, 12, 3)
    rows = first_fit(sizes, shape)
    assert rows == [[0, 2], [1]] == first_fit(sizes, shape)  # 3 and 5 fit no row's tokens, 4 no row's slots
    for row in rows:
        assert sum(sizes[i][0] for i in row) <= 12 and sum(sizes[i][1] for i in row) <= 3
    batches = packed_batches(sizes, shape, window=3)
    placed = [i for b in batches for row in b for i in row]
    assert sorted(placed) == list(range(len(sizes)))


def test_a_row_holds_batch_size_records_on_average_and_the_longest_alone():
    sizes = [(100, 1)] * 10
    assert target_tokens(sizes, batch_size=8, rows=1) == 864  # 8 x 100 x 17/16, to 16 tokens
    assert target_tokens(sizes, batch_size=32, rows=2) == 1792  # 1,700 to 128 tokens
    shape = row_shape_for(sizes, batch_size=8, rows=1, longest=1000)
    assert (shape.tokens, shape.slots) == (1000, 32)  # the longest fits; slots: twice the 10 a row holds
    with pytest.raises(ValueError, match="row_tokens 500: .* at least 1000"):
        row_shape_for(sizes, batch_size=8, rows=1, longest=1000, row_tokens=500)


@pytest.mark.parametrize("kind", ["pairs", "solutions", "units"])
def test_every_record_is_served_once_in_one_shape_and_resumes_exactly_from_any_batch(tmp_path, kind):
    write, objective, count = {"pairs": (_pairs, None, "weight"), "solutions": (_solutions, PROCESS, "record_steps"),
                               "units": (_units, RESPONSES[0], "record_slots")}[kind]
    paths = write(tmp_path)
    spec = LoaderSpec(batch_size=4, max_length=64, seed=2, num_epochs=2, shard_by_process=False, packing="fixed",
                      rows=2, row_tokens=160, row_slots=32, objective=objective)

    def batches(state=None, n=None):
        it = iter(make_loader(paths, spec))
        if state is not None:
            it.set_state(state)
        out = []
        for b in it:
            out.append(b)
            if n is not None and len(out) == n:
                return out, it.get_state()
        return out, None

    full, _ = batches()
    assert {b["input_ids"].shape for b in full} == {(2, 160)}
    assert {b["reward_index"].shape[1] for b in full} == {32 if kind != "pairs" else 64}
    served = sum(int(b[count].sum()) if count == "weight" else len(b[count]) for b in full)
    total = {"pairs": 60, "solutions": 40, "units": 30}[kind]
    assert served == 2 * total  # two passes, every record once each
    per_batch = [int(b["weight"].sum()) if count == "weight" else len(b[count]) for b in full]
    assert max(per_batch) > min(per_batch[:-1])  # a batch holds as many as fit, not a fixed count
    for cut in (1, 4, len(full) // 2):
        first, state = batches(n=cut)
        rest, _ = batches(state)
        assert len(first) + len(rest) == len(full)
        for a, b in zip(first + rest, full):
            for k in ("input_ids", "positions", "segment_ids", "branch_ids", "reward_index"):
                np.testing.assert_array_equal(a[k], b[k])


def test_loader_workers_make_the_same_batches_and_a_mixture_counts_its_sets(tmp_path):
    paths = _pairs(tmp_path)
    spec = dict(batch_size=4, max_length=64, seed=2, num_epochs=1, shard_by_process=False, packing="fixed", rows=1,
                row_tokens=96, row_slots=16)
    alone = list(make_loader(paths, LoaderSpec(**spec)))
    workers = list(make_loader(paths, LoaderSpec(**spec, worker_count=2)))
    assert len(alone) == len(workers)
    for a, b in zip(alone, workers):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    other = _write(tmp_path, [rec(100 + k, 4, 5, 6) for k in range(20)], name="other")
    mixed = iter(make_loader([paths, other], LoaderSpec(**{**spec, "num_epochs": None}, weights=[3.0, 1.0])))
    for _ in range(5):
        b = next(mixed)
        assert int(b["source_counts"].sum()) == int(b["weight"].sum()) > 0


def test_a_record_longer_than_a_row_or_with_more_parts_than_its_slots_is_refused_in_one_line(tmp_path):
    paths = _pairs(tmp_path)
    it = iter(make_loader(paths, LoaderSpec(batch_size=4, max_length=64, num_epochs=1, shard_by_process=False,
                                            packing="fixed", rows=1, row_tokens=20, row_slots=8)))
    with pytest.raises(ValueError, match=r"more than a row's 20: raise data.row_tokens"):
        list(it)
    steps = iter(make_loader(_solutions(tmp_path), LoaderSpec(batch_size=4, max_length=64, num_epochs=1,
                                                              shard_by_process=False, packing="fixed", rows=1,
                                                              row_tokens=128, row_slots=2, objective=PROCESS)))
    with pytest.raises(ValueError, match=r"scored parts \(steps, responses\), more than a row's 2 slots"):
        list(steps)


def test_a_step_s_loss_is_the_mean_over_its_records_however_the_rows_split_them():
    """The same 12 pairs as one exact-count micro-batch, or in fixed rows over 3 micro-batches of
    different counts: one update (the summed loss over the records it holds, divided once)."""
    recs = records(12)
    collate = PackCollate(12, 64)
    sizes = [collate.size(r) for r in recs]
    shape = RowShape(1, 48, 8)
    placements = packed_batches(sizes, shape, window=8)
    assert len({sum(map(len, p)) for p in placements}) > 1  # the micro-batches hold different counts
    lay_out = collate.layout(shape.tokens, shape.slots)
    micro = []
    for placement in placements:
        order = [i for row in placement for i in row]
        local = {i: k for k, i in enumerate(order)}
        micro.append(lay_out([recs[i] for i in order], [[local[i] for i in row] for row in placement]))
    t = trainer()
    fixed, m_fixed = t.train_step(t.init_state, stack_micro_batches(micro))
    t2 = trainer()
    exact, m_exact = t2.train_step(t2.init_state, stack_micro_batches([collate(recs)]))
    assert float(m_fixed["pairs"]) == float(m_exact["pairs"]) == 12
    np.testing.assert_allclose(float(m_fixed["loss_sum"]), float(m_exact["loss_sum"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(fixed.params), jax.tree.leaves(exact.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_a_run_compiles_one_train_and_one_eval_program(synthetic, tmp_path, caplog):  # noqa: F811
    """A run in fixed rows (the default on CPU) compiles its train step and its eval step once
    each, however its batches' records vary (counted from JAX's own compile log)."""
    from rmflow.trainer.step import forget_compiled
    from rmflow.trainer.train import run as train

    forget_compiled()
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING, logger="jax._src.dispatch"):
            train(config(synthetic, tmp_path / "r", max_steps=12, eval_steps=4, compilation_cache="off",
                         batch_size=8))
    finally:
        jax.config.update("jax_log_compiles", False)
    done = [r.getMessage() for r in caplog.records if "Finished XLA compilation of" in r.getMessage()]
    assert sum("jit(_train_step)" in m for m in done) == 1, done
    assert sum("jit(_eval_stacked)" in m for m in done) == 1, done


def test_a_checkpoint_of_another_packing_mode_is_refused_in_one_line(synthetic, tmp_path):  # noqa: F811
    """A run saved in packing pack (what auto meant before fixed rows) resumed in fixed rows:
    the loader's saved position means nothing to the packer, and the error says what to resume with."""
    from rmflow.trainer.errors import TrainError
    from rmflow.trainer.train import run as train

    pack = {"train": str(synthetic), "packing": "pack"}
    train(config(pack, tmp_path / "r", max_steps=4, checkpoint={"save_steps": 2}))
    before = (tmp_path / "r" / "config.json").read_bytes()
    with pytest.raises(TrainError, match=r"as packing pack, bucket or none saves it, and this run packs fixed: "
                                         r".*--set data.packing=pack --allow-config-change"):
        train(config(synthetic, tmp_path / "r", max_steps=6, checkpoint={"save_steps": 2}), resume=True,
              allow_config_change=True)
    assert (tmp_path / "r" / "config.json").read_bytes() == before  # the refused resume wrote nothing
    resumed = train(config(pack, tmp_path / "r", max_steps=6, checkpoint={"save_steps": 2}), resume=True,
                    allow_config_change=True)
    assert resumed.history[-1]["step"] == 6
    train(config(synthetic, tmp_path / "f", max_steps=4, checkpoint={"save_steps": 2}))  # saved in fixed rows
    with pytest.raises(TrainError, match=r"as packing fixed saves it, and this run packs pack: .*data.packing=fixed"):
        train(config(pack, tmp_path / "f", max_steps=6, checkpoint={"save_steps": 2}), resume=True,
              allow_config_change=True)


def test_fixed_rows_over_several_processes_are_refused_and_auto_packs_there(synthetic, tmp_path):  # noqa: F811
    from rmflow.trainer.errors import TrainError
    from rmflow.trainer.plan import plan_run

    mesh = {"data": 2, "fsdp": 1, "tensor": 1, "expert": 1}
    assert plan_run(config(synthetic, tmp_path / "a"), mesh_shape=mesh, processes=2, backend="cpu").packing == "pack"
    with pytest.raises(TrainError, match="data.packing fixed over 2 processes: .* use pack"):
        plan_run(config({"train": str(synthetic), "packing": "fixed"}, tmp_path / "b"), mesh_shape=mesh, processes=2,
                 backend="cpu")

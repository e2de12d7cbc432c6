"""The GPU check's script (benchmarks/gpu.py) rehearsed on CPU at toy sizes, every part, so that
a GPU session spends its time measuring, not debugging the script."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _benchmarks_importable(monkeypatch):
    """The scripts import each other by name, as they do when run by path (their folder first on
    the import path); loaded here by path, their folder goes first for the test's duration."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared (the real data the check reads)")
def test_the_gpu_check_rehearses_every_part(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "rehearse", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    report = json.loads((out / "gpu.json").read_text())
    errors = {p: rows["error"][-1500:] for p, rows in report["parts"].items() if isinstance(rows, dict)}
    assert proc.returncode == 0 and not errors, (errors, proc.stdout[-2000:], proc.stderr[-2000:])
    parts = report["parts"]
    assert set(parts) == {"parity", "kernel", "speed", "profile", "sizes", "trl_sizes", "trl", "real", "optimizer",
                          "deterministic"}
    # deterministic: no score moves by a bit over the random compositions; the default's do (or not), timed
    det = {r["mode"]: r for r in parts["deterministic"] if "mode" in r}
    assert det["deterministic"]["scores_changed"] == 0 and det["deterministic"]["compositions"] == 3
    (ratio,) = [r for r in parts["deterministic"] if r.get("summary") == "deterministic / default"]
    assert ratio["throughput_ratio"] > 0 and ratio["largest_deviation"] < 1e-3
    assert report["rehearse"]
    # rmflow as the GPU machine runs it: its wheel, built from this checkout and installed apart
    assert "/site/rmflow/trainer/" in report["rmflow"] and any(w.startswith("rmflow-") for w in report["wheels"])
    # kernel: each packed-row kernel timed alone; the fastest setting goes on to speed
    kernels = [r for r in parts["kernel"] if "ms" in r and "summary" not in r and "shape" not in r]
    assert {r["attention"] for r in kernels} == {"pallas", "blockwise"} and all(r["ms"] > 0 for r in kernels)
    long = [r for r in parts["kernel"] if "shape" in r]  # the same kernels on long pairs, tagged
    assert {r["attention"] for r in long} == {"pallas", "blockwise"} and all(r["ms"] > 0 for r in long)
    assert "2 pairs of 512 tokens" in long[0]["shape"]
    (plan,) = [r for r in parts["speed"] if r.get("summary") == "plan"]
    assert plan["packing"] in ("pack", "bucket") and plan["scan_layers"] in ("on", "off")
    assert report["plan"]["packing"] == plan["packing"]
    # parity: blockwise and pallas (interpret mode) measured against the dense reference; cudnn not on CPU
    measured = {(r["attention"], r["dtype"]): r for r in parts["parity"] if "error" not in r}
    assert measured[("blockwise", "float32")]["out_max_abs"] < 1e-5
    assert measured[("pallas", "float32")]["grad_max_rel"] < 1e-5
    assert any(r["attention"] == "cudnn" and "error" in r for r in parts["parity"])
    (capped,) = [r for r in parts["parity"] if r.get("softcap")]  # Gemma 2's shape: heads of 32 here, capped logits
    assert capped["head_dim"] == 32 and capped["window"] == 100 and capped["out_max_abs"] < 1e-5
    # speed: pack against bucket, with a ratio
    (summary,) = [r for r in parts["speed"] if r.get("summary") == "pack / bucket"]
    assert summary["ratio"] > 0 and {r.get("packing") for r in parts["speed"]} >= {"pack", "bucket"}
    timed_runs = [r for r in parts["speed"] if "real_tokens_per_s" in r]
    # each share is a part timed alone over the step timed whole: on a loaded CPU a part alone can
    # take longer than the step did, so only that both were measured is checked here, not a bound
    assert timed_runs and all(0 < r["attention_share"] < math.inf and 0 < r["optimizer_share"] < math.inf
                              for r in timed_runs)
    # profile: a steady step traced, its time split by kind of kernel; the device's busy time within the step
    steps = [r for r in parts["profile"] if r.get("summary") == "step"]
    assert steps and steps[0]["step_ms"] > 0 and 0 < steps[0]["dispatch_ms"] and 0 < steps[0]["mfu"] < 1
    (busy,) = [r for r in parts["profile"] if r.get("summary") == "device busy"]
    assert 0 < busy["busy_ms"] <= busy["step_ms"] * 1.01
    categories = {r["category"]: r for r in parts["profile"] if "category" in r and "kernel" not in r}
    assert "matrix products" in categories and all(r["ms_per_step"] > 0 for r in categories.values())
    assert [r for r in parts["profile"] if "kernel" in r]
    # optimizer: the state's settings at one size, each run's peak and step time against float32 moments
    # (here: int8 moments offloaded, and LoRA on an nf4 base)
    run, qlora = [r for r in parts["optimizer"] if "summary" not in r]
    assert run["training"] == "full+int8-moments+offload" and qlora["training"] == "lora16-nf4"
    assert all(r["fits"] and r["real_tokens_per_s"] > 0 for r in (run, qlora))
    assert run["planned_step_gib"] > 0 and qlora["planned_step_gib"] > 0  # the plan's count, beside a GPU's peak
    against = [r for r in parts["optimizer"] if r.get("summary") == "optimizer"]
    assert [r["against"] for r in against] == [run["training"]] * 2 and against[0]["step_ratio"] == 1.0
    # sizes: rmflow on synthetic pairs (LoRA, layers recomputed); TRL beside at the same size, and the ratio
    sizes = {r["training"]: r for r in parts["sizes"] if r.get("trainer") == "rmflow"}
    assert set(sizes) == {"lora16"} and all(r["fits"] and r["real_tokens_per_s"] > 0 for r in sizes.values())
    assert {r["training"]: r["fits"] for r in parts["sizes"] if r.get("summary") == "longest pair"} == {"lora16": 512}
    (trl_size,) = [r for r in parts["trl_sizes"] if r.get("trainer") == "TRL RewardTrainer"]
    assert trl_size["fits"] and trl_size["gradient_checkpointing"] and trl_size["real_tokens_per_s"] > 0
    (ratio,) = [r for r in parts["trl_sizes"] if r.get("summary") == "rmflow / TRL"]
    assert ratio["training"] == "lora16" and ratio["tokens_per_s"] > 0
    # trl: both trainers measured, the ratios computed
    trainers = [r for r in parts["trl"] if "trainer" in r]
    assert {r["trainer"] for r in trainers} == {"TRL RewardTrainer", "rmflow"}
    assert all(r["tokens_per_s"] > 0 and r["peak_mib"] > 0 for r in trainers)
    # rmflow's steady step in parts, so that host work is told apart from the device's and compilations
    (ours,) = [r for r in trainers if r["trainer"] == "rmflow"]
    parts_ms = ours["step_ms"]
    assert set(parts_ms) == {"step", "to_device", "ahead", "dispatch", "wait", "host_other"} and parts_ms["step"] > 0
    assert all(0 <= parts_ms[k] <= parts_ms["step"] for k in ("to_device", "ahead", "dispatch", "wait"))  # each within a step
    # real: both trained, evaluated on the held-out split and LLMBar, beside the length baseline; the export agrees
    rows = {r.get("trainer") or r.get("summary"): r for r in parts["real"]}
    for name in ("TRL RewardTrainer", "rmflow"):
        assert 0 <= rows[name]["eval_accuracy"] <= 1 and 0 <= rows[name]["eval_sets"]["llmbar"] <= 1
    assert "llmbar" in rows["length-only baseline"]["eval_sets"]
    exports = {r["dtype"]: r for r in parts["real"] if r.get("summary") == "export in transformers"}
    assert exports["float32"]["max_abs_diff"] < exports["float32"]["limit"]  # the same rewards
    assert 0 <= exports["bfloat16"]["pairs_ordered_alike"] <= 1 and exports["bfloat16"]["rmflow_reward_std"] > 0
    md = (out / "gpu.md").read_text()
    assert "## parity" in md and "## real" in md and "| rmflow |" in md


def _script(name: str):
    """``benchmarks/NAME.py`` loaded by path, as the GPU machine runs it."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_speed_summaries_compare_within_a_model_and_batch_and_plan_on_the_trained_model():
    """pack over bucket (with the same layers) and scanned over unrolled are drawn per (model,
    pairs a step), never across batches; the plan comes from the model the later parts train, at
    its smallest batch that compared them."""
    gpu = _script("gpu")

    def row(model, packing, scan, batch, tps):
        return {"model": model, "packing": packing, "scan_layers": scan, "pairs_per_step": batch,
                "real_tokens_per_s": tps, "mfu": tps / 1000, "attention": "pallas" if packing == "pack" else "cudnn",
                "block": 64 if packing == "pack" else None, "compile_s": 1.0}

    rows = [row("Q", "pack", False, 32, 150.0), row("Q", "bucket", False, 32, 100.0),
            row("Q", "pack", False, 64, 300.0), row("Q", "bucket", False, 64, 400.0),
            {"model": "Q", "packing": "pack", "scan_layers": True, "pairs_per_step": 64, "skipped": "out of time"},
            row("S", "pack", False, 32, 90.0), row("S", "bucket", True, 32, 120.0),
            row("S", "pack", True, 32, 100.0)]
    out = gpu.speed_summaries(rows, trained="S")
    ratios = {(r["model"], r["pairs_per_step"], r["summary"]): r["ratio"] for r in out if "ratio" in r}
    assert ratios == {("Q", 32, "pack / bucket"): 1.5, ("Q", 64, "pack / bucket"): 0.75,
                      ("S", 32, "pack / bucket"): 100 / 120,  # no unrolled bucket: both scanned
                      ("S", 32, "scanned / unrolled layers"): 100 / 90}
    assert out[-1] == {"summary": "plan", "packing": "bucket", "attention": "cudnn", "scan_layers": "on"}
    assert [r for r in gpu.speed_summaries(rows, trained="Q") if r.get("summary") == "plan"] == [
        {"summary": "plan", "packing": "pack", "attention": "pallas"}]  # batch 32's, not 64's
    assert gpu.speed_summaries(rows[4:5], trained="Q") == []
    # only one packing ran for the trained model (the other failed or was skipped): that one; what
    # this call could not decide comes from the earlier call's plan, and says so
    kept = {"packing": "bucket", "attention": "cudnn", "scan_layers": "off", "block": 64}
    assert gpu.speed_summaries([row("S", "pack", False, 32, 90.0)], trained="S", kept=kept) == [
        {"summary": "plan", "packing": "pack", "attention": "pallas", "scan_layers": "off",
         "from_earlier_call": ["scan_layers"]}]
    assert gpu.speed_summaries(rows[:4], trained="S", kept=kept) == [
        r for r in gpu.speed_summaries(rows[:4], trained="Q") if r.get("summary") != "plan"] + [
        {"summary": "plan", **{k: kept[k] for k in ("packing", "attention", "scan_layers")},
         "from_earlier_call": ["attention", "packing", "scan_layers"]}]


def test_a_speed_run_that_fails_is_recorded_and_the_next_runs_still_run(tmp_path, monkeypatch):
    """A run the device cannot hold (bucket's widest rows at the larger batch) is recorded with
    its error; the runs after it are measured and summarised."""
    import types

    gpu = _script("gpu")
    calls = []

    def throughput(name, records, packing, batch, *args, scan, **kw):
        calls.append((packing, batch))
        if (packing, batch) == ("bucket", 8):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.1GiB")
        return {"model": name, "packing": packing, "scan_layers": scan, "pairs_per_step": batch, "mfu": 0.1,
                "real_tokens_per_s": 100.0 * (2 if packing == "pack" else 1), "attention": packing, "block": None,
                "compile_s": 1.0}

    fake = types.SimpleNamespace(load_records=lambda folder: [], throughput=throughput)
    monkeypatch.setitem(sys.modules, "device", fake)
    monkeypatch.setattr(gpu, "_peak", lambda: 1.0)
    size = {**gpu.SIZES["rehearse"], "speed_runs": (("toy", "bucket", False, 8), ("toy", "pack", False, 4),
                                                    ("toy", "bucket", False, 4))}
    ctx = gpu.Ctx(size, tmp_path, tmp_path, None, True, {}, deadline=time.time() + 600, rows_file=tmp_path / "rows")
    gpu.part_speed(ctx)
    assert calls == [("bucket", 8), ("pack", 4), ("bucket", 4)]
    assert "RESOURCE_EXHAUSTED" in ctx.rows[0]["error"] and ctx.rows[0]["pairs_per_step"] == 8
    assert [r["ratio"] for r in ctx.rows if r.get("summary") == "pack / bucket"] == [2.0]
    assert ctx.rows[-1] == {"summary": "plan", "packing": "pack", "attention": "pack"}


def test_the_real_checkpoints_source_travels_in_pieces_that_join_back(tmp_path):
    """A device call carries at most 64 MiB: the 98 MB GGUF goes in pieces, the first one smaller
    (its call also carries the inputs); joined in order they are the file again."""
    gpu = _script("gpu")
    source = tmp_path / "model.gguf"
    source.write_bytes(os.urandom(10_001))
    pieces = gpu.split_gguf(source, [tmp_path / "a", tmp_path / "b", tmp_path / "c"], first_mb=0.002)
    assert [p.stat().st_size for p in pieces] == [2000, 4001, 4000]
    assert b"".join(p.read_bytes() for p in pieces) == source.read_bytes()
    (whole,) = gpu.split_gguf(source, [tmp_path / "d"], first_mb=0.002)  # one folder: the whole file
    assert whole.read_bytes() == source.read_bytes()


def _isolated(monkeypatch):
    """``run`` puts its site first on this process's path and environment: undone after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def test_a_later_call_runs_on_the_plan_an_earlier_call_measured(tmp_path, monkeypatch):
    """The GPU is lent in short calls: a call's report is kept on the machine and the next one
    merges it, taking the fastest kernel with its own settings and the packing the speed part
    measured, also from a part that ran out of time after measuring them; a part a later call
    could not run keeps the earlier call's rows; a report from another card is not merged."""
    _isolated(monkeypatch)
    gpu = _script("gpu")
    keep = tmp_path / "keep"
    keep.mkdir()
    earlier = {"device": "cpu", "parts": {
        "kernel": [{"attention": "pallas", "block": 64, "num_warps": 4, "num_stages": 3, "ms": 0.3},
                   {"attention": "blockwise", "block": 512, "num_warps": None, "num_stages": None, "ms": 6.5},
                   {"summary": "fastest", "attention": "pallas", "block": 64, "num_warps": 4, "num_stages": 3,
                    "ms": 0.3}],
        "speed": {"error": "speed stopped at the budget's end", "rows": [
            {"summary": "plan", "packing": "pack", "attention": "pallas", "scan_layers": "off"}]}},
        "seconds": {"kernel": 17.0, "speed": 180.0}, "calls": [{"parts": ["kernel", "speed"]}]}
    (keep / "gpu.json").write_text(json.dumps(earlier))
    report = gpu.run(tmp_path / "inputs", tmp_path / "out", ["kernel"], None, rehearse=True, keep=keep, budget_s=10)
    assert report["plan"] == {"block": 64, "num_warps": 4, "num_stages": 3, "packed_attention": "pallas",
                              "packing": "pack", "attention": "pallas", "scan_layers": "off"}
    assert report["parts"]["kernel"] == earlier["parts"]["kernel"]  # not run (no budget): the earlier rows stay
    assert "not run" in report["calls"][-1]["failed"]["kernel"] and len(report["calls"]) == 2
    assert "stopped at the budget's end" in (tmp_path / "out" / "gpu.md").read_text()
    assert gpu.kernel_choice({"packed_attention": "blockwise", "block": 512, "num_warps": 4}) == {"block": 512}
    (keep / "gpu.json").write_text(json.dumps({**earlier, "device": "NVIDIA H100 80GB HBM3"}))
    assert gpu.run(tmp_path / "inputs", tmp_path / "out", [], None, rehearse=True, keep=keep)["plan"] == {}


def test_one_checkpointing_setting_rerun_keeps_the_other_settings_rows(tmp_path, monkeypatch):
    """``--checkpointing on`` reruns the trl part with checkpointing on only (the child is told so)
    and the kept report's rows measured with it off stay beside the new ones."""
    _isolated(monkeypatch)
    gpu = _script("gpu")
    keep = tmp_path / "keep"
    keep.mkdir()
    off = [{"trainer": "rmflow", "gradient_checkpointing": False, "tokens_per_s": 2.0},
           {"summary": "rmflow / TRL", "gradient_checkpointing": False, "tokens_per_s": 9.0}]
    old_on = {"gradient_checkpointing": True, "skipped": "out of time"}
    (keep / "gpu.json").write_text(json.dumps({"device": "cpu", "parts": {"trl": off + [old_on]}}))
    seen = []

    def launch(part, spec, timeout):
        seen.append(spec["checkpointing"])
        return [{"trainer": "rmflow", "gradient_checkpointing": True, "tokens_per_s": 1.5}]

    monkeypatch.setattr(gpu, "_launch_part", launch)
    report = gpu.run(tmp_path / "inputs", tmp_path / "out", ["trl"], None, rehearse=True, keep=keep,
                     checkpointing=(True,))
    assert seen == [(True,)]
    assert report["parts"]["trl"] == off + [{"trainer": "rmflow", "gradient_checkpointing": True,
                                             "tokens_per_s": 1.5}]


def test_a_part_out_of_budget_is_stopped_with_everything_it_started(tmp_path, monkeypatch):
    """At the budget's end the part is stopped (its process group killed, which holds the trainers
    a part starts), and the result says so, with no rows."""
    _isolated(monkeypatch)
    gpu = _script("gpu")
    spec = {"inputs": str(tmp_path), "work": str(tmp_path), "checkpoint": None, "rehearse": True, "plan": {},
            "deadline": 0, "rows_file": str(tmp_path / "rows.jsonl")}
    result = gpu._launch_part("parity", spec, timeout=0.5)  # importing JAX alone takes longer
    assert "stopped at the budget's end" in result["error"] and result["rows"] == []


def test_inputs_without_rmflows_wheel_are_refused_before_anything_runs(tmp_path):
    """Every part imports rmflow as users install it, from the wheel prepared with the inputs:
    inputs prepared without it are refused at once, saying how to make them, not after the
    machine's start and a part's launch."""
    (tmp_path / "inputs" / "wheels").mkdir(parents=True)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "run", str(tmp_path / "inputs"),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "has no rmflow wheel" in proc.stderr and "gpu.py prepare" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_synthetic_pairs_attended_count_is_the_masks_and_kernels_are_told_apart():
    """The sizes part counts a long row's attention in closed form (no T x T mask on the device):
    it must equal the mask's count; the profile's categories read kernel names ("convert" is no
    convolution, a Pallas kernel is attention); busy time counts overlapping kernels once."""
    device = _script("device")
    from rmflow.trainer.data import PackCollate

    for tokens, pairs in ((256, 3), (100, 2), (516, 1)):
        batch = PackCollate(pairs, tokens, 0)(device.synthetic_pairs(tokens, pairs, 1000))
        assert device.synthetic_attended(tokens)(batch) == device.attended_pairs(batch)
    assert device.kernel_category("loop_dynamic-update-slice_convert_fusion") == "copies"
    assert device.kernel_category("nvjet_sm90_tst_192x192_64x3 command_buffer_1") == "matrix products"
    assert device.kernel_category("_dkdv_kernel command_buffer_1") == "attention (Pallas)"
    assert device.kernel_category("loop_multiply_fusion_45") == "elementwise and other fusions"
    kernels = [("a", "", 0.0, 10.0), ("b", "", 5.0, 10.0), ("c", "", 30.0, 5.0)]
    assert device.busy_ns(kernels) == 20.0
    rows = device.profile_table(kernels, steps=1, step_s=50e-9, top=2)  # ns: 50 a step
    assert rows[0]["busy_ms"] == pytest.approx(20e-6) and rows[0]["idle_ms"] == pytest.approx(30e-6)
    assert [r["kernel"] for r in rows if "kernel" in r] == ["a", "b"]


def test_size_summaries_and_ratios_pair_each_size_with_its_match():
    """The longest pair that fitted per model and training (rmflow's runs only), and rmflow over
    TRL at each size both ran; where one side did not fit, which."""
    gpu = _script("gpu")

    def row(trainer, model, training, tokens, fits, tps=None, peak=None):
        return {"trainer": trainer, "model": model, "training": training, "pair_tokens": tokens, "fits": fits,
                **({"real_tokens_per_s": tps, "peak_device_gib": peak} if fits else {})}

    ours = [row("rmflow", "M", "full", 2048, True, 300.0, 40.0), row("rmflow", "M", "full", 8192, False),
            row("rmflow", "M", "lora16", 16384, True, 50.0, 30.0), {"model": "M", "skipped": "out of time"}]
    theirs = [row("TRL RewardTrainer", "M", "full", 2048, True, 100.0, 50.0),
              row("TRL RewardTrainer", "M", "lora16", 16384, False),
              row("TRL RewardTrainer", "N", "full", 2048, True, 1.0, 1.0)]
    assert gpu.size_summaries(ours + theirs) == [
        {"summary": "longest pair", "model": "M", "training": "full", "fits": 2048, "does_not_fit": 8192},
        {"summary": "longest pair", "model": "M", "training": "lora16", "fits": 16384, "does_not_fit": None}]
    assert gpu.size_ratios(ours, theirs) == [
        {"summary": "rmflow / TRL", "model": "M", "training": "full", "pair_tokens": 2048, "tokens_per_s": 3.0,
         "peak_memory": 0.8},
        {"summary": "rmflow / TRL", "model": "M", "training": "lora16", "pair_tokens": 16384,
         "fits": {"rmflow": True, "TRL": False}}]

import os
import pathlib
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# XLA's CPU backend tuned to compile fast: without LLVM's optimisation passes, and with the older
# elemental emitters rather than the MLIR fusion emitters. The tests' many small programs compile
# far faster and run the same operations. Set before JAX is imported; the processes the
# tests start inherit it. RMFLOW_TEST_XLA_OPT=1 keeps XLA's defaults. A flag this jaxlib does not
# know would abort every process (XLA exits on unknown flags), so each is probed once first.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags: list[str]) -> bool:
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                           timeout=120)
    return probe.returncode == 0


def _fast_compile_flags() -> None:
    if os.environ.get("RMFLOW_TEST_XLA_OPT") == "1" or os.environ.get("RMFLOW_TEST_XLA_PROBED") == "1":
        return
    current = os.environ.get("XLA_FLAGS", "").split()
    wanted = [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in " ".join(current)]
    if wanted and not _xla_accepts(current + wanted):
        wanted = [f for f in wanted if _xla_accepts(current + [f])]
    os.environ["XLA_FLAGS"] = " ".join(current + wanted)
    os.environ["RMFLOW_TEST_XLA_PROBED"] = "1"  # xdist workers and test processes inherit the result


_fast_compile_flags()


def _rmflow_xla_settings() -> None:
    """rmflow's own XLA settings, as its entry points apply them before JAX starts (the CLI,
    ``train.run``, ``RewardModel.load``): a test that runs a step in process computes as a
    command the test starts does, bit for bit."""
    from rmflow.trainer.backend import configure_xla

    configure_xla()


_rmflow_xla_settings()


def _nan_never_matches() -> None:
    """numpy's array comparisons take NaN in the same place on both sides as equal, so a
    comparison of two NaN results passes. In this suite NaN matches nothing: ``assert_allclose`` defaults to
    ``equal_nan=False`` (a test expecting NaN says ``equal_nan=True``), and ``assert_array_equal``
    and ``assert_array_almost_equal`` refuse a NaN in the result unless given ``nan_ok=True``."""
    import functools

    import numpy as np

    allclose = np.testing.assert_allclose

    @functools.wraps(allclose)
    def assert_allclose(actual, desired, *args, equal_nan=False, **kw):
        return allclose(actual, desired, *args, equal_nan=equal_nan, **kw)

    def refusing_nan(compare):
        @functools.wraps(compare)
        def checked(actual, desired, *args, nan_ok=False, **kw):
            got = np.asarray(actual)
            if not nan_ok and got.dtype.kind in "fc" and np.isnan(got).any():
                raise AssertionError(f"{compare.__name__}: the result holds NaN at {np.argwhere(np.isnan(got))[:5].tolist()} "
                                     "(NaN == NaN would pass); pass nan_ok=True where NaN is the expected value")
            return compare(actual, desired, *args, **kw)
        return checked

    np.testing.assert_allclose = assert_allclose
    np.testing.assert_array_equal = refusing_nan(np.testing.assert_array_equal)
    np.testing.assert_array_almost_equal = refusing_nan(np.testing.assert_array_almost_equal)


_nan_never_matches()


def xla_defaults_env() -> dict[str, str]:
    """This process's environment with XLA's own optimisation back (the fast-compile flags above
    removed, any other flag kept): for a test process that runs long programs many times, like
    the demo's 40 steps on rows of 2,000+ tokens, where level 0's slower code costs more than its
    faster compiles save, and which should run what a user runs."""
    fast = {f.split("=")[0] for f in FAST_COMPILE_FLAGS}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in fast]
    return {**os.environ, "XLA_FLAGS": " ".join(kept)}


def pytest_configure(config):
    """One persistent compilation cache for the whole run, never the user's ~/.cache: a fresh
    folder the xdist workers and every process a test starts share (they inherit the variable),
    so the tiny models' train and eval steps compile once per run instead of once per test.
    Removed when the run ends. The tests of the cache
    itself name folders of their own."""
    if hasattr(config, "workerinput") or "RMFLOW_COMPILATION_CACHE" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="rmflow-test-jax-cache-")
    os.environ["RMFLOW_COMPILATION_CACHE"] = folder
    config._rmflow_cache = folder


def pytest_unconfigure(config):
    folder = getattr(config, "_rmflow_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("RMFLOW_COMPILATION_CACHE", None)

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
SHARED_DATA = SHARED / "data"
TOKENIZER_DIR = REPO / "rmflow" / "demo" / "tokenizer"  # the project's own copy of SmolLM2's


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    if not (SHARED_DATA / "hh_helpful_base_test_first2000.jsonl.gz").exists():
        pytest.fail(f"{SHARED_DATA} is missing: ../shared must sit beside the repository")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tokenizer_dir() -> str:
    return str(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir):
    from rmflow.pipelines.tokenizer_files import load_tokenizer_assets
    from rmflow.rendering.tokenize import build_tokenizer

    return build_tokenizer(load_tokenizer_assets(tokenizer_dir))


@pytest.fixture(scope="session")
def pair_tokenizer(hf_tokenizer):
    from rmflow.rendering.tokenize import RecordTokenizer

    return RecordTokenizer(hf_tokenizer)


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory, tokenizer_dir) -> pathlib.Path:
    """The demo's 500 HH-RLHF pairs preprocessed at max_length 128 (read-only; shared by tests)."""
    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig

    out = tmp_path_factory.mktemp("demo-shards") / "shards"
    preprocess(PreprocessConfig(inputs=(str(REPO / "rmflow" / "demo" / "hh_rlhf_helpful_sample.jsonl.gz"),),
                                output=str(out), tokenizer=tokenizer_dir, max_length=128, max_bad_fraction=1.0))
    return out


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a pytest without xdist (make test-airflow) must still start
def pytest_xdist_make_scheduler(config, log):
    """``make test`` (``pytest -n 2 --dist loadscope``): tests sharing a module-scoped fixture run
    on one worker, every other test is its own unit, and the slow ones start first
    (``tests/scheduling.py``)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from tests.scheduling import make_scheduler

    return make_scheduler(config, log, REPO)


PROCESS_MAX_LENGTH = 256


@pytest.fixture(scope="session")
def process_run(tmp_path_factory, tokenizer_dir) -> tuple[pathlib.Path, list[dict]]:
    """A micro process reward model trained one step on 40 PRM800K solutions (max_length 256),
    and those solutions (``{"prompt", "completions", "labels"}``; read-only; shared by tests)."""
    import gzip
    import json

    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.train import run as train

    base = tmp_path_factory.mktemp("process-run")
    with gzip.open(SHARED_DATA / "prm800k_phase1_test.stepwise.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(40)]
    (base / "prm.jsonl").write_text("".join(lines), encoding="utf-8")
    preprocess(PreprocessConfig(inputs=(str(base / "prm.jsonl"),), output=str(base / "shards"),
                                tokenizer=tokenizer_dir, max_length=PROCESS_MAX_LENGTH, max_bad_fraction=1.0))
    train(TrainConfig(data=str(base / "shards"), model="micro", output=str(base / "run"), max_steps=1, batch_size=4))
    return base / "run", [json.loads(x) for x in lines]

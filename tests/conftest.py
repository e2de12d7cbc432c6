import os
import pathlib
import re
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# XLA's CPU backend without LLVM's optimisation passes: the tests' many small programs compile far
# faster (tests/test_train.py: 157 s -> 102 s) and run the same operations. Set before JAX is
# imported; the processes the tests start inherit it. RMFLOW_TEST_XLA_OPT=1 keeps the default.
if os.environ.get("RMFLOW_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def pytest_configure(config):
    """One persistent compilation cache for the whole run, never the user's ~/.cache: a fresh
    folder the xdist workers and every process a test starts share (they inherit the variable),
    so the tiny models' train and eval steps compile once per run instead of once per test
    (test_train.py's time: 440 s -> 290 s). Removed when the run ends. The tests of the cache
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
    from rmflow.pipelines.tokenize import build_tokenizer, load_tokenizer_assets

    return build_tokenizer(load_tokenizer_assets(tokenizer_dir))


@pytest.fixture(scope="session")
def pair_tokenizer(hf_tokenizer):
    from rmflow.pipelines.tokenize import RecordTokenizer

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


def _modules_with_module_fixtures() -> frozenset[str]:
    """Test files that define a module-scoped fixture (a preprocessed dataset, a trained run)."""
    return frozenset(f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
                     if re.search(r"@pytest\.fixture\(scope=\"module\"", p.read_text()))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a pytest without xdist (make test-airflow) must still start
def pytest_xdist_make_scheduler(config, log):
    """``make test`` (``pytest -n 2 --dist loadscope``): the tests of a module that defines a
    module-scoped fixture run on one worker, so the fixture is built once per run, not once per
    worker; every other test is its own unit, spread one by one as with ``--dist load``."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    grouped = _modules_with_module_fixtures()

    class ModuleFixturesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in grouped else nodeid

    return ModuleFixturesTogether(config, log)


PROCESS_MAX_LENGTH = 256


@pytest.fixture(scope="session")
def process_run(tmp_path_factory, tokenizer_dir) -> tuple[pathlib.Path, list[dict]]:
    """A micro process reward model trained one step on 40 PRM800K solutions (max_length 256),
    and those solutions (``{"prompt", "completions", "labels"}``; read-only; shared by tests)."""
    import gzip
    import json

    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig, TrainConfig
    from rmflow.trainer.train import run as train

    base = tmp_path_factory.mktemp("process-run")
    with gzip.open(SHARED_DATA / "prm800k_phase1_test.stepwise.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(40)]
    (base / "prm.jsonl").write_text("".join(lines), encoding="utf-8")
    preprocess(PreprocessConfig(inputs=(str(base / "prm.jsonl"),), output=str(base / "shards"),
                                tokenizer=tokenizer_dir, max_length=PROCESS_MAX_LENGTH, max_bad_fraction=1.0))
    train(TrainConfig(data=str(base / "shards"), model="micro", output=str(base / "run"), max_steps=1, batch_size=4))
    return base / "run", [json.loads(x) for x in lines]

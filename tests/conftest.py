import os
import pathlib
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup`` (``make test``), a module's tests that share a
    module-scoped fixture (a preprocessed dataset, a trained run) run on one worker, so the
    fixture is built once per run, not once per worker; the other tests spread one by one."""
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        if defs and any(d.scope == "module" for ds in defs.name2fixturedefs.values() for d in ds):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))

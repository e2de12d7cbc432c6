import os
import pathlib

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# No persistent compilation cache for the suite (never the user's ~/.cache; the tests compile
# thousands of small executables, each of which the cache would write to disk); the tests of the
# cache name a folder of their own.
os.environ.setdefault("RMFLOW_COMPILATION_CACHE", "off")

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

"""Raw files preprocessed in one process (``rendering.prepare``, what `rmflow eval` of a raw file
runs where Beam is not installed) equal the Beam job's: the same records, byte for byte, the same
counts that reconcile and the same dead letters, on the shared data in every family of layouts
and on bad records; and none of it loads Beam."""

import gzip
import itertools
import json
import subprocess
import sys

import grain
import pytest
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.rendering.prepare import local_record_tokenizer, prepare
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.record import decode, encode

from tests.conftest import REPO


def _head(src, dest, n):
    with gzip.open(src, "rt") as f:
        dest.write_text("".join(itertools.islice(f, n)))
    return dest


def _helpsteer(dest):
    rows = []
    for p in range(6):
        for r in range(1 + p % 3):
            rows.append({"prompt": f"Question {p}?", "response": f"Answer {r} to {p}.", "helpfulness": (p + r) % 5,
                         "correctness": r % 5, "coherence": 3, "complexity": 1, "verbosity": r % 3})
    dest.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return dest


def _bad(dest):
    lines = [json.dumps({"prompt": "p", "chosen": "same", "rejected": "same"}),  # a tie
             "{not json", json.dumps({"prompt": "q", "chosen": "", "rejected": "b"}),  # empty reply
             json.dumps({"prompt": "r", "chosen": "a", "rejected": "b"}),
             json.dumps({"prompt": "r", "chosen": "a", "rejected": "b"}),  # a duplicate
             json.dumps({"prompt": "x " * 3000, "chosen": "a", "rejected": "b"})]  # too long
    dest.write_text("\n".join(lines) + "\n")
    return dest


CASES = {  # name -> (files maker, options)
    "hh pairs and bad records": (lambda d, t: [_head(d / "hh_helpful_base_test_first2000.jsonl.gz", t / "hh.jsonl", 60),
                                               _bad(t / "bad.jsonl")], {}),
    "k responses": (lambda d, t: [_head(d / "multi_response" / "rmbench_dev.jsonl.gz", t / "rmb.jsonl", 12)],
                    {"max_responses": 0}),
    "k responses as pairs": (lambda d, t: [_head(d / "multi_response" / "nectar_sample_dev.jsonl.gz", t / "n.jsonl",
                                                 8)], {"pairs_from": "expand"}),
    "helpsteer rows, rated": (lambda d, t: [_helpsteer(t / "hs.jsonl")],
                              {"format": "helpsteer", "attributes": "helpfulness,correctness",
                               "attribute_weights": "helpfulness=0.6,correctness=0.4"}),
    "stepwise": (lambda d, t: [_head(d / "prm800k_phase1_test.stepwise.jsonl.gz", t / "prm.jsonl", 20)], {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_in_process_preparation_equals_the_beam_job(case, shared_data, tokenizer_dir, tmp_path):
    make, options = CASES[case]
    files = make(shared_data, tmp_path)
    cfg = PreprocessConfig(inputs=tuple(str(f) for f in files), output=str(tmp_path / "shards"),
                           tokenizer=tokenizer_dir, max_length=256, eval_fraction=0.0, max_bad_fraction=1.0, **options)
    job = preprocess(cfg)
    paths = [str(tmp_path / "shards" / s.file) for s in job.manifest.splits["train"].shards]
    source = grain.sources.ArrayRecordDataSource(paths)
    shards = sorted(source[i] for i in range(len(source)))
    prepared = prepare(cfg, local_record_tokenizer(f"{tmp_path}/shards/tokenizer", cfg.step_separator))
    assert sorted(encode(r) for r in prepared.records) == shards
    assert [decode(x) for x in shards] and [r.record_id for r in prepared.records] == \
        sorted(r.record_id for r in prepared.records)
    assert prepared.stats["counts"] == job.stats["counts"] and prepared.stats["kind"] == job.stats["kind"]
    assert prepared.stats["dead_letters"] == job.stats["dead_letters"]
    assert prepared.stats["per_file"] == job.stats["per_file"]
    assert prepared.layouts == job.manifest.layouts
    written = [json.loads(x) for x in (tmp_path / "shards" / "errors.jsonl").read_text().splitlines()]
    key = lambda d: (d["source"], d["line"], d["code"])  # noqa: E731
    assert sorted(prepared.dead, key=key) == sorted(written, key=key)
    assert job.stats["counts"]["records_read"] > 0


def test_the_in_process_path_loads_no_beam():
    """What `rmflow eval` of a raw file runs: the reader, the steps, the accounting, the eval
    itself, with Beam made unimportable (as on a host with the train extra alone)."""
    code = ("import sys\n"
            "class NoBeam:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'apache_beam': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, NoBeam())\n"
            "import rmflow.rendering.prepare, rmflow.rendering.files, rmflow.eval.evaluation, rmflow.eval.ranking\n"
            "import rmflow.eval.sets\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('apache_beam', 'rmflow.pipelines')))\n"
            "print(bad); sys.exit(int(bool(bad)))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("case", ["hh pairs and bad records", "k responses"])
def test_a_run_s_raw_eval_set_written_in_process_is_the_beam_job_s_shard_folder(case, shared_data, tokenizer_dir,
                                                                                 tmp_path):
    """A train run's raw ``data.eval`` set, written in this process (``rmflow.eval.sets``): the same
    manifest as the preprocess job writes from the same files and options (its content: all but
    where it was written), the same records and dead letters, the same tokenizer files."""
    import dataclasses

    from rmflow.schemas.manifest import Manifest

    from rmflow.eval.sets import write_shard_folder

    make, options = CASES[case]
    files = make(shared_data, tmp_path)
    train = preprocess(PreprocessConfig(inputs=(str(files[0]),), output=str(tmp_path / "train"), tokenizer=tokenizer_dir,
                                        max_length=256, max_bad_fraction=1.0, **options)).manifest
    cfg = PreprocessConfig(inputs=tuple(str(f) for f in files), output=str(tmp_path / "beam"),
                           tokenizer=str(tmp_path / "train" / "tokenizer"), max_length=256, eval_fraction=0.0,
                           max_bad_fraction=1.0, overwrite=True, **options)
    job = preprocess(cfg)
    here = dataclasses.replace(cfg, output=str(tmp_path / "here"))
    prepared = prepare(here, local_record_tokenizer(here.tokenizer, here.step_separator))
    ours = write_shard_folder(here.output, prepared, here, dataclasses.replace(train.tokenizer, name=here.tokenizer))
    assert ours.content_identity() == job.manifest.content_identity()
    assert Manifest.from_json((tmp_path / "here" / "manifest.json").read_text()) == ours

    def records(folder):
        paths = [str(folder / s.file) for s in ours.splits["train"].shards]
        source = grain.sources.ArrayRecordDataSource(paths)
        return sorted(source[i] for i in range(len(source)))

    assert records(tmp_path / "here") == records(tmp_path / "beam") and records(tmp_path / "here")
    key = lambda d: (d["source"], d["line"], d["code"])  # noqa: E731
    errors = [sorted((json.loads(x) for x in (tmp_path / f / "errors.jsonl").read_text().splitlines()), key=key)
              for f in ("here", "beam")]
    assert errors[0] == errors[1]
    for f in sorted((tmp_path / "beam" / "tokenizer").iterdir()):
        assert (tmp_path / "here" / "tokenizer" / f.name).read_bytes() == f.read_bytes()
    assert (tmp_path / "here" / "COMPLETED").exists() and not list(tmp_path.glob("here.writing-*"))

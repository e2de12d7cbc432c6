"""Bad input never crashes the job and is never lost: files mixing valid records with dozens
of kinds of broken ones; every broken record lands in errors.jsonl with the right reason,
every valid one is written, and the counts reconcile."""

import json
import pathlib

import pytest
from rmflow.pipelines.preprocess import PreprocessError, run
from rmflow.schemas.config import PreprocessConfig

TEMPLATE = (
    "{% for m in messages %}{% if 'TEMPLATE_BOOM' in m['content'] %}"
    "{{ raise_exception('this template refuses TEMPLATE_BOOM') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
J = lambda obj: json.dumps(obj).encode()  # noqa: E731

VALID = {
    "text.jsonl": lambda i: {"prompt": f"Question {i}?", "chosen": f"Good answer {i}.", "rejected": f"Bad {i}."},
    "conv.jsonl": lambda i: {"prompt": [U(f"Q{i}")], "chosen": [A(f"yes {i}")], "rejected": [A(f"no {i}")]},
    "implicit.jsonl": lambda i: {"chosen": [U(f"Q{i}"), A("a")], "rejected": [U(f"Q{i}"), A("b")]},
    "hh.jsonl": lambda i: {"chosen": f"\n\nHuman: H{i}\n\nAssistant: good", "rejected": f"\n\nHuman: H{i}\n\nAssistant: bad"},
    "uf.jsonl": lambda i: {"prompt": f"U{i}", "chosen": [U(f"U{i}"), A("c")], "rejected": [U(f"U{i}"), A("r")],
                           "score_chosen": 9, "score_rejected": 3},
    "tok.jsonl": lambda i: {"chosen_ids": [1, 2, 3, i + 10], "rejected_ids": [1, 2, 4, i + 10]},
}

BROKEN = {
    "text.jsonl": [
        (J({"foo": 1}), "unknown_layout"),  # before the file's layout is known
        (b'{"prompt": "p", "chosen": "c", "rejected": ', "bad_json"),
        (b'{"prompt": "p", "chosen": "c", "rejected": "r"} trailing', "bad_json"),
        (b'{"prompt": "p\x01", "chosen": "c", "rejected": "r"}', "bad_json"),  # raw control character
        (b'\xff\xfe{"prompt": "p", "chosen": "c", "rejected": "r"}', "bad_encoding"),
        (b"[1, 2]", "not_an_object"),
        (b'"hello"', "not_an_object"),
        (b"42", "not_an_object"),
        (b"null", "not_an_object"),
        (J({"prompt": "p", "rejected": "r"}), "missing_field"),
        (J({"prompt": "p", "chosen": "c"}), "missing_field"),
        (J({"chosen": "c", "rejected": "r"}), "missing_field"),
        (J({"prompt": 7, "chosen": "c", "rejected": "r"}), "bad_type"),
        (J({"prompt": "p", "chosen": ["c"], "rejected": "r"}), "bad_type"),
        (J({"prompt": "p", "chosen": "c", "rejected": None}), "bad_type"),
        (J({"prompt": "p", "chosen": True, "rejected": "r"}), "bad_type"),
        (J({"prompt": "p", "chosen": "", "rejected": "r"}), "empty_reply"),
        (J({"prompt": "p", "chosen": "c", "rejected": "   "}), "empty_reply"),
        (J({"prompt": "", "chosen": "c", "rejected": "r"}), "empty_prompt"),
        (J({"prompt": "p", "chosen": "same", "rejected": "same"}), "tie"),
        (J({"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}), "bad_type"),
        (b'{"prompt": "p", "chosen": "c", "rejected": "r", "margin": NaN}', "bad_value"),
        (b'{"prompt": "p", "chosen": "c", "rejected": "r", "margin": -Infinity}', "bad_value"),
        (J({"prompt": "p", "chosen": "c", "rejected": "r", "subset": 5}), "bad_type"),
        (J({"prompt": "p", "chosen": "TEMPLATE_BOOM", "rejected": "r"}), "template_error"),
        (b'{"prompt": "p", "chosen": "c\\ud800", "rejected": "r"}', "bad_text"),  # lone surrogate
        (J({"prompt": "p", "chosen": "word " * 3000, "rejected": "r"}), "too_long"),
        (J(VALID["text.jsonl"](0)), "duplicate"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too_deeply_nested"),  # RecursionError
        (J({"prompt": "p", "chosen": "c", "rejected": "r", "subset": "s" * 70_000}), "bad_value"),
    ],
    "conv.jsonl": [
        (J({"prompt": [], "chosen": [A("c")], "rejected": [A("r")]}), "empty_prompt"),
        (J({"prompt": [{"role": "wizard", "content": "p"}], "chosen": [A("c")], "rejected": [A("r")]}), "bad_role"),
        (J({"prompt": [{"role": "user"}], "chosen": [A("c")], "rejected": [A("r")]}), "bad_message"),
        (J({"prompt": ["p"], "chosen": [A("c")], "rejected": [A("r")]}), "bad_message"),
        (J({"prompt": [U("p")], "chosen": [U("c")], "rejected": [A("r")]}), "bad_role"),
        (J({"prompt": [U(3)], "chosen": [A("c")], "rejected": [A("r")]}), "bad_type"),
        (J({"prompt": [U("p")], "chosen": [], "rejected": [A("r")]}), "empty_reply"),
    ],
    "implicit.jsonl": [
        (J({"chosen": [U("p"), A("a"), U("x"), A("c")], "rejected": [U("p"), A("a"), U("y"), A("r")]}), "diverge_before_reply"),
        (J({"chosen": [U("p"), A("c")], "rejected": [U("q"), A("r")]}), "no_common_prompt"),
        (J({"chosen": [U("p"), A("c")], "rejected": [U("p")]}), "no_reply"),
    ],
    "hh.jsonl": [
        (J({"chosen": "junk\n\nHuman: Q\n\nAssistant: A", "rejected": "\n\nHuman: Q\n\nAssistant: B"}), "bad_transcript"),
        (J({"chosen": "\n\nHuman: Q\n\nAssistant: A\n\nHuman: more", "rejected": "\n\nHuman: Q\n\nAssistant: B"}), "bad_transcript"),
        (J({"chosen": "\n\nHuman: Q\n\nAssistant: A", "rejected": "\n\nHuman: Q\n\nAssistant:"}), "empty_reply"),
    ],
    "uf.jsonl": [
        (J({"chosen": [U("p"), A("c")], "rejected": [U("p"), A("r")], "score_chosen": 1, "score_rejected": 2}), "scores_contradict"),
        (J({"chosen": [U("p"), A("c")], "rejected": [U("p"), A("r")], "score_chosen": "9", "score_rejected": 2}), "bad_type"),
    ],
    "tok.jsonl": [
        (J({"chosen_ids": [1, -2], "rejected_ids": [1, 3]}), "bad_value"),
        (J({"chosen_ids": [], "rejected_ids": [1, 3]}), "empty_reply"),
        (J({"chosen_ids": [1, 2, 3], "rejected_ids": [1, 2, 4], "prompt_len": 3}), "bad_value"),
        (J({"chosen_ids": [1, 2], "rejected_ids": [1, 2]}), "tie"),
    ],
}
CATEGORY = {"tie": "tie", "too_long": "too_long", "duplicate": "duplicate"}
N_VALID = 6


def write_inputs(folder: pathlib.Path):
    """Interleave valid and broken records (plus blank lines, which are not records)."""
    expected, valid = {}, 0
    for name, make_valid in VALID.items():
        lines: list[bytes] = []
        broken = list(BROKEN[name])
        for i in range(max(N_VALID, len(broken))):
            if i < len(broken):
                lines.append(broken[i][0])
                expected[(name, len(lines))] = broken[i][1]
            if i < N_VALID:
                lines.append(J(make_valid(i)))
                valid += 1
            if i == 2:
                lines.append(b"   ")
        (folder / name).write_bytes(b"\n".join(lines) + b"\n")
    return expected, valid


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad-inputs")
    (folder / "template.jinja").write_text(TEMPLATE)
    expected, valid = write_inputs(folder)
    return folder, expected, valid


def cfg(folder, out, tokenizer_dir, **kw):
    return PreprocessConfig(inputs=(f"{folder}/*.jsonl",), output=str(out), tokenizer=tokenizer_dir,
                            chat_template=str(folder / "template.jinja"), max_length=512,
                            dedup=True, **kw)


def test_at_least_thirty_kinds_of_broken_records():
    assert sum(len(v) for v in BROKEN.values()) >= 30
    assert len({code for v in BROKEN.values() for _, code in v}) >= 20


def test_every_broken_record_is_reported_with_its_reason(bad_inputs, tokenizer_dir, tmp_path):
    folder, expected, valid = bad_inputs
    result = run(cfg(folder, tmp_path / "out", tokenizer_dir, max_bad_fraction=1.0))
    errors = [json.loads(line) for line in open(tmp_path / "out" / "errors.jsonl")]
    got = {(pathlib.Path(e["source"]).name, e["line"]): e for e in errors}
    assert len(got) == len(errors)
    assert {k: e["code"] for k, e in got.items()} == expected
    for (name, line), e in got.items():
        assert e["category"] == CATEGORY.get(e["code"], "error")
        assert e["reason"] and e["stage"]
        raw = (folder / name).read_bytes().split(b"\n")[line - 1]
        assert e["record"] == raw.decode("utf-8", errors="replace")  # the raw record, verbatim
    c = result.stats["counts"]
    assert c["pairs_written"] == valid  # every valid record is written
    assert c["records_read"] == valid + len(expected)
    assert c["records_read"] == c["pairs_written"] + c["dropped_too_long"] + c["ties"] + c["duplicates"] + c["errors"]
    assert (c["ties"], c["dropped_too_long"], c["duplicates"]) == (2, 1, 1)


def test_too_many_bad_records_fail_the_job_and_publish_nothing(bad_inputs, tokenizer_dir, tmp_path):
    folder, expected, _ = bad_inputs
    with pytest.raises(PreprocessError, match=r"more than --max-bad-fraction 5.0%.*errors.jsonl") as e:
        run(cfg(folder, tmp_path / "out", tokenizer_dir))
    assert not (tmp_path / "out").exists()
    staging = next(tmp_path.glob("out.tmp-*"))
    assert str(staging) in str(e.value)
    assert len((staging / "errors.jsonl").read_text().splitlines()) == len(expected)


def test_an_unexpected_exception_is_contained_to_its_record(tmp_path, tokenizer_dir, monkeypatch):
    """A bug in one adapter (any exception, not only BadRecord) dead-letters that record as
    internal_error with the exception's text; the job goes on and the counts reconcile."""
    import rmflow.rendering.formats as formats

    real = formats._ADAPTERS["text"]

    def buggy(record):
        if record.get("prompt") == "BOOM":
            raise ZeroDivisionError("division by zero in an adapter")
        return real(record)

    monkeypatch.setitem(formats._ADAPTERS, "text", buggy)
    lines = [J(VALID["text.jsonl"](i)) for i in range(4)]
    lines.insert(2, J({"prompt": "BOOM", "chosen": "c", "rejected": "r"}))
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    result = run(PreprocessConfig(inputs=(str(tmp_path / "in.jsonl"),), output=str(tmp_path / "out"),
                                  tokenizer=tokenizer_dir, max_length=128, max_bad_fraction=1.0))
    assert result.stats["counts"]["pairs_written"] == 4
    (err,) = [json.loads(x) for x in open(tmp_path / "out" / "errors.jsonl")]
    assert (err["code"], err["line"]) == ("internal_error", 3)
    assert "ZeroDivisionError: division by zero in an adapter" in err["reason"]

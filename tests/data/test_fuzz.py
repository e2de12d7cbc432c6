"""Property-based: nothing a user's file can hold escapes per-record handling.

Arbitrary JSON values (shaped like the layouts, with the layouts' keys, and not) and arbitrary
bytes go through every format adapter and through the whole preprocess pipeline. Adapters
raise only BadRecord; the pipeline never fails because of one record, every line is either
written or dead-lettered with a reason, and the counts reconcile.
"""

import json
import pathlib

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rmflow.pipelines.preprocess import run
from rmflow.rendering.formats import (
    BadRecord,
    CanonicalPair,
    CanonicalSteps,
    detect_format,
    normalize,
    parse_json_object,
)
from rmflow.schemas.config import FORMATS, STEP_FORMATS, PreprocessConfig
from rmflow.schemas.manifest import ERRORS_FILE

DEMO_TOKENIZER = str(pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo" / "tokenizer")
KEYS = ["prompt", "chosen", "rejected", "input", "role", "content", "messages", "margin", "subset",
        "score_chosen", "score_rejected", "chosen_ids", "rejected_ids", "input_ids_chosen",
        "input_ids_rejected", "prompt_len", "system", "instruction", "output", "completions", "labels",
        "problem", "steps", "label", "tool_calls"]
ROLES = st.sampled_from(["user", "assistant", "system", "tool", "", "x"])
TEXT = st.one_of(st.text(max_size=30), st.sampled_from(["\n\nHuman: hi\n\nAssistant: yo", "\ud800", "", " "]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), TEXT)
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": st.one_of(TEXT, SCALARS)})
JSON = st.recursive(
    st.one_of(SCALARS, MESSAGE),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=5)), inner,
                                            max_size=6)),
    max_leaves=20,
)
RECORD = st.dictionaries(st.sampled_from(KEYS), JSON, max_size=6)
# Near-valid records of the stepwise layouts and of messages with tool calls: they reach the deeper
# checks (label counts, label values, step texts, the first-error index) that random keys never do.
MESSAGES = st.lists(st.one_of(MESSAGE, st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.one_of(TEXT, st.none()),
     "tool_calls": st.one_of(st.lists(JSON, max_size=2), SCALARS)})), max_size=3)
STEPWISE = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT, MESSAGES), "completions": st.one_of(st.lists(TEXT, max_size=4), SCALARS),
     "labels": st.one_of(st.lists(st.one_of(st.booleans(), st.integers(-1, 2), SCALARS), max_size=4), SCALARS)},
    optional={"subset": SCALARS, "margin": SCALARS})
PROCESSBENCH = st.fixed_dictionaries(
    {"problem": st.one_of(TEXT, SCALARS), "steps": st.one_of(st.lists(TEXT, max_size=4), SCALARS),
     "label": st.one_of(st.integers(-3, 6), SCALARS)}, optional={"subset": SCALARS})
CONVERSATIONAL = st.fixed_dictionaries({"prompt": MESSAGES, "chosen": st.one_of(MESSAGES, TEXT),
                                        "rejected": st.one_of(MESSAGES, TEXT)})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=st.one_of(RECORD, JSON, STEPWISE, PROCESSBENCH, CONVERSATIONAL))
@example(record={"prompt": [{"role": "user", "content": "q"}], "rejected": "r",  # a lone surrogate
                 "chosen": [{"role": "assistant", "content": "", "tool_calls": [{"a": "\ud800"}]}]})  # in a tool call
def test_adapters_raise_only_bad_record(record):
    for fmt in FORMATS:
        try:
            pair = normalize(record, fmt, source="f.jsonl", line=1, margin_from_scores=True)
        except BadRecord:
            continue
        assert isinstance(pair, CanonicalSteps if fmt in STEP_FORMATS else CanonicalPair)
        if isinstance(pair, CanonicalSteps):
            assert len(pair.steps) == len(pair.labels) > 0 and all(s.strip() for s in pair.steps)
        _ = pair.pair_id  # hashing the content must work for anything an adapter accepts
    if isinstance(record, dict):
        try:
            detect_format(record)
        except BadRecord:
            pass


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(max_size=60), st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
                      st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
                      st.integers(1, 5000).map(lambda n: '{"a":' * n + "1" + "}" * n)))
def test_json_parsing_raises_only_bad_record(text):
    try:
        assert isinstance(parse_json_object(text), dict)
    except BadRecord:
        pass


def _line(value) -> bytes:
    if isinstance(value, bytes):
        return value.replace(b"\n", b" ")
    return json.dumps(value).encode()


GOOD = [{"prompt": f"Question {i}?", "chosen": f"Yes {i}.", "rejected": f"No {i}."} for i in range(3)]
LINES = st.lists(st.one_of(RECORD.map(_line), JSON.map(_line), st.binary(min_size=1, max_size=40).map(_line),
                           st.integers(2000, 20000).map(lambda n: b'{"prompt": ' + b"[" * n + b"]" * n + b"}")),
                 min_size=1, max_size=25)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(lines=LINES)
def test_pipeline_contains_every_record(tmp_path_factory, lines):
    """Good records first (so the file's layout is text), then fuzz; nothing escapes, all counted."""
    body = [_line(g) for g in GOOD] + lines
    body = [b for b in body if b.strip()]  # blank lines are not records
    result = _preprocess_contains_every_line(tmp_path_factory.mktemp("fuzz"), body, len(GOOD), max_length=64)
    assert result.stats["kind"] == "outcome"


def _preprocess_contains_every_line(tmp, body: list[bytes], good: int, **options):
    """Preprocess ``body`` as one file: every line is read, the good ones are written, and every
    other one is in the errors file with a code and a reason."""
    (tmp / "in.jsonl").write_bytes(b"\n".join(body) + b"\n")
    result = run(PreprocessConfig(inputs=(str(tmp / "in.jsonl"),), output=str(tmp / "out"), tokenizer=DEMO_TOKENIZER,
                                  eval_fraction=0.0, max_bad_fraction=1.0, **options))
    c = result.stats["counts"]
    assert c["records_read"] == len(body)
    assert c["pairs_written"] >= good
    errors = (tmp / "out" / ERRORS_FILE).read_text().splitlines()
    assert len(errors) == c["records_read"] - c["pairs_written"]
    for e in map(json.loads, errors):
        assert e["code"] and e["reason"]
    return result


GOOD_STEPS = [{"prompt": f"What is {i} + {i}?", "completions": [f"{i} + {i} = {2 * i}.", "So the answer is it."],
               "labels": [True, i % 2 == 0]} for i in range(3)]
STEP_LINES = st.lists(st.one_of(STEPWISE.map(_line), PROCESSBENCH.map(_line), RECORD.map(_line)), min_size=1,
                      max_size=20)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(lines=STEP_LINES)
def test_pipeline_contains_every_stepwise_record(tmp_path_factory, lines):
    """The same for stepwise data (a process reward model's): nothing escapes, all counted."""
    body = [_line(g) for g in GOOD_STEPS] + lines
    result = _preprocess_contains_every_line(tmp_path_factory.mktemp("fuzz-steps"), body, len(GOOD_STEPS),
                                             max_length=128, format="stepwise")
    assert result.stats["kind"] == "process"

import pytest
from rmflow.rendering.formats import BadRecord, Tie, detect_format, normalize, parse_hh_transcript

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731

EXAMPLES = {
    "text": {"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away."},
    "conversational": {"prompt": [U("Hi?")], "chosen": [A("Hello!")], "rejected": [A("Go away.")]},
    "implicit": {"chosen": [U("Hi?"), A("Hello!")], "rejected": [U("Hi?"), A("Go away.")]},
    "hh-rlhf": {"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hi?\n\nAssistant: Go away."},
    "axolotl": {"input": "Hi?", "chosen": "Hello!", "rejected": "Go away."},
    "ultrafeedback": {"prompt": "Hi?", "chosen": [U("Hi?"), A("Hello!")], "rejected": [U("Hi?"), A("Go away.")],
                      "score_chosen": 8.5, "score_rejected": 6.0},
    "tokenized": {"chosen_ids": [1, 2, 3, 4], "rejected_ids": [1, 2, 5]},
}


def norm(record, fmt=None, **kw):
    return normalize(record, fmt or detect_format(record), source="s.jsonl", line=1, **kw)


@pytest.mark.parametrize("fmt", sorted(EXAMPLES))
def test_detection(fmt):
    assert detect_format(EXAMPLES[fmt]) == fmt


@pytest.mark.parametrize("fmt", sorted(set(EXAMPLES) - {"tokenized"}))
def test_every_text_layout_gives_the_same_canonical_pair(fmt):
    p = norm(EXAMPLES[fmt])
    assert p.prompt == (("user", "Hi?"),)
    assert p.chosen == (("assistant", "Hello!"),)
    assert p.rejected == (("assistant", "Go away."),)
    assert p.pair_id == norm(EXAMPLES["text"]).pair_id  # same content, same id, any layout


def test_tokenized_pair_prompt_is_common_prefix():
    p = norm(EXAMPLES["tokenized"])
    assert p.is_tokenized and p.chosen_ids == (1, 2, 3, 4) and p.prompt_len == 2
    q = norm({"input_ids_chosen": [1, 2, 3], "input_ids_rejected": [1, 2, 4], "prompt_len": 1})
    assert q.prompt_len == 1
    with pytest.raises(BadRecord, match="prefix"):
        norm({"chosen_ids": [1, 2, 3], "rejected_ids": [1, 5, 4], "prompt_len": 2})


def test_margin_is_carried_in_every_layout():
    for fmt, rec in EXAMPLES.items():
        assert norm({**rec, "margin": 2.0}).margin == 2.0, fmt
        assert norm(rec).margin is None or fmt == "ultrafeedback"


def test_ultrafeedback_margin_from_scores_only_when_asked():
    rec = EXAMPLES["ultrafeedback"]
    assert norm(rec).margin is None
    assert norm(rec, margin_from_scores=True).margin == 2.5
    assert norm({**rec, "margin": 1.0}, margin_from_scores=True).margin == 1.0  # explicit column wins
    with pytest.raises(BadRecord) as e:
        norm({**rec, "score_chosen": 1, "score_rejected": 2})
    assert e.value.code == "scores_contradict"


def test_axolotl_system_and_conversational_system():
    p = norm({**EXAMPLES["axolotl"], "system": "Be nice."})
    assert p.prompt == (("system", "Be nice."), ("user", "Hi?"))
    q = norm({"prompt": [S("Be nice."), U("Hi?")], "chosen": "Hello!", "rejected": [A("No.")]})
    assert q.prompt[0] == ("system", "Be nice.") and q.chosen == (("assistant", "Hello!"),)


def test_multimodal_style_text_parts_are_joined():
    p = norm({"prompt": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
              "chosen": [A("x")], "rejected": [A("y")]})
    assert p.prompt == (("user", "ab"),)


def test_subset_is_carried():
    assert norm({**EXAMPLES["text"], "subset": "chat-hard"}).subset == "chat-hard"


# ----------------------------------------------------------------- HH-RLHF quirks


def test_hh_multi_turn_prompt_and_inline_markers():
    chosen = "\n\nHuman: Hi\n\nAssistant: Hey. A Human: said this\n\nHuman: And?\n\nAssistant: Fine."
    rejected = "\n\nHuman: Hi\n\nAssistant: Hey. A Human: said this\n\nHuman: And?\n\nAssistant: Bad."
    p = norm({"chosen": chosen, "rejected": rejected})
    assert p.prompt == (("user", "Hi"), ("assistant", "Hey. A Human: said this"), ("user", "And?"))
    assert p.chosen == (("assistant", "Fine."),)


def test_hh_divergence_at_an_earlier_assistant_turn_keeps_both_continuations():
    p = norm({"chosen": "\n\nHuman: Q\n\nAssistant: A1\n\nHuman: Q2\n\nAssistant: A2",
              "rejected": "\n\nHuman: Q\n\nAssistant: B1"})
    assert p.prompt == (("user", "Q"),)
    assert p.chosen == (("assistant", "A1"), ("user", "Q2"), ("assistant", "A2"))


def test_hh_without_leading_newlines_and_trailing_space():
    assert parse_hh_transcript("Human: a \n\nAssistant: b ", "x") == (("user", "a"), ("assistant", "b"))


@pytest.mark.parametrize(
    "record, code",
    [
        ({"chosen": "\n\nHuman: Q\n\nAssistant: A", "rejected": "\n\nHuman: Q\n\nAssistant:"}, "empty_reply"),
        ({"chosen": "\n\nHuman: Q\n\nAssistant: A", "rejected": "\n\nHuman: Q\n\nAssistant: A"}, "tie"),
        ({"chosen": "\n\nHuman: Q\n\nAssistant: A\n\nHuman: more", "rejected": "\n\nHuman: Q\n\nAssistant: B"}, "bad_transcript"),
        ({"chosen": "junk \n\nHuman: Q\n\nAssistant: A", "rejected": "\n\nHuman: Q\n\nAssistant: B"}, "bad_transcript"),
        ({"chosen": "\n\nHuman: Q\n\nAssistant: A", "rejected": "\n\nHuman: Other\n\nAssistant: B"}, "no_common_prompt"),
        ({"chosen": "\n\nHuman: Q\n\nAssistant: A\n\nHuman: X\n\nAssistant: B",
          "rejected": "\n\nHuman: Q\n\nAssistant: A\n\nHuman: Y\n\nAssistant: B"}, "diverge_before_reply"),
    ],
)
def test_hh_quirks_rejected_with_reason(record, code):
    with pytest.raises(BadRecord) as e:
        normalize(record, "hh-rlhf", source="s", line=1)
    assert e.value.code == code


def test_tie_is_its_own_category():
    with pytest.raises(Tie) as e:
        norm({"prompt": "p", "chosen": "same", "rejected": "same"})
    assert e.value.category == "tie"


@pytest.mark.parametrize(
    "record, fmt, code",
    [
        ({"prompt": "p", "chosen": "c"}, "text", "missing_field"),
        ({"prompt": 3, "chosen": "c", "rejected": "r"}, "text", "bad_type"),
        ({"prompt": "p", "chosen": True, "rejected": "r"}, "text", "bad_type"),
        ({"prompt": "  ", "chosen": "c", "rejected": "r"}, "text", "empty_prompt"),
        ({"prompt": "p", "chosen": "", "rejected": "r"}, "text", "empty_reply"),
        ({"prompt": [], "chosen": [A("c")], "rejected": [A("r")]}, "conversational", "empty_prompt"),
        ({"prompt": [U("p")], "chosen": [U("c")], "rejected": [A("r")]}, "conversational", "bad_role"),
        ({"prompt": [{"role": "wizard", "content": "p"}], "chosen": [A("c")], "rejected": [A("r")]}, "conversational", "bad_role"),
        ({"prompt": [{"role": "user"}], "chosen": [A("c")], "rejected": [A("r")]}, "conversational", "bad_message"),
        ({"prompt": ["hi"], "chosen": [A("c")], "rejected": [A("r")]}, "conversational", "bad_message"),
        ({"prompt": [U(5)], "chosen": [A("c")], "rejected": [A("r")]}, "conversational", "bad_type"),
        ({"prompt": [U("p")], "chosen": [], "rejected": [A("r")]}, "conversational", "empty_reply"),
        ({"chosen": [U("p"), A("a"), U("x"), A("c")], "rejected": [U("p"), A("a"), U("y"), A("r")]}, "implicit", "diverge_before_reply"),
        ({"chosen": [A("c")], "rejected": [A("r")]}, "implicit", "no_common_prompt"),
        ({"chosen": [U("p"), A("c")], "rejected": [U("p")]}, "implicit", "no_reply"),
        ({"chosen": [U("p"), A("c")], "rejected": [U("p"), A("c")], "score_chosen": "x", "score_rejected": 1}, "ultrafeedback", "bad_type"),
        ({"chosen": [U("p"), A("c")], "rejected": [U("p"), A("r")], "score_chosen": float("nan"), "score_rejected": 1}, "ultrafeedback", "bad_value"),
        ({"input": "p", "chosen": "c", "rejected": "r", "system": 4}, "axolotl", "bad_type"),
        ({"chosen_ids": [], "rejected_ids": [1]}, "tokenized", "empty_reply"),
        ({"chosen_ids": [1, -2], "rejected_ids": [1]}, "tokenized", "bad_value"),
        ({"chosen_ids": [1, "a"], "rejected_ids": [1]}, "tokenized", "bad_value"),
        ({"chosen_ids": [1, 2], "rejected_ids": [1, 2]}, "tokenized", "tie"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}, "text", "bad_type"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": float("inf")}, "text", "bad_value"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "subset": 3}, "text", "bad_type"),
        (["not", "a", "dict"], "text", "not_an_object"),
    ],
)
def test_malformed_records(record, fmt, code):
    with pytest.raises(BadRecord) as e:
        normalize(record, fmt, source="s", line=1)
    assert e.value.code == code, e.value.message
    assert e.value.message


@pytest.mark.parametrize(
    "record", [{"foo": 1}, {"chosen": "plain", "rejected": "text"}, {"chosen": 1, "rejected": 2}]
)
def test_undetectable_layouts(record):
    with pytest.raises(BadRecord) as e:
        detect_format(record)
    assert e.value.code == "unknown_layout"


T = lambda c: {"role": "tool", "content": c}  # noqa: E731
# What a reward model cannot read its reward from, in every place a reply or a prompt arrives
NOT_A_REPLY = {"ends with the user's turn": [A("a1"), U("are you sure?")], "ends with a tool's": [A("a1"), T("42")],
               "the user's alone": [U("hi")]}
NOT_A_PROMPT = {"an assistant's alone": [A("hello")], "a tool's alone": [T("42")], "a system's alone": [S("be nice")]}


@pytest.mark.parametrize("what", sorted(NOT_A_REPLY))
def test_one_rule_for_a_reply_in_every_layout_and_in_scoring(what):
    """``check_reply``: a pair's chosen or rejected, each of K responses, a conversation to score:
    preprocess, eval, score, serve and the API refuse the same replies, by one rule."""
    from rmflow.rendering.responses import raw_responses, read_responses

    from rmflow.scoring.api import BadConversation, conversation_messages

    reply = NOT_A_REPLY[what]
    with pytest.raises(BadRecord) as e:
        norm({"prompt": [U("Q1 what?")], "chosen": reply, "rejected": [A("b1")]})
    assert e.value.code == "bad_role"
    with pytest.raises(BadRecord) as e:
        norm({"chosen": [U("Q1 what?"), *reply], "rejected": [U("Q1 what?"), A("b1")]})
    assert e.value.code in ("bad_role", "diverge_before_reply")
    record = {"prompt": "Q1 what?", "responses": [reply, [A("b1")]], "scores": [2, 1]}
    for read in (lambda: read_responses(record, "responses", source="s", line=1),
                 lambda: raw_responses(record, "responses")):
        with pytest.raises(BadRecord) as e:
            read()
        assert e.value.code == "bad_role"
    if reply[0]["role"] == "assistant":
        with pytest.raises(BadConversation, match="ends with a (user|tool) message"):
            conversation_messages([U("Q1 what?"), *reply])


@pytest.mark.parametrize("what", sorted(NOT_A_PROMPT))
def test_one_rule_for_a_prompt_in_every_layout_and_in_scoring(what):
    from rmflow.rendering.responses import read_responses

    from rmflow.scoring.api import BadConversation, conversation_messages

    prompt = NOT_A_PROMPT[what]
    with pytest.raises(BadRecord, match="no user message"):
        norm({"prompt": prompt, "chosen": [A("a")], "rejected": [A("b")]})
    with pytest.raises(BadRecord, match="no user message"):
        read_responses({"prompt": prompt, "responses": ["a", "b"], "scores": [2, 1]}, "responses", source="s", line=1)
    with pytest.raises(BadConversation, match="no user message"):
        conversation_messages([*prompt, A("a")])

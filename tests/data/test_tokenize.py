import numpy as np
import pytest
from rmflow.pipelines.tokenizer_files import load_tokenizer_assets
from rmflow.rendering.formats import BadRecord, normalize
from rmflow.rendering.tokenize import RecordTokenizer, TokenizerError, build_tokenizer

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731


def pair(prompt, chosen, rejected, fmt="conversational"):
    return normalize({"prompt": prompt, "chosen": chosen, "rejected": rejected}, fmt, source="s", line=1)


def test_reward_index_and_prompt_boundary_with_pad_equal_eos(pair_tokenizer, hf_tokenizer):
    assert hf_tokenizer.pad_token_id == hf_tokenizer.eos_token_id  # the case that matters
    p = pair([U("Hi there")], [A("Hello!")], [A("Go away, now.")])
    (tp,) = pair_tokenizer([p])
    expected_c = hf_tokenizer.apply_chat_template(
        [U("Hi there"), A("Hello!")], tokenize=True, return_dict=False
    )
    assert tp.chosen_ids.tolist() == list(expected_c)
    # Several eos (= pad) tokens inside the sequence: one per turn.
    assert (tp.chosen_ids == hf_tokenizer.pad_token_id).sum() == 3
    prompt_ids = hf_tokenizer.apply_chat_template([U("Hi there")], tokenize=True, add_generation_prompt=True,
                                                  return_dict=False)
    assert tp.prompt_len == len(prompt_ids)
    assert tp.chosen_ids[: tp.prompt_len].tolist() == list(prompt_ids)
    assert tp.rejected_ids[: tp.prompt_len].tolist() == list(prompt_ids)
    decoded = hf_tokenizer.decode(tp.chosen_ids[tp.prompt_len:].tolist())
    assert decoded == "Hello!<|im_end|>\n"


def test_prompt_len_stops_at_the_prompt_even_if_replies_share_a_start(pair_tokenizer):
    (tp,) = pair_tokenizer([pair([U("Q")], [A("Sure, yes")], [A("Sure, no")])])
    common = int(np.argmax(tp.chosen_ids != tp.rejected_ids[: len(tp.chosen_ids)]))
    assert tp.prompt_len < common  # "Sure," is shared but is reply, not prompt


def test_head_len_keeps_template_leading_tokens(pair_tokenizer, hf_tokenizer):
    (tp,) = pair_tokenizer([pair([U("Question")], [A("a")], [A("b")])])
    head = hf_tokenizer.decode(tp.chosen_ids[: tp.head_len].tolist())
    assert head.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert head.endswith("<|im_start|>user\n")
    (tp2,) = pair_tokenizer([pair([{"role": "system", "content": "Be brief."}, U("Q")], [A("a")], [A("b")])])
    assert hf_tokenizer.decode(tp2.chosen_ids[: tp2.head_len].tolist()) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )


def test_plain_text_rendered_as_user_assistant(pair_tokenizer, hf_tokenizer):
    (tp,) = pair_tokenizer([pair("Hi", "Yo", "No", fmt="text")])
    text = hf_tokenizer.decode(tp.chosen_ids.tolist())
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n")


def test_pretokenized_pairs_skip_the_template(pair_tokenizer):
    p = normalize({"chosen_ids": [5, 6, 7], "rejected_ids": [5, 6, 8, 9]}, "tokenized", source="s", line=1)
    (tp,) = pair_tokenizer([p])
    assert tp.chosen_ids.tolist() == [5, 6, 7] and tp.prompt_len == 2 and tp.head_len == 0


def test_chat_template_override_and_failure(tokenizer_dir, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                   "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = RecordTokenizer(build_tokenizer(load_tokenizer_assets(tokenizer_dir, str(tpl))))
    (tp,) = tok([pair("Hi", "Yo", "No", fmt="text")])
    assert tok.tok.decode(tp.chosen_ids.tolist()) == "[user]Hi[assistant]Yo"
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ raise_exception('only one turn allowed') if messages|length > 1 else '' }}")
    tok = RecordTokenizer(build_tokenizer(load_tokenizer_assets(tokenizer_dir, str(bad))))
    (res,) = tok([pair("Hi", "Yo", "No", fmt="text")])
    assert isinstance(res, BadRecord) and res.code == "template_error"
    assert "only one turn allowed" in res.message


def test_unknown_tokenizer_is_a_clear_error(tmp_path, tokenizer_dir):
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(TokenizerError, match="not a tokenizer folder"):
        load_tokenizer_assets(str(tmp_path))
    with pytest.raises(TokenizerError, match="--chat-template"):
        load_tokenizer_assets(tokenizer_dir, str(tmp_path / "none.jinja"))


def test_batch_matches_one_by_one(pair_tokenizer):
    pairs = [pair([U(f"Q{i}" * (i + 1))], [A("yes " * i + "!")], [A("no")]) for i in range(6)]
    batch = pair_tokenizer(pairs)
    for p, tp in zip(pairs, batch):
        (single,) = pair_tokenizer([p])
        assert tp.chosen_ids.tolist() == single.chosen_ids.tolist() and tp.prompt_len == single.prompt_len


def test_batched_rendering_matches_apply_chat_template(pair_tokenizer, hf_tokenizer):
    convs = [
        [U("Hi")],
        [{"role": "system", "content": "Be brief."}, U("Hi"), A("Hello"), U("Bye?")],
        [U("multi\nline {{ not jinja }}"), A("ok")],
    ]
    for gen in (False, True):
        assert pair_tokenizer._render_many([tuple((m["role"], m["content"]) for m in c) for c in convs], gen) == [
            hf_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=gen) for c in convs
        ]


def test_one_bad_pair_does_not_sink_its_batch(tokenizer_dir, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{% if m.content == 'BOOM' %}{{ raise_exception('no') }}{% endif %}"
                   "{{ m.content }}|{% endfor %}")
    tok = RecordTokenizer(build_tokenizer(load_tokenizer_assets(tokenizer_dir, str(tpl))))
    pairs = [pair("a", "b", "c", fmt="text"), pair("a", "BOOM", "c", fmt="text"),
             normalize({"chosen_ids": [1, 2], "rejected_ids": [1, 3]}, "tokenized", source="s", line=1)]
    out = tok(pairs)
    assert [type(o).__name__ for o in out] == ["TokenizedPair", "BadRecord", "TokenizedPair"]
    assert out[1].code == "template_error"

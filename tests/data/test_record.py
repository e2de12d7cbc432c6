import numpy as np
import pytest
from rmflow.schemas.record import MAGIC, PairRecord, RecordCorruptError, decode, encode

PAD_EQ_EOS = 2  # SmolLM2: <|im_end|> is both eos and pad


def make(**kw):
    base = dict(
        chosen_ids=np.array([1, 5, 6, PAD_EQ_EOS, 198, 1, 9, PAD_EQ_EOS, 198], np.int32),
        rejected_ids=np.array([1, 5, 6, PAD_EQ_EOS, 198, 1, 7, 7, PAD_EQ_EOS], np.int32),
        chosen_last=8, rejected_last=8, prompt_len=5, pair_id="ab" * 16, source="f.jsonl",
    )
    base.update(kw)
    return PairRecord(**base)


@pytest.mark.parametrize("extra", [{}, {"margin": 1.5}, {"subset": "chat-hard"}, {"margin": -0.25, "subset": "ü"}])
def test_round_trip(extra):
    rec = make(**extra)
    out = decode(encode(rec))
    assert out == rec
    assert out.chosen_ids.dtype == np.int32
    assert out.margin == extra.get("margin") and out.subset == extra.get("subset")


def test_reward_index_is_explicit_even_when_pad_equals_eos():
    # The pad id occurs inside the sequence (eos of each turn): searching for it would pick
    # index 3. The record says where the reward is.
    rec = decode(encode(make()))
    assert rec.chosen_last == 8 and rec.chosen_ids[rec.chosen_last] == 198
    assert rec.rejected_ids[rec.rejected_last] == PAD_EQ_EOS
    assert int(np.argmax(rec.chosen_ids == PAD_EQ_EOS)) == 3  # the trap the record avoids


def test_every_single_byte_flip_is_detected():
    buf = encode(make(margin=0.5, subset="s"))
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= 0x40
        with pytest.raises(RecordCorruptError):
            decode(bytes(bad))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:10], "shorter"),
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:4] + bytes([9]) + b[5:], "version"),
        (lambda b: b[:-4] + b"\0\0\0\0", "CRC"),
        (lambda b: b + b"\0", "CRC"),
    ],
)
def test_corruption_messages(mutate, message):
    with pytest.raises(RecordCorruptError, match=message):
        decode(mutate(encode(make())))


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"chosen_last": 9}, "chosen_last"),
        ({"rejected_last": -1}, "rejected_last"),
        ({"prompt_len": 10}, "prompt_len"),
        ({"chosen_ids": np.array([], np.int32), "chosen_last": 0}, "empty"),
        ({"pair_id": "xyz"}, "pair_id|non-hexadecimal"),
        ({"chosen_ids": np.array([[1, 2]])}, "1-D"),
        ({"chosen_ids": np.array([-1, 2, 3, 4, 5, 6, 7, 8, 9])}, "outside"),
    ],
)
def test_invalid_records_are_refused_at_encode_time(kw, message):
    with pytest.raises(ValueError, match=message):
        make(**kw)


def test_decode_is_zero_copy_view():
    buf = encode(make())
    rec = decode(buf)
    assert not rec.chosen_ids.flags.owndata  # a view into the record bytes
    assert buf[:4] == MAGIC

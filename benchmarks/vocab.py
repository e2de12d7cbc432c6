"""Tokenizers for the benchmarks: SmolLM2's (49,152 tokens, shipped with the demo) and a small
byte-level BPE trained here on the shared HH-RLHF transcripts.

The small tokenizer has 8,192 tokens, SmolLM2's special tokens (``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>``, pad = eos) and its ChatML template, so the same
preprocessing renders the same conversations with it; only the vocabulary differs. Training
it is deterministic (the same files give the same tokenizer) and takes a few seconds.

    .venv/bin/python benchmarks/vocab.py OUT_DIR [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib

from bench_common import REPO
from bench_common import SHARED_DATA as DATA

SMOLLM2 = REPO / "rmflow" / "demo" / "tokenizer"
HH_FILES = ("hh_helpful_base_test_first2000.jsonl.gz", "hh_helpful_rejection_sampled_test.jsonl.gz")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def transcripts():
    for name in HH_FILES:
        with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
            for line in f:
                pair = json.loads(line)
                yield pair["chosen"]
                yield pair["rejected"]


def build_bpe(out: pathlib.Path, vocab_size: int = 8192) -> pathlib.Path:
    """Train the byte-level BPE and save it as a Hugging Face tokenizer folder at ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(transcripts(), trainer=trainer)
    template = (SMOLLM2 / "chat_template.jinja").read_text()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=template,
                                   model_max_length=8192)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def tokenizer_folder(name: str, work: pathlib.Path) -> pathlib.Path:
    """``smollm2`` (the demo's tokenizer) or ``bpe8k`` (trained into ``work``)."""
    if name == "smollm2":
        return SMOLLM2
    if name == "bpe8k":
        return build_bpe(work / "bpe8k", 8192)
    raise SystemExit(f"unknown vocabulary {name!r}: use smollm2 or bpe8k")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--vocab-size", type=int, default=8192)
    a = ap.parse_args()
    print(build_bpe(pathlib.Path(a.out), a.vocab_size))

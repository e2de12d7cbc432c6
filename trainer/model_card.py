"""The model card of an export (its README.md, as the Hugging Face Hub shows it): what the model
is, what it was trained from and on, how, how well it did beside the length-only baseline, and
how to use it. Everything comes from the run directory; a figure the run does not hold is
said to be missing, never guessed."""

from __future__ import annotations

import os
import re
from typing import Any

from rmflow.schemas.heads import ENSEMBLE_FILE, MEMBER_FOLDER, head_of
from rmflow.schemas.kinds import ModelKind
from rmflow.schemas.manifest import MANIFEST_FILE
from rmflow.schemas.presets import is_preset
from rmflow.trainer.rundir import METRICS_FILE, RunFiles, data_manifest_sha256, manifest_sha256, read_history

RECIPE = ("max_steps", "batch_size", "grad_accum", "optimizer.learning_rate", "optimizer.schedule",
          "optimizer.warmup_steps", "optimizer.weight_decay", "center_rewards_coefficient", "objective", "attribute_weights",
          "data.packing", "model.dtype", "lora.rank", "lora.alpha", "lora.target_modules", "lora.base_dtype", "seed")


def model_card(run: RunFiles, step: int, kind: ModelKind, hf_class: str, adapter: bool = False) -> str:
    """The README.md of an export of ``run`` at ``step``, loaded by transformers as ``hf_class``
    (``adapter``: a PEFT adapter of that class's base)."""
    base = run.config.model.path
    license_ = _base_license(base)
    front = ["---", "library_name: transformers", "tags:", "- reward-model", "- rmflow", f"- {kind.name}"]
    if re.fullmatch(r"[\w.-]+/[\w.-]+", base) and not os.path.exists(base):  # a Hub id, not a local path
        front.append(f"base_model: {base}")
    if license_:
        front.append(f"license: {license_}")
    front.append("---")
    flat = run.config.to_dict()
    cfg = run.model_config
    head = head_of(cfg)
    as_scored = head.recipe(cfg)  # what the head scores by, over the options it was trained with
    recipe = [(k, as_scored.get(k, _get(flat, k))) for k in RECIPE] + \
        [(k, v) for k, v in as_scored.items() if k not in RECIPE]  # a head's own (an ensemble's members)
    what = head.describe(cfg, kind.description)
    manifest_sha = data_manifest_sha256(run.path)
    loads = (f"A PEFT adapter (and the score head) for `{hf_class}` on its base model (`adapter_config.json`)"
             if adapter else f"Loads in transformers as `{hf_class}`" if not cfg.member_layers else
             f"Loads in transformers as {cfg.members} `{hf_class}` checkpoints, one per member "
             f"(`{MEMBER_FOLDER}0` ... `{MEMBER_FOLDER}{cfg.members - 1}`, named in `{ENSEMBLE_FILE}`)")
    intro = (f"Trained with rmflow from `{base}`" + (" (random weights: a preset)" if is_preset(base) else "")
             + f", step {step}. {loads}: {what}." + _quantized_base(run, adapter))
    lines = [*front, "", f"# {os.path.basename(os.path.normpath(run.path))}: {what}", "",
             intro, "",
             "## Data", "",
             f"- shards: `{run.config.data.train}` ({run.manifest.kind}; max_length {run.manifest.max_length}, "
             f"length policy {run.manifest.length_policy})",
             *[f"- split {name}: {split.records:,} records" for name, split in sorted(run.manifest.splits.items())],
             f"- manifest sha256: `{manifest_sha}`" if manifest_sha else "- manifest sha256: not recorded by this run",
             f"- tokenizer sha256: `{run.manifest.tokenizer.sha256}`",
             *[f"- input: `{f.path}` ({f.bytes:,} bytes)" for f in run.manifest.inputs[:20]],
             "", "## Recipe", "", "| option | value |", "| --- | --- |",
             *[f"| `{k}` | {v} |" for k, v in recipe if v is not None], "",
             "## Evaluation", "", *_evaluation(run, kind), "",
             "## Usage", "", "```python", "import torch",
             f"from transformers import AutoModel{kind.head.hf_head}, AutoTokenizer", "",
             *head.loading(cfg, f"AutoModel{kind.head.hf_head}"),
             'tok = AutoTokenizer.from_pretrained("PATH")',
             'conversation = [{"role": "user", "content": "How do I boil an egg?"},',
             '                {"role": "assistant", "content": "Eight minutes in boiling water."}]',
             "ids = tok.apply_chat_template(conversation, return_tensors=\"pt\", return_dict=True)",
             "with torch.no_grad():",
             *_usage_outputs(run, kind),
             "```", "",
             "As a reward server for RL loops (native, OpenRLHF and verl endpoints): `rmflow serve PATH`.",
             "", f"License: {license_ or 'not recorded: the base model and the data set it; add it here'}.", ""]
    return "\n".join(lines)


def _quantized_base(run: RunFiles, adapter: bool) -> str:
    """What a LoRA run on a quantised base means for this export (nothing for another run)."""
    lora = run.config.lora
    if lora is None or lora.base_dtype not in ("int8", "nf4"):
        return ""
    block = f"{lora.base_block_size} weights" if lora.base_block_size else "a whole input axis"
    if not adapter:
        return (f" The frozen base was held in {lora.base_dtype} while training (a float32 scale per {block}); these "
                "weights are that base dequantised plus the adapters, in float32, so they score as the trained "
                "model did.")
    note = (f" The adapters were trained on the base held in {lora.base_dtype} (a float32 scale per {block} along "
            "each linear layer's input, the embeddings along their hidden axis)")
    if lora.base_dtype == "nf4" and lora.base_block_size == 64:
        note += (": bitsandbytes quantises a dense model's linear layers alike when their input sizes are "
                 "multiples of 64 (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\")`) but keeps "
                 "the embeddings in full precision, so its scores differ a little from the trained model's; the "
                 "merged export (without --adapter) scores exactly")
    return note + "."


def _usage_outputs(run: RunFiles, kind: ModelKind) -> list[str]:
    """The usage example's last lines: what the logits are, and the reward (the head's)."""
    return head_of(run.model_config).usage(run.model_config, kind.description)


def _get(flat: dict[str, Any], dotted: str) -> Any:
    value: Any = flat
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _evaluation(run: RunFiles, kind: ModelKind) -> list[str]:
    """The run's last evaluation (its eval split and named sets), and the length-only baseline."""
    path = os.path.join(run.path, METRICS_FILE)
    history = read_history(path) if os.path.exists(path) else []
    evals = [h for h in history if any(k.startswith("eval") for k in h)]
    if not evals:
        return ["The run logged no evaluation."]
    last = evals[-1]
    rows = [f"At step {last.get('step')}:", "", "| set | " + " | ".join(kind.headline) + " |",
            "| --- |" + " ---: |" * len(kind.headline)]
    if any(f"eval_{m}" in last for m in kind.headline):
        rows.append("| eval split | " + " | ".join(_cell(last.get(f"eval_{m}")) for m in kind.headline) + " |")
    for name in sorted({k.split("/")[1] for k in last if k.startswith("eval/")}):
        rows.append(f"| {name} | " + " | ".join(_cell(last.get(f"eval/{name}/{m}")) for m in kind.headline) + " |")
    baseline = _length_baseline(run)
    rows += ["", f"Length-only baseline on the eval split (the longer reply wins, a tie counts wrong): {baseline}."]
    return rows


def _cell(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def _length_baseline(run: RunFiles) -> str:
    """'The longer reply wins' over the eval split's pairs, read from the run's own data only (the
    folder's manifest must be the one the run trained on); said missing otherwise."""
    from rmflow.schemas.record import decode
    from rmflow.trainer.model_setup import shard_paths

    data = run.config.data.train
    if not isinstance(data, str):
        return "not computed for a mixture of data sets"
    if not os.path.isabs(data) or not os.path.exists(os.path.join(data, MANIFEST_FILE)):
        return "not available (the run's shards are not on this machine)"
    if manifest_sha256(data) != data_manifest_sha256(run.path):
        return f"not available ({data} holds other data than the run trained on)"
    import grain

    right = total = 0
    try:
        for raw in grain.sources.ArrayRecordDataSource(shard_paths(data, run.manifest, "eval")):
            rec = decode(raw)
            if getattr(rec, "chosen_ids", None) is None:
                return "not computed for these records (no chosen and rejected reply)"
            right += len(rec.chosen_ids) > len(rec.rejected_ids)
            total += 1
    except Exception as e:  # noqa: BLE001 - a shard missing or unreadable: the card says so, the export goes on
        return f"not available ({type(e).__name__}: {e})"
    return f"{right / total:.4f} on {total:,} pairs" if total else "no eval pairs"


def _base_license(base: str) -> str | None:
    """The license a local base checkpoint's own model card declares (its front matter), if any."""
    card = os.path.join(base, "README.md") if os.path.isdir(base) else None
    if not card or not os.path.exists(card):
        return None
    with open(card, encoding="utf-8", errors="replace") as f:
        text = f.read(20000)
    if not text.startswith("---"):
        return None
    for line in text.split("---", 2)[1].splitlines():
        if line.strip().startswith("license:"):
            return line.split(":", 1)[1].strip() or None
    return None

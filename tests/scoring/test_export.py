"""Export round trip: transformers' AutoModelForSequenceClassification (PyTorch) loads the
exported run and gives rmflow's rewards on the same conversations, with pad equal to eos."""

import gzip
import json
import os
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from rmflow.schemas.config import ExportConfig
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.checkpoints import load_trained_model
from rmflow.trainer.export import export
from rmflow.trainer.train import run as train
from typer.testing import CliRunner

from rmflow.cli import app
from tests import forward

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"
CONVERSATIONS = [
    [{"role": "user", "content": "How do I boil an egg?"},
     {"role": "assistant", "content": "Put it in boiling water for about eight minutes."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green, or maybe a deep red."}],
]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, demo_shards):
    base = tmp_path_factory.mktemp("export")
    shutil.copytree(demo_shards, base / "shards")  # the demo at max_length 128, preprocessed once per worker
    train(TrainConfig(data=str(base / "shards"), model="micro", output=str(base / "run"), max_steps=3, batch_size=4, optimizer={"learning_rate": 1e-3}, logging={"steps": 1}))
    return base


def rmflow_rewards(model, ids_list):
    t = max(map(len, ids_list))
    ids = np.zeros((len(ids_list), t), np.int32)
    seg = np.zeros_like(ids)
    for i, x in enumerate(ids_list):
        ids[i, : len(x)], seg[i, : len(x)] = x, 1
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), ids.shape)
    last = np.array([len(x) - 1 for x in ids_list], np.int32)
    return np.asarray(forward.rewards(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(last)))


@pytest.mark.parametrize("max_shard_bytes", [2 << 30, 4 << 20])  # single file, then sharded
def test_export_loads_in_transformers_with_identical_rewards(trained_run, tmp_path, max_shard_bytes):
    out = export(ExportConfig(run=str(trained_run / "run"), output=str(tmp_path / "hf"),
                              max_shard_gb=max_shard_bytes / 2**30))
    files = {p.name for p in pathlib.Path(out).iterdir()}
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= files
    assert ("model.safetensors.index.json" in files) == (max_shard_bytes < 2 << 30)
    config = json.loads((pathlib.Path(out) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.pad_token_id == tok.eos_token_id == config["pad_token_id"]  # the pad == eos case
    ids_list = [tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in CONVERSATIONS]
    batch = tok.pad({"input_ids": ids_list}, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = hf(**batch).logits[:, 0].numpy()
    model, _, _ = load_trained_model(str(trained_run / "run"))
    np.testing.assert_allclose(rmflow_rewards(model, ids_list), expected, atol=1e-4, rtol=0)


def test_an_export_of_a_tokenizer_without_a_pad_token_scores_a_batch_in_transformers(trained_run, tmp_path):
    """A tokenizer with no pad token: the export's pad_token_id is one that never ends a rendered
    conversation (transformers cannot score a batch without one, and reads the score at the last
    token that is not padding), and a padded batch scores as rmflow scores each conversation."""
    run = tmp_path / "run"
    shutil.copytree(trained_run / "run", run)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = run / "tokenizer" / name
        if path.exists():
            path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "pad_token"}))
    manifest = json.loads((run / "data_manifest.json").read_text())
    manifest["tokenizer"]["pad_token_id"] = None
    (run / "data_manifest.json").write_text(json.dumps(manifest))
    out = export(ExportConfig(run=str(run), output=str(tmp_path / "hf")))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    config = json.loads((pathlib.Path(out) / "config.json").read_text())
    assert tok.pad_token is None and config["pad_token_id"] == tok.eos_token_id  # SmolLM2's replies end in "\n"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ids_list = [tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in CONVERSATIONS]
    width = max(map(len, ids_list))
    ids = torch.tensor([x + [config["pad_token_id"]] * (width - len(x)) for x in ids_list])
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[:, 0].numpy()
    model, _, _ = load_trained_model(str(trained_run / "run"))
    np.testing.assert_allclose(rmflow_rewards(model, ids_list), expected, atol=1e-4, rtol=0)


def test_export_command(trained_run, tmp_path):
    result = CliRunner().invoke(app, ["export", str(trained_run / "run"), "--output", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cli" / "model.safetensors").exists()
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "cli").iterdir() if p.is_file()}
    assert set(modes.values()) == {0o666 & ~mask}, modes  # the weights too (safetensors writes them 0600)
    bad = CliRunner().invoke(app, ["export", str(tmp_path / "nothing"), "--output", str(tmp_path / "x")])
    assert bad.exit_code == 1 and "nothing does not exist: give a run directory" in " ".join(bad.output.split())


def test_eval_on_shards_raw_files_and_exported_model(trained_run, tmp_path):
    shards = trained_run / "shards"
    result = CliRunner().invoke(app, ["eval", "--model", str(trained_run / "run"), "--data", str(shards),
                                      "--output", str(tmp_path / "e1"), "--normalize"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "e1" / "eval.json").read_text())
    manifest = json.loads((shards / "manifest.json").read_text())
    assert report["metrics"]["pairs"] == manifest["splits"]["eval"]["records"]
    assert {"rewards.png", "margins.png", "calibration.png", "report.md"} <= {p.name for p in (tmp_path / "e1").iterdir()}
    norm = json.loads((trained_run / "run" / "reward_normalization.json").read_text())
    assert norm["pairs"] == report["metrics"]["pairs"]
    assert norm["mean"] == pytest.approx(report["metrics"]["reward_mean"], abs=1e-6)

    # Raw HH-RLHF transcripts, preprocessed in-process by the same pipeline, with an exported model.
    hf = export(ExportConfig(run=str(trained_run / "run"), output=str(tmp_path / "hf")))
    # the run's figures travel with the export: rmflow's file, and OpenRLHF's mean and std in config.json
    config = json.loads((pathlib.Path(hf) / "config.json").read_text())
    assert (config["mean"], config["std"]) == (norm["mean"], norm["std"]) and norm["std"] > 0
    assert json.loads((pathlib.Path(hf) / "reward_normalization.json").read_text()) == norm
    lines = gzip.open(DEMO / "hh_rlhf_helpful_sample.jsonl.gz", "rt").read().splitlines()[:24]
    lines.append(json.dumps({"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: b"}))
    (tmp_path / "raw.jsonl").write_text("\n".join(lines) + "\n")
    raw = CliRunner().invoke(app, ["eval", "--model", hf, "--data", str(tmp_path / "raw.jsonl"),
                                   "--output", str(tmp_path / "e2")])
    assert raw.exit_code == 0, raw.output
    m = json.loads((tmp_path / "e2" / "eval.json").read_text())["metrics"]
    assert m["pairs"] == 24
    assert m["input"]["counts"]["records_read"] == 25 and m["input"]["counts"]["ties"] == 1  # reported, not lost
    (tie,) = [json.loads(x) for x in (tmp_path / "e2" / "input_errors.jsonl").read_text().splitlines()]
    assert tie["category"] == "tie" and tie["line"] == 25
    assert 0.0 <= m["accuracy"] <= 1.0 and "length_bias" in m
    again = CliRunner().invoke(app, ["eval", "--model", hf, "--data", str(tmp_path / "raw.jsonl"),
                                     "--output", str(tmp_path / "e3"), "--normalize"])
    assert again.exit_code == 0, again.output
    renorm = json.loads((pathlib.Path(hf) / "reward_normalization.json").read_text())
    config = json.loads((pathlib.Path(hf) / "config.json").read_text())
    assert renorm["pairs"] == 24 and (config["mean"], config["std"]) == (renorm["mean"], renorm["std"])
    assert config["architectures"] == ["LlamaForSequenceClassification"]  # the rest of config.json kept


def test_a_base_model_is_evaluated_as_it_is(tmp_path):
    """A bare checkpoint (a causal LM, no score head) is evaluated directly: a fresh score head
    seeded with 0, the same scores every time, and the report says it is untrained."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=2)
    base = tmp_path / "base"
    transformers.LlamaForCausalLM(cfg).save_pretrained(base)
    for f in (DEMO / "tokenizer").iterdir():
        shutil.copy(f, base / f.name)
    lines = gzip.open(DEMO / "hh_rlhf_helpful_sample.jsonl.gz", "rt").read().splitlines()[:12]
    (tmp_path / "raw.jsonl").write_text("\n".join(lines) + "\n")
    reports = []
    for out in ("e1", "e2"):
        result = CliRunner().invoke(app, ["eval", "--model", str(base), "--data", str(tmp_path / "raw.jsonl"),
                                          "--output", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
        reports.append(json.loads((tmp_path / out / "eval.json").read_text()))
    m = reports[0]["metrics"]
    assert m["pairs"] == 12 and m == reports[1]["metrics"]  # seeded: the same untrained baseline each time
    assert m["reward_chosen_std"] > 0  # a real head, not zeros
    assert "fresh score head, seeded with 0: untrained" in reports[0]["config"]["model_description"]
    assert "untrained" in (tmp_path / "e1" / "report.md").read_text()


def test_score_command_matches_the_model_and_keeps_order(trained_run, tmp_path):
    lines = [json.dumps({"id": i, "messages": c}) for i, c in enumerate(CONVERSATIONS)]
    lines.insert(1, json.dumps({"id": "bad", "messages": "not a list"}))
    lines.append(json.dumps(CONVERSATIONS[0]))  # a bare message list
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["score", "--model", str(trained_run / "run"), "--input",
                                      str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                                      "--batch-size", "2"])
    assert result.exit_code == 1  # one bad line: reported, nothing lost
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == 5 and "error" in out[1] and out[1]["line"] == 2
    assert [o.get("id") for o in out] == [0, "bad", 1, 2, None]  # the error line keeps the user's id
    model, _, _ = load_trained_model(str(trained_run / "run"))
    tok = transformers.AutoTokenizer.from_pretrained(str(trained_run / "shards" / "tokenizer"))
    ids_list = [tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in CONVERSATIONS]
    expected = rmflow_rewards(model, ids_list)
    got = [out[0]["score"], out[2]["score"], out[3]["score"]]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert out[4]["score"] == pytest.approx(out[0]["score"], abs=1e-5)


def test_rewardbench_modes(trained_run, tmp_path):
    v1 = [{"prompt": f"Q{i}?", "chosen": f"A good answer {i}.", "rejected": f"No {i}.",
           "subset": "alpacaeval-easy" if i % 2 else "hep-go"} for i in range(8)]
    (tmp_path / "v1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in v1))
    r = CliRunner().invoke(app, ["eval", "--model", str(trained_run / "run"), "--data", str(tmp_path / "v1.jsonl"),
                                 "--output", str(tmp_path / "rb1"), "--mode", "rewardbench-v1"])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "rb1" / "eval.json").read_text())["metrics"]
    rb = m["rewardbench_v1"]
    assert rb["sections"]["Chat"] == pytest.approx(100 * m["subsets"]["alpacaeval-easy"]["accuracy"])
    assert rb["sections"]["Reasoning"] == pytest.approx(100 * m["subsets"]["hep-go"]["accuracy"])
    assert rb["score"] is None and not rb["complete"]  # 2 of 23 subsets: no headline score
    assert rb["partial_score"] == pytest.approx((rb["sections"]["Chat"] + rb["sections"]["Reasoning"]) / 2)
    assert "incomplete: 2 of 23 subsets" in r.output
    assert "incomplete, no overall score" in (tmp_path / "rb1" / "report.md").read_text()
    # Rows without a subset: one clear line, nothing written.
    (tmp_path / "nosub.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "subset"}) + "\n"
                                                  for r in v1))
    r = CliRunner().invoke(app, ["eval", "--model", str(trained_run / "run"), "--data", str(tmp_path / "nosub.jsonl"),
                                 "--output", str(tmp_path / "rb-nosub"), "--mode", "rewardbench-v1"])
    assert r.exit_code == 1 and "needs a 'subset' on every pair; 8 of 8" in r.output, r.output
    assert not (tmp_path / "rb-nosub" / "report.md").exists()

    v2 = [{"prompt": f"Q{i}?", "chosen": [f"Right {i}"], "rejected": [f"W{i}a", f"W{i}b", f"W{i}c"],
           "subset": "Focus"} for i in range(3)]
    ties = [{"id": "ref:0", "prompt": "Name a colour.", "chosen": ["Red."], "rejected": ["A dog.", "Seven."],
             "num_correct": 1, "subset": "Ties"},
            {"id": "tied:0", "prompt": "Name a colour.", "chosen": ["Red.", "Blue.", "Green."],
             "rejected": ["A dog.", "Seven."], "num_correct": 3, "subset": "Ties"}]
    (tmp_path / "v2.jsonl").write_text("".join(json.dumps(x) + "\n" for x in v2 + ties))
    r = CliRunner().invoke(app, ["eval", "--model", str(trained_run / "run"), "--data", str(tmp_path / "v2.jsonl"),
                                 "--output", str(tmp_path / "rb2"), "--mode", "rewardbench-v2"])
    assert r.exit_code == 0, r.output
    m2 = json.loads((tmp_path / "rb2" / "eval.json").read_text())["metrics"]
    assert "checkpoint step 3" in (tmp_path / "rb2" / "report.md").read_text()  # names the weights it scored
    # Same completions through `rmflow score`: the credit must follow from those scores.
    convs = [{"messages": [{"role": "user", "content": x["prompt"]}, {"role": "assistant", "content": c}]}
             for x in v2 for c in x["chosen"] + x["rejected"]]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    CliRunner().invoke(app, ["score", "--model", str(trained_run / "run"), "--input", str(tmp_path / "c.jsonl"),
                             "--output", str(tmp_path / "s.jsonl")])
    s = np.array([json.loads(x)["score"] for x in (tmp_path / "s.jsonl").read_text().splitlines()]).reshape(3, 4)
    expected = np.mean([1.0 if row[0] > row[1:].max() else 0.0 for row in s])
    assert m2["examples"] == 5 and m2["rewardbench_v2"]["subsets"]["Focus"]["accuracy"] == pytest.approx(expected)
    # The Ties records score every answer, by RewardBench 2's Ties rule over the same scores
    from rmflow.eval.rewardbench import ties_score

    convs = [{"messages": [{"role": "user", "content": x["prompt"]}, {"role": "assistant", "content": c}]}
             for x in ties for c in x["chosen"] + x["rejected"]]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    CliRunner().invoke(app, ["score", "--model", str(trained_run / "run"), "--input", str(tmp_path / "t.jsonl"),
                             "--output", str(tmp_path / "ts.jsonl")])
    t = [json.loads(x)["score"] for x in (tmp_path / "ts.jsonl").read_text().splitlines()]
    want = ties_score([("ref:0", 1, np.array(t[:3])), ("tied:0", 3, np.array(t[3:]))])["score"]
    assert m2["rewardbench_v2"]["subsets"]["Ties"]["accuracy"] == pytest.approx(want, abs=1e-6)
    # a record that cannot be scored is skipped and counted, never the end of the eval, and said
    bad = ["{not json", json.dumps({**v2[0], "rejected": []}), json.dumps({**v2[0], "chosen": [None]}),
           json.dumps({**v2[0], "rejected": ["word " * 30000] * 3})]
    (tmp_path / "v2bad.jsonl").write_text("".join(json.dumps(x) + "\n" for x in v2) + "\n".join(bad) + "\n")
    r = CliRunner().invoke(app, ["eval", "--model", str(trained_run / "run"), "--data", str(tmp_path / "v2bad.jsonl"),
                                 "--output", str(tmp_path / "rb2bad"), "--mode", "rewardbench-v2"])
    assert r.exit_code == 0 and "4 records skipped" in r.output, r.output
    m3 = json.loads((tmp_path / "rb2bad" / "eval.json").read_text())["metrics"]
    assert m3["examples"] == 3 and m3["skipped"]["reasons"] == {"bad_json": 1, "not_rewardbench2": 2, "too_long": 1}
    assert "4 records skipped, so the score is not over the whole benchmark" in \
        (tmp_path / "rb2bad" / "report.md").read_text()


def test_an_export_carries_a_model_card_from_its_run(trained_run, tmp_path):
    """README.md in the export: front matter for the Hub, the base, the data with its manifest's
    and tokenizer's hashes, the recipe, the run's last evaluation beside the length-only baseline
    (computed from the eval split), and how to use it."""
    import grain
    from rmflow.schemas.record import decode
    from rmflow.trainer.model_setup import read_manifest, shard_paths
    from rmflow.trainer.rundir import read_history

    out = pathlib.Path(export(ExportConfig(run=str(trained_run / "run"), output=str(tmp_path / "hf"))))
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "- reward-model" in card
    manifest = read_manifest(str(trained_run / "shards"))
    assert manifest.tokenizer.sha256 in card and "`LlamaForSequenceClassification`" in card
    import hashlib  # the data set's identity: its manifest file's bytes, as a mixture records it

    assert hashlib.sha256((trained_run / "shards" / "manifest.json").read_bytes()).hexdigest() in card
    assert "| `optimizer.learning_rate` | 0.001 |" in card and "| `max_steps` | 3 |" in card
    last = [h for h in read_history(str(trained_run / "run" / "metrics.jsonl")) if "eval_accuracy" in h][-1]
    assert f"| eval split | {last['eval_accuracy']:.4f} | {last['eval_pairs']} |" in card
    recs = [decode(r) for r in grain.sources.ArrayRecordDataSource(shard_paths(str(trained_run / "shards"), manifest,
                                                                              "eval"))]
    longer = sum(len(r.chosen_ids) > len(r.rejected_ids) for r in recs) / len(recs)
    assert f"(the longer reply wins, a tie counts wrong): {longer:.4f} on {len(recs):,} pairs" in card
    assert "AutoModelForSequenceClassification" in card and "rmflow serve PATH" in card
    from tests.project.test_docs import wrong_flags

    assert wrong_flags(card) == []  # every command it shows runs as written


def test_push_to_hub_uploads_the_export_or_says_in_one_line_why_not(trained_run, tmp_path, monkeypatch):
    """--push-to-hub: the export is made, then its folder uploaded to the repository (created
    private if missing); unreachable (offline here), one line says so and the export is kept
    whole. The upload's calls are checked against a stand-in for the Hub's client: this machine
    cannot reach the Hub."""
    import huggingface_hub
    from rmflow.trainer.export import ExportError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ExportError, match=r"--push-to-hub me/rm: the upload failed .*upload it later with `hf upload"):
        export(ExportConfig(run=str(trained_run / "run"), output=str(tmp_path / "offline"), push_to_hub="me/rm"))
    assert {"config.json", "README.md", "model.safetensors"} <= {p.name for p in (tmp_path / "offline").iterdir()}

    calls = []

    class Hub:  # what HfApi is asked, and the folder as it stood when uploaded
        def create_repo(self, repo, **kw):
            calls.append(("create", repo, kw))

        def upload_folder(self, folder_path, repo_id, **kw):
            calls.append(("upload", repo_id, sorted(p.name for p in pathlib.Path(folder_path).iterdir())))
            return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    out = export(ExportConfig(run=str(trained_run / "run"), output=str(tmp_path / "hub"), push_to_hub="me/rm"))
    assert calls[0] == ("create", "me/rm", {"private": True, "exist_ok": True})
    assert calls[1][:2] == ("upload", "me/rm") and {"README.md", "config.json", "model.safetensors"} <= set(calls[1][2])
    assert out == str(tmp_path / "hub")
    with pytest.raises(Exception, match="owner/name"):
        ExportConfig(run="r", output="o", push_to_hub="no-owner")

"""The train config as a tree of sections: one definition per option read as YAML (nested or
dotted), --set, a stored run's config.json, and the resume check."""

import json

import pytest
from rmflow.schemas.options import ConfigError, leaves
from rmflow.schemas.train_config import LoraConfig, OptimizerConfig, TrainConfig

BASE = {"data": "d", "model": "micro", "output": "o"}


def test_nested_dotted_and_scalar_forms_are_one_config():
    nested = TrainConfig.from_dict({**BASE, "optimizer": {"learning_rate": 3e-4, "schedule": "cosine"},
                                    "data": {"train": "d", "packing": "pack"}, "mesh": {"fsdp": 2}})
    dotted = TrainConfig.from_dict({"data.train": "d", "data.packing": "pack", "model.path": "micro", "output": "o",
                                    "optimizer.learning_rate": 3e-4, "optimizer.schedule": "cosine", "mesh.fsdp": 2})
    overridden = TrainConfig.from_dict(BASE).with_overrides(
        ["optimizer.learning_rate=3e-4", "optimizer.schedule=cosine", "data.packing=pack", "mesh.fsdp=2"])
    assert nested == dotted == overridden
    assert nested.optimizer == OptimizerConfig(learning_rate=3e-4, schedule="cosine")
    assert TrainConfig.from_dict(json.loads(nested.to_json())) == nested  # stored and read back
    # a mixture under data.train keeps the dots of its folders; a section set by its scalar form
    mix = TrainConfig.from_dict({**BASE, "data": {"train": {"../shards/v1.2": 1, "b": 3}}})
    assert [s.path for s in mix.sources] == ["../shards/v1.2", "b"]
    assert TrainConfig.from_dict(BASE).with_overrides(["data=x=1,y=3"]).sources[1].weight == 3


def test_a_key_outside_the_tree_is_refused_naming_the_known_ones():
    """No layout but the sections is read: a top-level key that is an option's name elsewhere
    (``learning_rate``) is unknown, in a file, in --set and in a stored config alike."""
    for key in ("learning_rate", "mesh_fsdp", "ranking_loss"):
        with pytest.raises(ConfigError, match=rf"unknown TrainConfig keys \['{key}'\]; known: \[.*'optimizer'"):
            TrainConfig.from_dict({**BASE, key: 1})
        with pytest.raises(ConfigError, match=f"--set '{key}=1': use key=value with a key from"):
            TrainConfig.from_dict(BASE).with_overrides([f"{key}=1"])
    cfg = TrainConfig.from_dict({**BASE, "lora": {"rank": 4, "target_modules": ["q_proj"]}})
    assert cfg.lora == LoraConfig(rank=4, target_modules=("q_proj",))
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_errors_name_the_option_by_its_path():
    for spec, said in (({"optimizer": {"learning_rate": "x"}}, "optimizer.learning_rate 'x': must be a finite number"),
                       ({"mesh": {"data": 0}}, r"data, fsdp, tensor, expert, context = \(0, 1, 1, 1, 1\)"),
                       ({"lora": {"rank": 0}}, "lora.rank 0"),
                       ({"optimizer": 3}, "optimizer 3: a mapping of learning_rate"),
                       ({"data": {"train": "d", "sets": 1}}, r"data: unknown DataConfig keys \['sets'\]"),
                       ({"checkpoint": {"save_steps": 6, "metric_for_best": "eval_loss"}, "eval_steps": 4},
                        "checkpoint.save_steps 6 must be a multiple of eval_steps 4")):
        with pytest.raises(ConfigError, match=said):
            TrainConfig.from_dict({**BASE, **spec})
    with pytest.raises(ConfigError, match=r"--set 'nope=1': use key=value with a key from \[.*'optimizer.schedule'"):
        TrainConfig.from_dict(BASE).with_overrides(["nope=1"])


def test_resume_changes_ignore_where_a_run_logs_and_count_lora_as_one_option():
    cfg = TrainConfig.from_dict(BASE)
    free = cfg.with_overrides(["logging.steps=3", "checkpoint.save_steps=5", "mesh.fsdp=2", "model.attention=xla",
                               "output=elsewhere"])
    assert free.resume_changes(cfg.to_dict()) == {}
    # the loader's saved position is per worker process: another count is named, as another model is
    assert cfg.with_overrides(["data.workers=2"]).resume_changes(cfg.to_dict()) == {"data.workers": (0, 2)}
    changed = cfg.with_overrides(["optimizer.learning_rate=1e-4", "lora.rank=2"]).resume_changes(cfg.to_dict())
    assert set(changed) == {"optimizer.learning_rate", "lora"} and changed["lora"][0] is None
    # every option says whether a resumed run may change it: the sections' trajectory options do not
    free_paths = {leaf.path for leaf in leaves(TrainConfig) if leaf.resume_free}
    assert "optimizer.learning_rate" not in free_paths and "logging.steps" in free_paths


def test_what_a_break_it_pass_found_stays_fixed():
    """Inputs easy to mishandle: each read as meant, or refused in one line by its path."""
    # an optional section given as {} is absent; --set lora=none removes it
    assert TrainConfig.from_dict({**BASE, "lora": {}}).lora is None
    on = TrainConfig.from_dict({**BASE, "lora": {"rank": 2}})
    assert on.with_overrides(["lora=none"]).lora is None and on.with_overrides(["lora.rank=4"]).lora.rank == 4
    # the same projections in another order are no change on resume
    stored = {**BASE, "lora": {"rank": 2, "target_modules": ["v_proj", "q_proj"]}}
    again = TrainConfig.from_dict({**BASE, "lora": {"rank": 2, "target_modules": ["q_proj", "v_proj"]}})
    assert again.resume_changes(stored) == {}
    # the base's storage is an option of its own (the adapters keep their shapes; the run another trajectory)
    assert on.with_overrides(["lora.base_dtype=nf4"]).resume_changes(on.to_dict()) == {
        "lora.base_dtype": ("float32", "nf4")}
    for spec, said in (({"lora": True, "lora.rank": 4}, "lora True: a mapping of rank"),
                       ({"optimizer": [1], "optimizer.learning_rate": 1e-4}, r"optimizer \[1\]: a mapping"),
                       ({"data": {"train": "d", "eval": "abc"}}, r"^data.eval 'abc'"),
                       ({"optimizer": {"learning_rate": "1e-4"}}, "YAML reads 1e-4 as text: write 1.0e-4")):
        with pytest.raises(ConfigError, match=said):
            TrainConfig.from_dict({**BASE, **spec})


def test_one_option_given_twice_is_refused_however_spelled(tmp_path):
    """Nested and dotted are two spellings of one option, and a YAML mapping with a key twice is
    one option twice: refused, never the last one silently; a flag still replaces the file's value."""
    from rmflow.schemas.options import flatten
    from typer.testing import CliRunner

    from rmflow.cli import app
    from rmflow.workflow import read_yaml_mapping

    for spec in ({**BASE, "optimizer": {"learning_rate": 3e-4}, "optimizer.learning_rate": 5e-4},
                 {**BASE, "optimizer.learning_rate": 5e-4, "optimizer": {"learning_rate": 3e-4}}):
        with pytest.raises(ConfigError, match="optimizer.learning_rate given twice"):
            TrainConfig.from_dict(spec)
        with pytest.raises(ConfigError, match="given twice"):
            flatten(TrainConfig, spec)
    (tmp_path / "d.yaml").write_text("batch_size: 4\nbatch_size: 8\n")
    with pytest.raises(ConfigError, match="'batch_size' given twice"):
        read_yaml_mapping(str(tmp_path / "d.yaml"), "--config d.yaml", "a mapping")
    # a YAML merge key is YAML's: the mapping merged in, a key beside it overriding the merged one
    (tmp_path / "m.yaml").write_text("base: &b {learning_rate: 1.0e-4, warmup_steps: 3}\n"
                                     "optimizer: {<<: *b, learning_rate: 3.0e-4}\n")
    assert read_yaml_mapping(str(tmp_path / "m.yaml"), "--config m.yaml", "a mapping")["optimizer"] == \
        {"learning_rate": 3e-4, "warmup_steps": 3}
    (tmp_path / "n.yaml").write_text("optimizer:\n  learning_rate: 3.0e-4\noptimizer.learning_rate: 5.0e-4\n")
    r = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "n.yaml"), "--data", "d", "--model", "micro",
                                 "-o", str(tmp_path / "run")])
    assert r.exit_code == 2 and "given twice" in r.output and not (tmp_path / "run").exists()
    flat = flatten(TrainConfig, {**BASE, "optimizer": {"learning_rate": 3e-4}, "lora": None})
    assert flat == {"data.train": "d", "model.path": "micro", "output": "o", "optimizer.learning_rate": 3e-4,
                    "lora": None}
    assert TrainConfig.from_dict({**flat, "optimizer.learning_rate": 1e-5, "data.train": "e"}).optimizer.learning_rate \
        == 1e-5  # what a flag does to the file's value

import json
import re

import pytest
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.options import help_for
from typer.testing import CliRunner

from rmflow.cli import app

runner = CliRunner()
SAMPLE = "rmflow/demo/hh_rlhf_helpful_sample.jsonl.gz"


def flat(text: str) -> str:
    return re.sub(r"[\s│]+", " ", text)


def test_preprocess_command_success_then_refusal(tmp_path, tokenizer_dir):
    args = ["preprocess", "--input", SAMPLE, "--tokenizer", tokenizer_dir, "--output", str(tmp_path / "o"),
            "--max-length", "512", "--num-shards", "1", "--job_name", "passed-through-to-beam"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = flat(result.output)
    assert "records read" in out and "500" in out and "train token lengths" in out
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["max_length"] == 512 and config["beam_args"] == ["--job_name", "passed-through-to-beam"]
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert stats["counts"]["records_read"] == 500
    assert f"{stats['counts']['pairs_written']} (" in out.replace(",", "")
    again = runner.invoke(app, args)
    assert again.exit_code == 1 and "--overwrite" in flat(again.output)


@pytest.mark.parametrize(
    "extra, message",
    [(["--length-policy", "chop"], "length_policy 'chop'"), (["--eval-fraction", "1.5"], "eval_fraction"),
     (["--format", "csv"], "format 'csv'")],
)
def test_invalid_options_exit_2_with_a_message(tmp_path, tokenizer_dir, extra, message):
    result = runner.invoke(app, ["preprocess", "--input", SAMPLE, "--tokenizer", tokenizer_dir,
                                 "--output", str(tmp_path / "o"), *extra])
    assert result.exit_code == 2 and message in flat(result.output)


def test_help_text_comes_from_the_config(tmp_path):
    result = runner.invoke(app, ["preprocess", "--help"], terminal_width=400)
    text = flat(result.output)
    for field in ("max_length", "length_policy", "dedup", "max_bad_fraction", "eval_fraction"):
        assert flat(help_for(PreprocessConfig, field)) in text, field


def test_cli_options_are_their_config_fields():
    """Every option of every command is generated from its config's fields: the same name,
    help and default (a train flag's default is left to --config and the field); a default or a
    text copied into the CLI could drift, these cannot. Every field has its option, but the Beam
    options a command passes through."""
    import typer.main
    from rmflow.schemas.config import EvalConfig, ExportConfig, PreprocessConfig, ScoreConfig, ServeConfig
    from rmflow.schemas.options import leaves
    from rmflow.schemas.train_config import TrainConfig

    from rmflow.cli import app

    own = {"preprocess": {"ctx", "detach", "verbose"}, "score": {"ctx"},
           "train": {"config", "set_", "resume", "plan", "allow_config_change"}}
    for name, cls in (("preprocess", PreprocessConfig), ("eval", EvalConfig), ("score", ScoreConfig),
                      ("serve", ServeConfig), ("export", ExportConfig), ("train", TrainConfig)):
        fields = {leaf.path.replace(".", "__"): leaf for leaf in leaves(cls)}
        params = typer.main.get_command(app).commands[name].params
        assert not {p.name for p in params} - set(fields) - own.get(name, set()) - {"help"}, name
        assert set(fields) - {p.name for p in params} <= {"beam_args"}, name
        for p in params:
            leaf = fields.get(p.name)
            if leaf is None:
                continue
            assert p.help.startswith(leaf.help), (name, p.name)
            default = tuple(p.default) if isinstance(p.default, list) else p.default
            if name == "train":
                assert default is None and "[default: " in p.help, (name, p.name)
            elif not p.required:
                assert default == leaf.default, (name, p.name, p.default, leaf.default)


def test_no_help_text_holds_brackets_rich_would_eat():
    """typer renders help with rich, which reads ``[serve]`` as markup and drops it ("pip install
    'rmflow[serve]'" would print as "pip install 'rmflow'"): no command's or option's help holds one."""
    import re

    import typer.main

    from rmflow.cli import app

    found = []
    for name, cmd in typer.main.get_command(app).commands.items():
        texts = [("doc", cmd.help or "")] + [(p.name, getattr(p, "help", None) or "") for p in cmd.params]
        found += [f"{name} {where}: {m}" for where, text in texts for m in re.findall(r"\[[^\]\s]*\]", text)]
    assert not found, "rich would drop these from --help; write them without brackets:\n" + "\n".join(found)


def test_every_option_of_a_command_reaches_its_config(tmp_path):
    """A flag given reaches the config under its own option: every train flag, dotted, sets its
    option (checked on the config the command builds), and flags win over --config, --set over
    both; an unknown key is refused in one line naming the known ones."""
    import yaml
    from rmflow.schemas import train_config

    built = []

    class Stop(Exception):
        pass

    real = train_config.TrainConfig.from_dict.__func__

    def spy(cls, data):
        cfg = real(cls, data)
        built.append(cfg)
        return cfg

    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"optimizer": {"learning_rate": 1e-4, "warmup_steps": 3},
                                                     "batch_size": 8, "mesh.fsdp": 2}))
    import unittest.mock as mock

    with mock.patch.object(train_config.TrainConfig, "from_dict", classmethod(spy)), \
            mock.patch("rmflow.eval.sets.preprocess_eval_sets", side_effect=Stop):
        r = runner.invoke(app, ["train", "--data", "d", "--model", "micro", "-o", "o", "--config",
                                str(tmp_path / "t.yaml"), "--optimizer.learning-rate", "3e-4", "--batch-size", "4",
                                "--lora.rank", "2", "--model.gradient-checkpointing", "--data.eval", "x=y",
                                "--lora.target-modules", "q_proj,v_proj", "--lora.target-modules", "o_proj",
                                "--set", "batch_size=2", "--set", "logging.report_to=none"])
    assert isinstance(r.exception, Stop), r.output
    cfg = built[-1]
    assert (cfg.optimizer.learning_rate, cfg.optimizer.warmup_steps, cfg.batch_size, cfg.mesh.fsdp) == (3e-4, 3, 2, 2)
    assert cfg.lora.rank == 2 and cfg.model.gradient_checkpointing and cfg.data.eval == {"x": ["y"]}
    assert cfg.lora.target_modules == ("q_proj", "v_proj", "o_proj")  # a list flag: repeated, or comma-separated
    assert cfg.logging.report_to == () and cfg.data.train == "d" and cfg.model.path == "micro"
    (tmp_path / "old.yaml").write_text("learning_rate: 1.0e-4\nsave_total_limit: 3\n")
    for args, said in ((["--config", str(tmp_path / "old.yaml")], "unknown TrainConfig keys ['learning_rate', "
                        "'save_total_limit']; known: ["),
                       (["--set", "logging_steps=5"], "--set 'logging_steps=5': use key=value with a key from")):
        r = runner.invoke(app, ["train", "--data", "d", "--model", "micro", "-o", "o", *args])
        assert r.exit_code == 2 and said in flat(r.output) and len(r.output.strip().splitlines()) == 1, r.output


def test_the_configuration_reference_is_generated_and_current():
    """docs/reference/config.md is what rmflow.reference generates from the dataclasses (`make
    reference` writes it): it names every option of every command."""
    import pathlib

    from rmflow.schemas.options import leaves
    from rmflow.schemas.train_config import TrainConfig

    from rmflow.reference import generate

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md").read_text()
    assert text == generate(), "docs/reference/config.md is stale: run `make reference`"
    assert all(f"| `{leaf.path}` |" in text for leaf in leaves(TrainConfig))


def test_a_flag_neither_the_command_nor_beam_knows_is_refused_with_the_nearest(tmp_path):
    """preprocess and score --runner pass other flags to Beam, which silently drops what it does
    not know: a misspelt option (``--max-lenght 64``) would run with its default. Refused in one
    line naming the nearest flag of the command; a real Beam option passes."""
    from rmflow.pipelines.runner import UnknownOption, runner_options
    from rmflow.schemas.options import command_flags

    flags = command_flags(PreprocessConfig)
    with pytest.raises(UnknownOption, match="--max-lenght is neither .* did you mean --max-length"):
        runner_options(["--max-lenght", "64"], "DirectRunner", flags, "preprocess")
    opts = runner_options(["--direct_num_workers=2", "--temp_location", "/tmp"], "DirectRunner", flags, "preprocess")
    assert opts.get_all_options()["direct_num_workers"] == 2
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    for args, said in ((["preprocess", "-i", str(data), "--tokenizer", "t", "-o", str(tmp_path / "o"),
                         "--max-lenght", "64"], "did you mean --max-length?"),
                       (["score", "--model", "m", "-i", str(data), "-o", str(tmp_path / "s"), "--runner",
                         "DirectRunner", "--batchsize", "3"], "did you mean --batch-size?")):
        r = runner.invoke(app, args)
        assert r.exit_code != 0 and said in r.output.replace("\n", " "), r.output
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()

import json
import re

import pytest
from rmflow.schemas.config import PreprocessConfig, help_for
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
    """Every option of preprocess, eval, score and serve that names a config field has that field's default
    and help: a default or a text copied into the CLI could drift; these cannot."""
    import dataclasses

    import typer.main
    from rmflow.schemas.config import EvalConfig, PreprocessConfig, ScoreConfig, ServeConfig

    from rmflow.cli import app

    for name, cls in (("preprocess", PreprocessConfig), ("eval", EvalConfig), ("score", ScoreConfig),
                      ("serve", ServeConfig)):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        params = typer.main.get_command(app).commands[name].params
        checked = 0
        for p in params:
            field = fields.get(p.name) if cls is not PreprocessConfig else \
                fields.get(p.name) or fields.get({"input": "inputs"}.get(p.name, ""))
            if field is None:
                continue
            checked += 1
            assert p.help == field.metadata["help"], (name, p.name)
            if not p.required:
                assert p.default == field.default, (name, p.name, p.default, field.default)
        assert checked == len(fields) - ("beam_args" in fields), (name, checked)  # beam_args: the rest


def test_no_help_text_holds_brackets_rich_would_eat():
    """typer renders help with rich, which reads ``[serve]`` as markup and drops it (the serve
    command's help once said "pip install 'rmflow'"): no command's or option's help holds one."""
    import re

    import typer.main

    from rmflow.cli import app

    found = []
    for name, cmd in typer.main.get_command(app).commands.items():
        texts = [("doc", cmd.help or "")] + [(p.name, getattr(p, "help", None) or "") for p in cmd.params]
        found += [f"{name} {where}: {m}" for where, text in texts for m in re.findall(r"\[[^\]\s]*\]", text)]
    assert not found, "rich would drop these from --help; write them without brackets:\n" + "\n".join(found)


def test_the_readme_lists_every_preprocess_option():
    """The README's configuration reference is a copy of the command's options: it cannot drift."""
    import pathlib

    import typer.main

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Configuration reference", 1)[1].split("\n### ", 1)[0]
    command = typer.main.get_command(app).commands["preprocess"]
    flags = [next(o for o in p.opts if o.startswith("--")) for p in command.params if p.opts]
    missing = [f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", section)
               and f not in ("--detach", "--verbose", "--help")]
    assert not missing, f"add to the README's preprocess configuration reference: {missing}"


def test_every_option_of_a_command_reaches_its_config():
    """A command's config is built from its options by name (``cli._config``): an option that
    is no field of the config, and not one of the few a command uses itself, would be dropped
    without a word."""
    import dataclasses

    import typer
    from rmflow.schemas.config import EvalConfig, ExportConfig, PreprocessConfig, ScoreConfig, ServeConfig

    from rmflow.cli import app

    own = {"preprocess": {"input", "detach", "verbose"}}  # input: the config's inputs, given by the command
    group = typer.main.get_command(app)
    for name, cls in (("preprocess", PreprocessConfig), ("eval", EvalConfig), ("score", ScoreConfig),
                      ("serve", ServeConfig), ("export", ExportConfig)):
        fields = {f.name for f in dataclasses.fields(cls)}
        options = {p.name for p in group.commands[name].params}
        assert not options - fields - own.get(name, set()), (name, sorted(options - fields - own.get(name, set())))

"""The `rmflow` command line. Option help comes from the config dataclasses (one source of truth)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import signal
import warnings

import typer
from rich.console import Console
from rich.table import Table

from rmflow.cli_options import config_options, parameter
from rmflow.schemas import jsontext
from rmflow.schemas.config import (
    ConfigError,
    EvalConfig,
    ExportConfig,
    PreprocessConfig,
    ScoreConfig,
    ServeConfig,
)
from rmflow.schemas.errors import RmflowError, RmflowWarning
from rmflow.schemas.heads import ENSEMBLE_FILE, MEMBER_FOLDER
from rmflow.schemas.kinds import OUTCOME, kind_named
from rmflow.schemas.outputs import EXPORT_INFO, REPORT_FILE
from rmflow.schemas.stops import unwinding
from rmflow.schemas.train_config import TrainConfig

app = typer.Typer(
    name="rmflow",
    help="Reward-model training workflow: preprocess preference data, train, evaluate, export.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True, soft_wrap=True)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    console.print(f"[yellow]warning:[/yellow] {_escape(str(message))}")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def command(name: str | None = None, **kwargs):
    """An `rmflow` command whose errors the user can act on print as one line: a bad option
    (ConfigError) exits 2, any other RmflowError or an unreadable or unwritable path exits 1.
    RmflowWarnings print as one ``warning:`` line each. Anything else is a bug: traceback."""

    def register(fn):
        verb = (name or fn.__name__).strip("_")

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            # Beam logs a failing step's traceback at ERROR before raising; the error reaches the
            # user as one line below (preprocess --verbose shows Beam's log).
            logging.getLogger("apache_beam").setLevel(logging.CRITICAL)
            with warnings.catch_warnings():
                warnings.simplefilter("always", RmflowWarning)
                warnings.showwarning = _show_warning
                received: list[int] = []  # the signals that asked this command to stop
                try:
                    with unwinding(received):
                        out = fn(*args, **kw)
                    if received:  # asked to stop as it finished: what it published is whole
                        console.print(f"[red]{verb} stopped[/red] by {signal.Signals(received[-1]).name} after "
                                      "its output was complete")
                        raise typer.Exit(128 + received[-1])
                    return out
                except KeyboardInterrupt as e:  # SIGINT, or SIGTERM (below), outside a training loop
                    signum = received[-1] if received else signal.SIGINT
                    console.print(f"[red]{verb} interrupted[/red] by {signal.Signals(signum).name}: nothing it "
                                  "was writing was published")
                    raise typer.Exit(128 + signum) from e
                except ConfigError as e:
                    console.print(f"[red]error:[/red] {_escape(str(e))}")
                    raise typer.Exit(2) from e
                except RmflowError as e:
                    stopped = getattr(e, "exit_code", None)  # a run a signal stopped at a step boundary
                    console.print(f"[red]{verb} {'stopped' if stopped else 'failed'}:[/red] {_escape(str(e))}")
                    raise typer.Exit(stopped or 1) from e
                except ModuleNotFoundError as e:  # an extra not installed: say which (anything else is a bug)
                    extra = extra_providing(e.name or "", COMMAND_EXTRA.get(verb))
                    if extra is None:
                        raise
                    console.print(f"[red]{verb} failed:[/red] " + _escape(
                        f"it needs {e.name.split('.')[0]}, which rmflow's {extra} extra installs: "
                        f"pip install 'rmflow[{extra}]'"))
                    raise typer.Exit(1) from e
                except OSError as e:  # a path the user gave: missing, a folder, not writable ...
                    where = f": {e.filename}" if e.filename else ""
                    console.print(f"[red]{verb} failed:[/red] {_escape((e.strerror or str(e)) + where)}")
                    raise typer.Exit(1) from e

        return app.command(name=name, **kwargs)(wrapper)

    return register


# Import names whose distribution is named otherwise (the rest: '_' read as '-').
DISTRIBUTION_OF = {"yaml": "pyyaml", "orbax": "orbax-checkpoint", "google": "apache-beam"}
# The extra each command runs under (pyproject.toml's optional dependencies).
COMMAND_EXTRA = {"preprocess": "preprocess", "train": "train", "eval": "train", "export": "train", "score": "train",
                 "serve": "serve", "run": "all"}
STAGE_EXTRAS = ("preprocess", "train", "serve", "all")


def extra_providing(module: str, preferred: str | None = None) -> str | None:
    """Which of rmflow's extras (read from its installed metadata) installs the distribution
    ``module`` comes from: ``preferred`` (the command's own) when it does, else the first stage
    extra that does, else the smallest other; None when none does (the missing module is a bug)."""
    import importlib.metadata
    import re

    top = module.split(".")[0]
    wanted = re.sub(r"[-_.]+", "-", DISTRIBUTION_OF.get(top, top)).lower()
    try:
        requires = importlib.metadata.requires("rmflow") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    direct: dict[str, set[str]] = {}  # extra -> distributions (and rmflow[...] extras) it names
    for line in requires:
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", line)
        if not extra:
            continue
        name = re.match(r"\s*([A-Za-z0-9._-]+)(\[[^]]*\])?", line)
        deps = direct.setdefault(extra.group(1), set())
        if name.group(1).lower() == "rmflow":
            deps |= {f"rmflow[{x.strip()}]" for x in (name.group(2) or "[]")[1:-1].split(",") if x.strip()}
        else:
            deps.add(re.sub(r"[-_.]+", "-", name.group(1)).lower())

    def installs(extra: str, seen=()) -> set[str]:
        out = set()
        for dep in direct.get(extra, ()):
            inner = dep[7:-1] if dep.startswith("rmflow[") else None
            out |= installs(inner, (*seen, extra)) if inner and inner not in seen else {dep}
        return out

    offering = [e for e in (preferred, *STAGE_EXTRAS) if e in direct and wanted in installs(e)]
    others = sorted((len(installs(e)), e) for e in direct if wanted in installs(e))
    return offering[0] if offering else others[0][1] if others else None


@app.callback()
def main() -> None:
    """rmflow: reward models from human preference pairs."""
    from rmflow.trainer.backend import configure_xla

    configure_xla()  # before any command starts JAX


@command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Any other --option is a Beam pipeline option and is passed to Beam unchanged, "
    "e.g. --runner DataflowRunner --project P --region R --temp_location gs://B/tmp.",
)
@config_options(PreprocessConfig, exclude=("beam_args",), extra=(
    parameter("ctx", typer.Context, inspect.Parameter.empty),
    parameter("detach", bool, typer.Option(False, "--detach", help="Submit the job and return (remote runners): the "
                                           "job finalises itself and writes COMPLETED when the output is complete.")),
    parameter("verbose", bool, typer.Option(False, "--verbose", "-v", help="Show Beam's log.")),
))
def preprocess(options: dict, ctx: typer.Context, detach: bool, verbose: bool) -> None:
    """Tokenize raw preference pairs into ArrayRecord shards plus a manifest (Apache Beam)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if verbose:
        logging.getLogger("apache_beam").setLevel(logging.INFO)
    cfg = PreprocessConfig.from_dict({**options, "beam_args": tuple(ctx.args)})
    from rmflow.pipelines.preprocess import run

    with console.status("preprocessing ..."):
        result = run(cfg, wait=not detach)
    if result is None:
        console.print(f"submitted; the job publishes {cfg.output} and writes COMPLETED in it when it is done "
                      "(nothing, if it fails)")
        return
    print_summary(result.stats, result.output)


def print_summary(stats: dict, output: str) -> None:
    """What `rmflow preprocess` did: the counts, each input file, the reasons records were not
    written, the token lengths, the throughput."""
    kind = kind_named(stats.get("kind", OUTCOME.name))
    console.print(_counts_table(stats, kind))
    files = stats.get("per_file") or {}
    if len(files) > 1:
        console.print(_per_file_table(files))
    if stats["dead_letters"]:
        t = Table(title="not written, by reason (details in errors.jsonl)")
        for col in ("category", "reason", "count"):
            t.add_column(col, justify="right" if col == "count" else "left")
        for d in sorted(stats["dead_letters"], key=lambda d: -d["count"]):
            t.add_row(d["category"], d["code"], f"{d['count']:,}")
        console.print(t)
    if stats.get("skipped_inputs"):
        from rmflow.rendering.files import skipped_summary

        console.print(_escape(skipped_summary(stats["skipped_inputs"])))
    lengths = stats["lengths"].get("train", {})
    if lengths:
        t = Table(title="train token lengths")
        t.add_column("")
        for col in ("p50", "p90", "p95", "p99", "max"):
            t.add_column(col, justify="right")
        for field in kind.lengths:
            s = lengths.get(field, {})
            t.add_row(field, *(str(s.get(k, "-")) for k in ("p50", "p90", "p95", "p99", "max")))
        console.print(t)
    console.print(
        f"{stats['seconds']:.1f} s, {stats['pairs_per_second']:,.0f} records/s, "
        f"{stats['tokens_per_second']:,.0f} tokens/s. Output: [bold]{output}[/bold]"
    )


def _counts_table(stats: dict, kind) -> Table:
    from rmflow.rendering.accounting import NOT_WRITTEN, NOTED_COUNTS

    c = stats["counts"]
    table = Table(title=f"rmflow preprocess: {kind.data}, for {kind.description}", show_header=True)
    table.add_column("")
    table.add_column(kind.units, justify="right")
    table.add_row("records read", f"{c['records_read']:,}")
    table.add_row("written (train / eval)",
                  f"{c['pairs_written']:,} ({c['pairs_written_train']:,} / {c['pairs_written_eval']:,})")
    for key, _, what in NOT_WRITTEN:
        if key not in ("contaminated", "weak_labels") or c.get(key):  # filters asked for: a row when they dropped any
            table.add_row(what if key == "errors" else f"dropped: {what}", f"{c.get(key, 0):,}")
    for key, _, _, what in NOTED_COUNTS:
        if c.get(key):
            table.add_row(what, f"{c[key]:,}")
    for eval_file, n in stats.get("contaminated_by_eval_file", {}).items():
        table.add_row(f"  contaminated: overlapping {eval_file}", f"{n:,}")
    if kind.counts_steps:
        table.add_row("steps written (incorrect)", f"{c.get('steps_written', 0):,} ({c.get('incorrect_steps', 0):,})")
    if c.get("prompt_truncated", 0):
        table.add_row("written with a truncated prompt", f"{c['prompt_truncated']:,}")
    if c.get("special_token_text", 0):
        table.add_row("written with special-token text in a message (kept as text)", f"{c['special_token_text']:,}")
    return table


def _per_file_table(files: dict) -> Table:
    t = Table(title="per input file")
    for col in ("file", "read", "written", "not written", "chosen longer"):
        t.add_column(col, justify="left" if col == "file" else "right")
    for path, f in files.items():
        longer = f["chosen_longer_fraction"]
        t.add_row(os.path.basename(path), f"{f['read']:,}", f"{f['written']:,}",
                  f"{f['read'] + f.get('made', 0) - f.get('grouped', 0) - f['written']:,}",
                  "-" if longer is None else f"{longer:.1%}")
    return t


@command(epilog="--config and --set take the options' dotted names (optimizer.learning_rate): nested in YAML, "
                "key=value with --set; a flag wins over --config, --set over both. The reference: docs/reference/config.md.")
@config_options(TrainConfig, dotted=True, extra=(
    parameter("config", str | None, typer.Option(None, "--config", help="YAML file of train options: sections as "
                                                 "mappings (optimizer: {learning_rate: 1e-5}) or dotted keys.")),
    parameter("set_", list[str], typer.Option([], "--set", help="Override one option: key=value with its dotted "
                                              "name, e.g. optimizer.learning_rate=1e-5 (repeatable).")),
    parameter("resume", bool, typer.Option(False, "--resume", help="Continue from the newest checkpoint in --output.")),
    parameter("plan", bool, typer.Option(False, "--plan", help="Print the memory plan of one train step per device "
                                         "(no weight loaded, the step compiled for the mesh) and the levers that "
                                         "shrink it, then stop; writes nothing.")),
    parameter("allow_config_change", bool, typer.Option(
        False, "--allow-config-change", help="With --resume: continue even though the config changes the run's "
        "trajectory (learning rate, batch size, steps, data ...); the change is kept in config_history.jsonl.")),
))
def train(options: dict, config: str | None, set_: list[str], resume: bool, plan: bool,
          allow_config_change: bool) -> None:
    """Train a reward model on preprocessed shards (JAX / Flax / Optax, fed by Grain)."""
    from rmflow.schemas.options import flatten
    from rmflow.workflow import read_yaml_mapping

    base = read_yaml_mapping(config, f"--config {config}", "a mapping of option: value") if config else {}
    # dotted, each option once, so that a flag replaces the file's value however the file spelled it
    cfg = TrainConfig.from_dict({**flatten(TrainConfig, base), **options}).with_overrides(list(set_))

    if plan:  # before the raw eval sets are preprocessed into --output: the plan writes nothing
        from rmflow.trainer.train import memory_plan

        console.print(memory_plan(cfg).render(), highlight=False, markup=False)
        return
    from rmflow.eval.sets import preprocess_eval_sets

    cfg = preprocess_eval_sets(cfg)

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from rmflow.eval.reports import training_progress, training_result
    from rmflow.trainer.model_setup import planned_steps
    from rmflow.trainer.train import run

    columns = [TextColumn("step {task.completed}/{task.total}"), BarColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[info]}")]
    progress = Progress(*columns, console=console)
    task = progress.add_task("train", total=None, info="", start=False)

    kind = []  # the run's reward model kind, once its checks passed

    def on_start(step: int, run_kind) -> None:  # every check passed (the run holds its folder): show the bar from here
        kind.append(run_kind)
        progress.update(task, completed=step, total=planned_steps(cfg))
        progress.start_task(task)
        progress.start()

    def on_log(rec: dict) -> None:
        progress.update(task, completed=rec["step"], info=training_progress(kind[0], rec))

    try:
        result = run(cfg, resume=resume, on_log=on_log, on_start=on_start, allow_config_change=allow_config_change)
    finally:
        progress.stop()
    console.print(f"trained {result.total_steps} steps; {training_result(result.trainer.objective.kind, result.history)}"
                  f". Run: [bold]{cfg.output}[/bold]")


@command(name="run")
def run_workflow(
    workflow: str = typer.Argument(..., help="workflow.yaml: output, preprocess, train, eval, export."),
) -> None:
    """Run preprocess, train, eval (and export) in a chain, skipping the stages already done."""
    from rmflow.workflow import Workflow
    from rmflow.workflow import run as run_stages

    wf = Workflow.load(workflow)
    status = run_stages(wf, log=lambda msg: console.print(f"[bold]rmflow[/bold] {_escape(msg)}"))
    console.print(", ".join(f"{k}: {v}" for k, v in status.items()))
    console.print(f"report: [bold]{os.path.join(wf.output, 'eval', 'report.md')}[/bold]")


@command(name="eval")
@config_options(EvalConfig)
def eval_(options: dict) -> None:
    """Evaluate a reward model: accuracy, loss, margins, calibration, length bias, per-subset accuracy; K responses
    per prompt (--mode responses): best-of-K, Kendall's tau, pairwise accuracy; a process reward model: step
    accuracy, precision/recall/F1 of incorrect steps, first-error accuracy, ProcessBench F1."""
    from rmflow.eval.evaluation import run_eval
    from rmflow.eval.reports import eval_summary

    cfg = EvalConfig.from_dict(options)
    m = run_eval(cfg)
    title, rows = eval_summary(m)
    table = Table(title=title)
    table.add_column("")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for p in m.get("probes", []):  # each sanity probe's line (rmflow.eval.probes); a failure in red
        console.print(f"[{'green' if p['passed'] else 'bold red'}]{'PASS' if p['passed'] else 'FAIL'}[/] "
                      f"{_escape(p['name'])}: {_escape(p['line'])}")
    console.print(f"report: [bold]{os.path.join(cfg.output, REPORT_FILE)}[/bold]")


@command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
         epilog="With --runner, any other --option is a Beam pipeline option, passed to Beam unchanged.")
@config_options(ScoreConfig, exclude=("beam_args",), extra=(parameter("ctx", typer.Context, inspect.Parameter.empty),))
def score(options: dict, ctx: typer.Context) -> None:
    """Score conversations with a reward model (or each step of solutions with a process reward model), in
    batches sorted by length; with --runner, as a Beam job (locally or on Dataflow)."""
    cfg = ScoreConfig.from_dict({**options, "beam_args": tuple(ctx.args)})
    if cfg.runner:
        from rmflow.scoring.batch import run as run_config

        s = run_config(cfg)  # above --max-bad-fraction: refused (BatchScoreError), nothing published
        console.print(f"{s['scored']:,} scored, {s['errors']:,} errors (errors.jsonl) of {s['records_read']:,} "
                      f"read: [bold]{cfg.output}[/bold]")
        return
    from rich.progress import Progress

    from rmflow.scoring.scorers import ScoringMode, score_file

    with Progress(console=console) as progress:
        def factory(total: int):
            task = progress.add_task("scoring", total=total)
            return lambda n: progress.advance(task, n)

        counts = score_file(cfg.model, cfg.input, cfg.output, step=cfg.step, batch_size=cfg.batch_size,
                            truncate=cfg.truncate, mode=ScoringMode(cfg.deterministic, cfg.reward),
                            progress_factory=factory)
    total = counts["scored"] + counts["errors"]
    if total and counts["errors"] / total > cfg.max_bad_fraction:  # the file is written either way
        console.print(f"[red]score failed:[/red] {counts['errors']:,} of {total:,} lines "
                      f"({counts['errors'] / total:.1%}) cannot be scored, more than --max-bad-fraction "
                      f"{cfg.max_bad_fraction:.1%}; {_escape(cfg.output)} has the {counts['scored']:,} scores and each "
                      "bad line with its 'error'")
        raise typer.Exit(1)
    console.print(f"{counts['scored']:,} scored, {counts['errors']:,} bad lines (with 'error' in the output): "
                  f"[bold]{cfg.output}[/bold]")


@command()
@config_options(ServeConfig, positional=("model",))
def serve(options: dict) -> None:
    """Serve a reward model over HTTP with dynamic batching: POST /v1/score (conversations, K responses to a prompt,
    or a process model's solutions), /get_reward (OpenRLHF's --remote_rm_url), /classify and /pooling (vLLM's
    pooling API, as verl calls it), /v1/embeddings (SGLang's); GET /health, /metrics (Prometheus), /v1/model.
    Needs rmflow's serve extra (Starlette, uvicorn)."""
    cfg = ServeConfig.from_dict(options)
    from rmflow.server.app import serve as run_server

    raise typer.Exit(run_server(cfg))


@command()
@config_options(ExportConfig, positional=("run",))
def export(options: dict) -> None:
    """Export a trained run as a Hugging Face *ForSequenceClassification checkpoint (a process reward model:
    *ForTokenClassification), with its tokenizer."""
    from rmflow.trainer.export import export as do_export

    cfg = ExportConfig.from_dict(options)
    out = do_export(cfg)
    if cfg.adapter:
        console.print(f"exported the LoRA adapter to [bold]{out}[/bold]: load it with "
                      "peft.PeftModel.from_pretrained(base_model, path)")
        return
    kind = kind_named(jsontext.read(os.path.join(out, EXPORT_INFO))["kind"])
    where = f"each of {out}/{MEMBER_FOLDER}0 ... (one checkpoint per member, {ENSEMBLE_FILE} names the reward)" \
        if os.path.exists(os.path.join(out, ENSEMBLE_FILE)) else ""
    console.print(f"exported to [bold]{out}[/bold]: load {where or 'it'} with "
                  f"transformers.AutoModel{kind.head.hf_head}.from_pretrained")


if __name__ == "__main__":
    app()

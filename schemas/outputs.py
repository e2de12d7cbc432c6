"""Output folders every command writes: one writer at a time, and written whole or not at all.

``output_lock(output, command)`` holds an exclusive lock on a local output folder for as long as a
command writes it: a second process that names the same folder is refused in one line naming the
holder (host, process id, command, start time). The lock is ``flock`` on a file beside the folder
(``.<name>.rmflow-lock``), so the kernel releases it when its process dies, however it dies; the
next command then takes it over and says so. Remote outputs (gs://) have no such lock: object
stores offer none, and docs/scoring-serving.md says so.

``staged_output(output, output_type)`` gives a staging folder beside ``output`` and swaps it in when the
block ends without an error: an earlier output there is replaced whole (no stale file survives), and
an interrupted write leaves the earlier one intact. What it replaces must be an earlier output of the
same output_type, or nothing: ``check_replaceable`` is the one rule every command applies before it writes,
so no command ever deletes a folder of other files, another command's output or its own input. Staging folders left by a writer that died are
removed by the next holder of the lock (which proves that writer is gone).

A process asked to stop publishes nothing more: every publishing step calls
``schemas.stops.refuse_if_stopping`` first.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import glob
import json
import os
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterator

from rmflow.schemas import jsontext
from rmflow.schemas.errors import RmflowError, RmflowWarning
from rmflow.schemas.paths import is_url
from rmflow.schemas.stops import refuse_if_stopping

LOCK_SUFFIX = ".rmflow-lock"
STAGING_SUFFIX = ".tmp-"

_held: dict[str, int] = {}  # lock file -> nesting depth, for this process (a workflow holds, its stages re-enter)
_held_guard = threading.Lock()


class OutputBusy(RmflowError):
    """Another live process is writing this output folder."""


def lock_path(output: str) -> str:
    output = os.path.abspath(output.rstrip("/"))
    return os.path.join(os.path.dirname(output), "." + os.path.basename(output) + LOCK_SUFFIX)


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (f"`{holder.get('command', '?')}` (process {holder.get('pid', '?')} on {holder.get('host', '?')}, "
            f"started {started})")


def _read_holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 65536)
    try:
        holder = json.loads(data) if data.strip() else None
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


@contextlib.contextmanager
def output_lock(output: str, command: str) -> Iterator[None]:
    """Hold the exclusive lock of a local output folder (re-entrant within one process)."""
    if is_url(output):
        yield
        return
    path = lock_path(output)
    with _held_guard:
        if path in _held:
            _held[path] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield
        finally:
            with _held_guard:
                _held[path] -= 1
        return
    fd = _acquire(path, output, command)
    with _held_guard:
        _held[path] = 1
    try:
        yield
    finally:
        with _held_guard:
            del _held[path]
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)  # releases the flock


def _acquire(path: str, output: str, command: str) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = _describe(holder) if holder else "another process"
            raise OutputBusy(f"{output} is being written by {who}: wait for it to end, or choose another output "
                             "folder") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # not a file its last holder unlinked while we were opening it
            break
        os.close(fd)
    previous = _read_holder(fd)
    if previous:
        warnings.warn(f"{output}: took over the lock of {_describe(previous)}, which ended without releasing it "
                      "(killed?); what it left half-written is discarded or resumed as each command does",
                      RmflowWarning, stacklevel=4)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, jsontext.dumps({"command": command, "pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.time()}).encode())
    return fd


def is_locked_by_me(output: str) -> bool:
    with _held_guard:
        return lock_path(output) in _held


def stale_staging(output: str) -> list[str]:
    """Staging folders of ``output`` (call while holding its lock: then no live writer owns them)."""
    out = os.path.abspath(output.rstrip("/"))
    return sorted(p for p in glob.glob(glob.escape(out) + STAGING_SUFFIX + "*") if os.path.isdir(p))


@contextlib.contextmanager
def staged_output(output: str, output_type: str) -> Iterator[str]:
    """A fresh staging folder beside ``output`` (mode as the umask says), swapped in on success
    when ``output`` is new, empty or an earlier output of ``output_type`` (``check_replaceable``: checked
    before the block runs and again before the swap)."""
    output = os.path.abspath(output.rstrip("/"))
    check_replaceable(output, output_type)
    if is_locked_by_me(output):
        for old in stale_staging(output):
            shutil.rmtree(old, ignore_errors=True)
    staging = f"{output}{STAGING_SUFFIX}{uuid.uuid4().hex[:12]}"
    os.makedirs(staging)  # created per the umask (tempfile.mkdtemp would make it 0700)
    try:
        yield staging
        follow_umask(staging)
        check_replaceable(output, output_type)
        swap_in(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def umask() -> int:
    """The process's umask (read by setting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: str) -> None:
    """Every file and folder under ``folder`` with the mode the umask gives a new one: a library
    that writes through a private temporary file (safetensors' 0600 weights) does not decide
    who can read an output."""
    mask = umask()
    for root, dirs, files in os.walk(folder):
        for name in dirs:  # os.walk does not enter a linked folder; its target is not ours to change
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def swap_in(staging: str, output: str) -> None:
    """Replace ``output`` with ``staging``: one rename when there is none; else two, then the old
    one is removed (a reader sees the old folder or the new one, never a mix)."""
    refuse_if_stopping()
    if not os.path.exists(output):
        os.rename(staging, output)
        return
    old = staging + ".old"
    os.rename(output, old)
    os.rename(staging, output)
    shutil.rmtree(old, ignore_errors=True)


# What each rmflow output folder holds, by which it is recognised (all of a set must be present),
# so that an input folder holding an earlier output is never read back as data.
EXPORT_INFO = "rmflow_export.json"  # in an export: the run and step it came from, its tokenizer hash
EVAL_FILE = "eval.json"  # in an eval folder: the metrics and the config that produced them
REPORT_FILE = "report.md"

SCORES_SUMMARY = "summary.json"  # in a scoring job's output, beside its COMPLETED marker
WORKFLOW_FILE = "rmflow_workflow.json"  # in a workflow's folder: written first, the workflow file it runs
OUTPUT_SIGNATURES: dict[str, tuple[frozenset[str], ...]] = {
    "shard folder": (frozenset({"manifest.json", "stats.json"}), frozenset({"_summary.json"})),
    "run directory": (frozenset({"model_config.json"}),),  # written before the first step (and checkpoint)
    "eval folder": (frozenset({EVAL_FILE, REPORT_FILE}),),
    "export": (frozenset({EXPORT_INFO}),),
    "scoring job output": (frozenset({"COMPLETED", SCORES_SUMMARY}),),
    "staging folder": (frozenset({"_owner.json"}),),
    "workflow folder": (frozenset({WORKFLOW_FILE}), frozenset({"preprocess.done.json"}),
                        frozenset({"train.started.json"})),
}


# What an output of each output_type may hold at its top level (fnmatch patterns; None: anything, its
# parts each checked by their own command's rule): a folder recognised as a command's earlier
# output is replaced or written into only when it holds nothing else, so that a file a user put
# in it is never deleted with it.
OUTPUT_FILES: dict[str, tuple[str, ...] | None] = {
    "shard folder": ("manifest.json", "stats.json", "config.json", "errors.jsonl", "contamination.jsonl", "COMPLETED",
                     "_summary.json", "_FAILED.json", "tokenizer", "train-*.array_record", "eval-*.array_record"),
    "run directory": ("config.json", "model_config.json", "base_config.json", "data_manifest.json", "mixture.json",
                      "config_history.jsonl", "metrics.jsonl", "checkpoints", "tokenizer", "eval_data", "tensorboard",
                      "wandb", "wandb_id", "reward_normalization.json"),
    "eval folder": (EVAL_FILE, REPORT_FILE, "input_errors.jsonl", "*.png"),
    "export": ("README.md", "config.json", "generation_config.json", EXPORT_INFO, "reward_normalization.json",
               "model*.safetensors", "model.safetensors.index.json", "adapter_config.json", "adapter_model.safetensors",
               "chat_template.jinja", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
               "merges.txt", "*.model", "*.tiktoken"),
    "scoring job output": ("COMPLETED", SCORES_SUMMARY, "scores-*-of-*.*", "best.jsonl", "pairs.jsonl", "errors.jsonl",
                           "_FAILED.json"),
    "staging folder": None,
    "workflow folder": None,
}


def foreign_files(output_type: str, names: set[str] | frozenset[str]) -> list[str]:
    """The names of ``names`` that an output of ``output_type`` never holds (``OUTPUT_FILES``), sorted."""
    own = OUTPUT_FILES[output_type]
    return [] if own is None else sorted(n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in own))


def output_type_of(names: set[str] | frozenset[str]) -> str | None:
    """The output_type of rmflow output a folder holding files ``names`` is, or None."""
    for output_type in OUTPUT_SIGNATURES:
        if is_output_of(output_type, names):
            return output_type
    return None


def is_output_of(output_type: str, names: set[str] | frozenset[str]) -> bool:
    """Whether a folder holding files ``names`` is an rmflow output of ``output_type`` (OUTPUT_SIGNATURES)."""
    return any(sig <= set(names) for sig in OUTPUT_SIGNATURES[output_type])


class OutputRefused(RmflowError):
    """An output a command would replace is not its own earlier output; nothing was written."""


def replace_refusal(output: str, output_type: str, names: set[str] | frozenset[str] | None, *, is_file: bool = False,
                    option: str = "--output", ignore: frozenset[str] = frozenset(), replaces: bool = True
                    ) -> str | None:
    """Why a command that writes a ``output_type`` output (OUTPUT_SIGNATURES) and replaces what is there
    must not write to ``output``, or None when it may: it may replace nothing (``names`` None),
    an empty folder (but for ``ignore``, what the command itself put there first) or its own
    earlier output holding nothing else (``OUTPUT_FILES``; a command that writes into its output
    rather than replacing it, ``replaces=False``, leaves what else is there alone); never a file,
    another command's output or a folder of other files, which it would delete. The one rule every command applies (``check_replaceable``, and the Beam jobs with
    their own listing of a remote folder)."""
    if is_file:
        return f"{option} {output} is a file; give a folder for the {output_type}"
    if names is None:
        return None
    names = set(names) - set(ignore)
    if not names:
        return None
    if is_output_of(output_type, names):
        foreign = foreign_files(output_type, names) if replaces else []
        if not foreign:
            return None
        shown = ", ".join(foreign[:4]) + (" ..." if len(foreign) > 4 else "")
        return (f"{option} {output} is an earlier {output_type} that also holds {shown}, which rmflow did not write and "
                "replacing it would delete: move them out, or give another folder")
    other = output_type_of(names)
    shown = ", ".join(sorted(names)[:4]) + (" ..." if len(names) > 4 else "")
    what = f"is an rmflow {other}" if other else f"holds other files ({shown})"
    return f"{option} {output} {what}, not an earlier {output_type}, the only folder this command writes over: give a " \
           "new or empty folder"


# What an rmflow output holds of other outputs by design (None: any): a workflow's folder its
# stages' outputs; a run directory its named eval sets' shards (``eval_data``, trainer.rundir)
HOLDS_OUTPUTS: dict[str, tuple[str, ...] | None] = {"workflow folder": None, "run directory": ("eval_data",)}


def check_replaceable(output: str, output_type: str, *, option: str = "--output", ignore: frozenset[str] = frozenset(),
                      inputs: tuple[str, ...] = (), replaces: bool = True) -> None:
    """``replace_refusal`` of a local ``output`` (remote ones: the Beam jobs list them themselves),
    raised as OutputRefused; also refused when it lies inside another rmflow output (``nested_in``),
    when one of the command's ``inputs`` (files, folders or globs) lies inside it, and, for a
    command that ``replaces`` it whole, when it holds another rmflow output."""
    if is_url(output):
        return
    if os.path.islink(output.rstrip("/")):  # the swap would replace the link, not the folder it names
        raise OutputRefused(f"{option} {output} is a link to {os.path.realpath(output)}: give the folder itself")
    names = set(os.listdir(output)) if os.path.isdir(output) else None
    why = replace_refusal(output, output_type, names, is_file=os.path.exists(output) and not os.path.isdir(output),
                          option=option, ignore=ignore, replaces=replaces) or nested_in(output, option)
    if why:
        raise OutputRefused(why)
    inside = inside_of(output, inputs)
    if inside:
        raise OutputRefused(f"{inside} is inside {option} {output}, which this command replaces whole: give an "
                            "output folder apart from its inputs")
    held = holds_output(output) if replaces and names else None
    if held:
        raise OutputRefused(f"{option} {output} holds an rmflow {held[1]} ({held[0]}), which replacing it would "
                            "delete: move it out, or give another folder")


def nested_in(path: str, option: str = "--output") -> str | None:
    """Why ``path`` (a local output folder or file) must not be written: it lies inside another
    rmflow output, which that output's own command would replace or read as its own, unless that
    output_type holds it by design (``HOLDS_OUTPUTS``); None when it may be written."""
    path = os.path.abspath(path.rstrip("/"))
    parent = os.path.dirname(path)
    while True:
        output_type = output_type_of(set(os.listdir(parent))) if os.path.isdir(parent) else None
        if output_type:
            allowed = HOLDS_OUTPUTS.get(output_type, ())
            if allowed is not None and os.path.relpath(path, parent).split(os.sep)[0] not in allowed:
                return (f"{option} {path} is inside an rmflow {output_type} ({parent}), which its own command replaces or "
                        "reads as its own: give a path outside it")
        if os.path.dirname(parent) == parent:
            return None
        parent = os.path.dirname(parent)


def holds_output(folder: str) -> tuple[str, str] | None:
    """(the folder, its output_type) of an rmflow output below ``folder`` (not ``folder`` itself), or None."""
    for root, dirs, files in os.walk(folder):
        if root != folder:
            output_type = output_type_of(set(dirs) | set(files))
            if output_type:
                return root, output_type
    return None


def inside_of(folder: str, paths: tuple[str, ...] | list[str]) -> str | None:
    """The first of ``paths`` (files, folders, globs: a glob by what it matches) that is ``folder``
    or lies inside it (links resolved; a remote path by its prefix), or None."""
    root = folder.rstrip("/") if is_url(folder) else os.path.realpath(folder)
    for path in paths:
        if is_url(path) or is_url(folder):
            if is_url(path) and is_url(folder) and (path.rstrip("/") + "/").startswith(root + "/"):
                return path
            continue
        matches = glob.glob(path, recursive=True) if glob.has_magic(path) else [path]
        for match in matches:
            if (os.path.realpath(match) + os.sep).startswith(root + os.sep):
                return match
    return None

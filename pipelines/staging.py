"""Staging folders: where a preprocess job writes before it publishes, and what is left of them.

A job writes into ``OUTPUT.tmp-<id>`` and renames it to ``OUTPUT`` at the end; an interrupted
job (Ctrl-C, a killed machine) leaves its staging folder, shards included. Each staging folder
holds ``_owner.json`` (host, process id, start time) from the start, so the next run of the same
output can tell a leftover from a job still writing: on local disk a folder whose process on
this host is gone is removed; anything else (another host's job, a remote bucket, where a
Dataflow job can outlive its launcher) is reported, never deleted.
"""

from __future__ import annotations

import glob
import os
import socket
import time
import uuid

from apache_beam.io.filesystems import FileSystems
from rmflow.pipelines import io as rio
from rmflow.schemas import jsontext
from rmflow.schemas.paths import is_url

OWNER_FILE = "_owner.json"
SUFFIX = ".tmp-"


def new_staging(output: str) -> str:
    """A fresh staging folder for ``output``, with its owner file written."""
    staging = f"{output.rstrip('/')}{SUFFIX}{uuid.uuid4().hex[:12]}"
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    rio.write_bytes(f"{staging}/{OWNER_FILE}", jsontext.dumps(owner).encode())
    return staging


def leftovers(output: str) -> list[str]:
    """Staging folders of earlier runs of ``output`` (finished or not)."""
    out = output.rstrip("/")
    if not is_url(out):
        return sorted(p for p in glob.glob(glob.escape(out) + SUFFIX + "*") if os.path.isdir(p))
    metas = FileSystems.match([f"{out}{SUFFIX}*/**"])[0].metadata_list
    return sorted({m.path[: m.path.index("/", len(out) + len(SUFFIX))] for m in metas})


def _abandoned(staging: str) -> bool:
    """True only when certain: a local folder whose writer on this host has exited."""
    if is_url(staging):
        return False
    try:
        owner = jsontext.read(os.path.join(staging, OWNER_FILE))
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not a staging folder rmflow wrote: ask the user
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def clean_leftovers(output: str) -> tuple[list[str], list[str]]:
    """(removed, kept): removes the abandoned staging folders of ``output``; the others are kept
    for the caller to report."""
    removed, kept = [], []
    for staging in leftovers(output):
        if _abandoned(staging):
            rio.delete_tree(staging)
            removed.append(staging)
        else:
            kept.append(staging)
    return removed, kept

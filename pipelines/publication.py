"""How a Beam job's last step publishes its output, the protocol both jobs share (preprocess's
shards, batch scoring's scores): it writes into a staging folder; a refusal writes the reason
(``FAILED_FILE``) there and publishes nothing; otherwise the step's own files are dropped, an
output left from before is replaced (``--overwrite`` was checked when the job was planned), the
staging folder becomes the output and ``COMPLETED`` is written last, which is what readers wait
for. A retry of the step after publishing finds the output complete and its staging gone, and
returns what the first attempt wrote instead of doing anything again."""

from __future__ import annotations

import json
from typing import Any, NoReturn

from rmflow.pipelines import io as rio
from rmflow.pipelines.staging import OWNER_FILE
from rmflow.schemas import jsontext
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.manifest import COMPLETED_FILE

FAILED_FILE = "_FAILED.json"  # in the staging folder: why the last step refused


class PublishRefused(RmflowError):
    """What is at the output now is not the job's own earlier output: it is left as it is."""


def published(output: str, staging: str, result_file: str) -> dict[str, Any] | None:
    """What an earlier attempt published (``result_file`` of the output, JSON), when it did."""
    out = output.rstrip("/")
    if rio.exists(f"{out}/{COMPLETED_FILE}") and not rio.exists(staging):
        return json.loads(rio.read_bytes(f"{out}/{result_file}"))
    return None


def refuse(staging: str, failure: dict[str, Any], error: Exception) -> NoReturn:
    """Record why the job publishes nothing (``failure`` as ``FAILED_FILE``) and raise ``error``."""
    rio.write_bytes(f"{staging}/{FAILED_FILE}", jsontext.dumps(failure).encode())
    raise error


def publish(staging: str, output: str, kind: str, drop: tuple[str, ...] = ()) -> None:
    """Drop the step's own files (``drop`` and the staging folder's owner file), replace what is at
    ``output`` (only ever an earlier output of the job's ``kind``: ``rio.check_replaceable``, as
    when the job was planned), move the staging folder there and write ``COMPLETED`` last."""
    from apache_beam.io.filesystems import FileSystems

    out = output.rstrip("/")
    rio.check_replaceable(out, kind, PublishRefused)
    FileSystems.delete([f"{staging}/{name}" for name in (*drop, OWNER_FILE)])
    if rio.exists(out):
        rio.delete_tree(out)
    rio.publish(staging, out)
    rio.write_bytes(f"{out}/{COMPLETED_FILE}", b"")

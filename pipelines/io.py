"""File handling through Beam's FileSystems, so every path may be local or remote (gs://).

Reading data files is ``rendering.files``' (one reader for every command), here through Beam's
FileSystems (``BEAM``); ArrayRecord shard writing (local disk first, then an idempotent copy to
the destination), and atomic publication of a finished output directory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from rmflow.rendering import files
from rmflow.rendering.files import (  # noqa: F401 - the reading API, re-exported for the Beam stage
    ARROW_SUFFIXES,
    HUB_DATASETS,
    JSON_SUFFIXES,
    PARQUET_SUFFIXES,
    FileInfo,
    InputError,
    hub_dataset_folder,
    is_supported,
    skipped_summary,
    source_names,
)
from rmflow.schemas import outputs
from rmflow.schemas.outputs import replace_refusal
from rmflow.schemas.paths import is_url
from rmflow.schemas.stops import refuse_if_stopping

_COPY_CHUNK = 8 << 20


class BeamFileSystem:
    """``rendering.files.FileSystem`` through Beam's FileSystems (what a Dataflow worker has)."""

    def match(self, pattern: str) -> list[FileInfo]:
        return [(m.path, m.size_in_bytes, m.last_updated_in_seconds)
                for m in FileSystems.match([pattern])[0].metadata_list]

    @contextlib.contextmanager
    def open(self, path: str):
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            yield f

    def names_in(self, folder: str) -> set[str] | None:
        return folder_names(folder)


BEAM = BeamFileSystem()
list_inputs = functools.partial(files.list_inputs, fs=BEAM)
expand_inputs = functools.partial(files.expand_inputs, fs=BEAM)
streams_records = functools.partial(files.streams_records, fs=BEAM)


def iter_records(path: str) -> Iterator[tuple[int, str, str | None]]:
    """``rendering.files.iter_records`` through Beam's FileSystems."""
    return files.iter_records(path, BEAM)


def write_bytes(path: str, data: bytes) -> None:
    if not is_url(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with FileSystems.create(path, mime_type="application/octet-stream",
                            compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(data)


def read_bytes(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


def write_array_record_shard(dest: str, records: list[bytes], options: str = "group_size:1") -> None:
    """Write a shard locally with the ArrayRecord writer, then copy it to ``dest``.

    The writer only knows local paths, so the copy goes through Beam's FileSystems. The
    bytes are a function of ``records`` alone, so a retried bundle rewrites the same
    object: the copy is idempotent.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    with tempfile.TemporaryDirectory(prefix="rmflow-shard-") as tmp:
        local = os.path.join(tmp, os.path.basename(dest))
        writer = ArrayRecordWriter(local, options)
        for rec in records:
            writer.write(rec)
        writer.close()
        if not is_url(dest):
            os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        with open(local, "rb") as src, FileSystems.create(
            dest, compression_type=CompressionTypes.UNCOMPRESSED
        ) as dst:
            while chunk := src.read(_COPY_CHUNK):
                dst.write(chunk)


def exists(path: str) -> bool:
    path = path.rstrip("/")
    if FileSystems.exists(path):
        return True
    return bool(FileSystems.match([path + "/*"])[0].metadata_list) if is_url(path) else False


def folder_names(path: str) -> set[str] | None:
    """The names directly inside a folder, local or remote (an object store's first path
    components below it); None when nothing is there."""
    path = path.rstrip("/")
    if not is_url(path):
        return set(os.listdir(path)) if os.path.isdir(path) else None
    metas = FileSystems.match([path + "/**"])[0].metadata_list
    return {m.path[len(path) + 1:].split("/")[0] for m in metas} or None


def check_replaceable(output: str, kind: str, error: type[Exception], option: str = "--output",
                      inputs: tuple[str, ...] = ()) -> None:
    """The rule of ``schemas.outputs.check_replaceable`` for an output a Beam job replaces, local or
    remote (listed through Beam's filesystems), raised as ``error``: its own earlier output or
    nothing, no input of the job (``inputs``: files, folders, globs) inside it, and locally, not
    inside another rmflow output nor holding one."""
    output = output.rstrip("/")
    if not is_url(output):
        try:
            outputs.check_replaceable(output, kind, option=option, inputs=inputs)
        except outputs.OutputRefused as e:
            raise error(str(e)) from None
        return
    why = replace_refusal(output, kind, folder_names(output), option=option)
    inside = outputs.inside_of(output, inputs)
    if why or inside:
        raise error(why or f"{inside} is inside {option} {output}, which this job replaces whole: give an output "
                           "folder apart from its inputs")


def delete_tree(path: str) -> None:
    path = path.rstrip("/")
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    metas = FileSystems.match([path + "/**"])[0].metadata_list
    if metas:
        FileSystems.delete([m.path for m in metas])


def publish(staging: str, output: str) -> None:
    """Move a finished staging directory to ``output``.

    Local: one directory rename (atomic). Remote object stores have no directory rename:
    files move one by one, and readers rely on COMPLETED, which the caller writes last.
    """
    refuse_if_stopping()
    staging, output = staging.rstrip("/"), output.rstrip("/")
    if not is_url(output):
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        os.rename(staging, output)
        return
    metas = FileSystems.match([staging + "/**"])[0].metadata_list
    sources = [m.path for m in metas]
    FileSystems.rename(sources, [output + s[len(staging):] for s in sources])
    delete_tree(staging)

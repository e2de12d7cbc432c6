"""File handling through Beam's FileSystems, so every path may be local or remote (gs://).

Input expansion, record iteration for JSONL / JSON / Parquet files, ArrayRecord shard
writing (local disk first, then an idempotent copy to the destination), and atomic
publication of a finished output directory.
"""

from __future__ import annotations

import contextlib
import decimal
import gzip
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from rmflow.schemas import jsontext, outputs
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.outputs import output_kind, replace_refusal
from rmflow.schemas.paths import is_url
from rmflow.schemas.stops import refuse_if_stopping

GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)  # datasets' save_to_disk and its cache files: Arrow IPC streams
DATASETS_METADATA = frozenset({"state.json", "dataset_info.json", "dataset_dict.json"})  # save_to_disk's own files
HUB_DATASETS = "hf://datasets/"  # a Hub data set, read from the local Hugging Face cache (no network)
GZIP_SUFFIXES = (".gz", ".gzip")
PARQUET_MAGIC = b"PAR1"
ARROW_MAGIC = b"ARROW1"
ARROW_STREAM_MARKER = b"\xff\xff\xff\xff"
_COPY_CHUNK = 8 << 20


class InputError(RmflowError, ValueError):
    """An input path or pattern cannot be read."""


def is_supported(path: str) -> bool:
    """A data file by its name: a JSON or Parquet suffix, or one of them gzipped under any ending."""
    lower = path.lower()
    for gz in GZIP_SUFFIXES:
        if lower.endswith(gz):
            lower = lower[: -len(gz)]
            return lower.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES) or "." not in os.path.basename(lower)
    return lower.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES)


def hub_dataset_folder(pattern: str, cache: str | None = None) -> str:
    """``hf://datasets/OWNER/NAME[@REVISION][/PATH]`` as the folder of its snapshot in the local
    Hugging Face cache (``HF_HUB_CACHE``; the revision a branch or tag's ``refs/`` file names, or
    a commit's own snapshot; by default ``refs/main``'s, else the only snapshot): a data
    set downloaded before (``hf download --repo-type dataset OWNER/NAME``) is read offline, its
    Parquet or JSON files like any folder's. Raises InputError naming the cache searched."""
    if cache is None:
        from huggingface_hub import constants

        cache = constants.HF_HUB_CACHE
    parts = pattern[len(HUB_DATASETS):].strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise InputError(f"input {pattern!r}: write a Hub data set as hf://datasets/OWNER/NAME[@REVISION][/PATH]")
    name, _, asked = parts[1].partition("@")  # HfFileSystem's own spelling of a revision: a branch, tag or commit
    repo = os.path.join(cache, f"datasets--{parts[0]}--{name}")
    ref = os.path.join(repo, "refs", asked or "main")
    snapshots = os.path.join(repo, "snapshots")
    download = f"hf download --repo-type dataset {parts[0]}/{name}" + (f" --revision {asked}" if asked else "")
    if os.path.isfile(ref):
        with open(ref) as f:
            revision = f.read().strip()
    elif asked and os.path.isdir(os.path.join(snapshots, asked)):  # a commit, as its snapshot is named
        revision = asked
    elif not asked and os.path.isdir(snapshots) and len(os.listdir(snapshots)) == 1:
        revision = os.listdir(snapshots)[0]
    else:
        what = f"{parts[0]}/{name}" + (f" at revision {asked}" if asked else "")
        raise InputError(f"input {pattern!r}: {what} is not in the local Hugging Face cache ({cache}); download it "
                         f"first: {download}")
    folder = os.path.join(snapshots, revision, *parts[2:])
    if not any(c in pattern for c in "*?[") and not os.path.exists(folder):  # a glob is matched by the listing
        raise InputError(f"input {pattern!r}: the cached snapshot {revision} has no {'/'.join(parts[2:]) or 'files'} "
                         f"({folder})")
    return folder


def expand_inputs(patterns: tuple[str, ...], skipped: list[tuple[str, str]] | None = None) -> list[tuple[str, int]]:
    """Each pattern (file, glob or directory) to the sorted (path, size) of its data files."""
    return [(path, size) for path, size, _ in list_inputs(patterns, skipped)]


def list_inputs(patterns: tuple[str, ...], skipped: list[tuple[str, str]] | None = None
                ) -> list[tuple[str, int, float]]:
    """The sorted (path, size, modification time) of the data files the patterns name: one
    listing per pattern, local or remote (metadata only). A file named on its own is read
    whatever its name (its content decides: gzip and Parquet by their magic bytes); a glob or
    a folder yields the files with a data suffix, except what lies under a hidden file or folder
    (``.ipynb_checkpoints``, ``.git``) or inside an earlier rmflow output (shards, a run, an eval):
    those are appended to ``skipped`` as (path, why)."""
    found: dict[str, tuple[int, float]] = {}
    for pattern in patterns:
        if pattern.startswith(HUB_DATASETS):
            pattern = hub_dataset_folder(pattern)
        elif pattern.startswith("hf://"):
            raise InputError(f"input {pattern!r}: rmflow reads the Hub's data sets, as hf://datasets/OWNER/NAME"
                             "[@REVISION][/PATH]")
        stripped = pattern.rstrip("/")
        has_glob = any(c in pattern for c in "*?[")
        is_dir = not has_glob and (os.path.isdir(stripped) or (is_url(stripped) and not is_supported(stripped)))
        query = stripped + "/**" if is_dir else pattern
        try:
            metas = FileSystems.match([query])[0].metadata_list
        except Exception as e:  # noqa: BLE001 - Beam raises BeamIOError and friends
            raise InputError(f"cannot list input {pattern!r}: {e}") from e
        if not has_glob and not is_dir:  # one file, named: read it whatever it is called
            files = {m.path: (m.size_in_bytes, m.last_updated_in_seconds) for m in metas}
        else:
            root = stripped if is_dir else _glob_root(pattern)
            files = {}
            excluded = _excluded(root, [m.path for m in metas])
            for m in metas:
                why = excluded.get(m.path)
                if why:
                    if skipped is not None and is_supported(m.path):
                        skipped.append((m.path, why))
                elif is_supported(m.path):
                    files[m.path] = (m.size_in_bytes, m.last_updated_in_seconds)
        own = output_kind(folder_names(stripped) or set()) if is_dir else None
        if not files and own:
            raise InputError(f"input {pattern!r} is an rmflow {own}, not raw data (its files are skipped as inputs)"
                             + ("; train and eval read shard folders as they are" if own == "shard folder" else
                                "; give the data files themselves"))
        if not files:
            raise InputError(
                f"input {pattern!r} matches no data files (supported: "
                f"{', '.join(JSON_SUFFIXES + PARQUET_SUFFIXES)}, gzipped or not, and {ARROW_SUFFIXES[0]}"
                + ("; hidden files and earlier rmflow outputs are skipped" if skipped else "") + ")"
            )
        found.update(files)
    return sorted((path, size, mtime) for path, (size, mtime) in found.items())


def _glob_root(pattern: str) -> str:
    """The folder a glob starts from: its path up to the first component with a wildcard."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return "/".join(parts[:i])
    return os.path.dirname(pattern)


def _excluded(root: str, paths: list[str]) -> dict[str, str]:
    """path -> why it is not an input: below ``root``, a hidden component, or a folder that is an
    rmflow output (recognised by the files the listing shows in it)."""
    root = root.rstrip("/")
    names_in: dict[str, set[str]] = {}
    for path in paths:
        folder, _, name = path.rpartition("/")
        names_in.setdefault(folder, set()).add(name)
    kinds = {folder: kind for folder, names in names_in.items() if (kind := output_kind(names))}
    out = {}
    for folder, names in names_in.items():  # a datasets.save_to_disk folder's metadata is not data
        if DATASETS_METADATA & names and any(n.endswith(ARROW_SUFFIXES) for n in names) \
                or "dataset_dict.json" in names:
            for name in DATASETS_METADATA & names:
                out[f"{folder}/{name}"] = "the metadata of a datasets.save_to_disk folder"
    for path in paths:
        if path in out:
            continue
        rel = path[len(root) + 1:] if root and path.startswith(root + "/") else os.path.basename(path)
        parts = rel.split("/")
        if any(p.startswith(".") for p in parts):
            out[path] = "hidden"
            continue
        folder = path.rpartition("/")[0]
        while len(folder) >= len(root) and folder:
            if folder in kinds:
                out[path] = f"inside an rmflow {kinds[folder]} ({folder})"
                break
            folder = folder.rpartition("/")[0]
    return out


def source_names(paths: list[str]) -> dict[str, str]:
    """The inputs whose records must name them by more than their file name, because another
    input has the same one (a datasets.save_to_disk folder's splits: train/data-00000-of-00001.arrow
    and test/...): each such path -> the shortest end of it that no other input's path shares."""
    by_name: dict[str, list[list[str]]] = {}
    for path in paths:
        parts = path.rstrip("/").split("/")
        by_name.setdefault(parts[-1], []).append(parts)
    out = {}
    for same in (group for group in by_name.values() if len(group) > 1):
        for parts in same:
            k = 2
            while k < len(parts) and sum(other[-k:] == parts[-k:] for other in same) > 1:
                k += 1
            out["/".join(parts)] = "/".join(parts[-k:])
    return out


SKIPPED_GROUPS = (("hidden", "hidden (under a name starting with '.')"),
                  ("inside an rmflow", "inside earlier rmflow outputs"),
                  ("the metadata of a datasets", "the metadata of datasets.save_to_disk folders"))


def skipped_summary(skipped: list[dict[str, str]]) -> str:
    """One line on the files of the input folders that are not inputs (``_excluded``'s reasons,
    as stats.json's ``skipped_inputs`` lists them), counted by why."""
    counts: dict[str, int] = {}
    for entry in skipped:
        label = next((label for start, label in SKIPPED_GROUPS if entry["why"].startswith(start)), entry["why"])
        counts[label] = counts.get(label, 0) + 1
    return (f"skipped {len(skipped):,} files in the input folders that are not inputs: "
            + ", ".join(f"{n:,} {label}" for label, n in counts.items()) + " (listed in stats.json, skipped_inputs)")


def iter_records(path: str) -> Iterator[tuple[int, str, str | None]]:
    """(1-based line or row number, raw text, decode problem or None) for each record of a file.

    JSON Lines: every line that is not blank. A ``.json`` file whose first character is
    ``[`` is read as one JSON array. Parquet: each row, rendered as JSON. A line that is
    not valid UTF-8 comes back with the undecodable bytes replaced and a problem message.
    """
    container = _container(path)
    if container == "parquet":
        yield from _iter_parquet(path)
        return
    if container == "arrow":
        yield from _iter_arrow(path)
        return
    with _open_text_source(path) as f:
        line = f.readline()
        if line.startswith(UTF8_BOM):  # files saved on Windows or from spreadsheets: valid data
            line = line[len(UTF8_BOM):]
        if line.lstrip()[:1] == b"[" and not _is_jsonl(path):
            yield from _iter_json_array(line + f.read())
            return
        line_no = 0
        while line:
            line_no += 1
            if line.strip():
                line = line.rstrip(b"\r\n")
                try:
                    yield line_no, line.decode("utf-8"), None
                except UnicodeDecodeError as e:
                    yield line_no, line.decode("utf-8", errors="replace"), f"line is not valid UTF-8: {e}"
            line = f.readline()


@contextlib.contextmanager
def _open_text_source(path: str):
    """Open a data file, gunzipping it when it starts with gzip's magic bytes, whatever its
    name, with Python's gzip module: unlike Beam's CompressedFile it raises on a truncated
    stream instead of ending early and quietly."""
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
        head = raw.read(len(GZIP_MAGIC))
        try:
            raw.seek(0)
            source = raw
        except (OSError, AttributeError, NotImplementedError):  # a stream that cannot seek
            source = io.BytesIO(head + raw.read())
        if head == GZIP_MAGIC:
            with gzip.GzipFile(fileobj=source, mode="rb") as unzipped:
                yield unzipped
        else:
            yield source


def _iter_json_array(data: bytes) -> Iterator[tuple[int, str, str | None]]:
    try:
        items = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        yield 1, data.decode("utf-8", errors="replace"), f"unreadable JSON array file: {type(e).__name__}: {e}"
        return
    for i, item in enumerate(items, 1):
        yield i, jsontext.dumps(item, ensure_ascii=False), None


def _container(path: str) -> str | None:
    """"parquet" or "arrow" (datasets' save_to_disk writes Arrow IPC streams) by the file's suffix,
    else by its first bytes, read once (Parquet's ``PAR1``, an Arrow file's ``ARROW1``, a stream's
    continuation marker), whatever the file is called; None for text (JSON, gzipped or not)."""
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(ARROW_SUFFIXES):
        return "arrow"
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        head = f.read(6)
    if head[:4] == PARQUET_MAGIC:
        return "parquet"
    return "arrow" if head == ARROW_MAGIC or head[:4] == ARROW_STREAM_MARKER else None


def _iter_arrow(path: str) -> Iterator[tuple[int, str, str | None]]:
    import pyarrow as pa

    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        data = f.read()
    try:
        reader = pa.ipc.open_file(pa.BufferReader(data)) if data[:6] == ARROW_MAGIC else pa.ipc.open_stream(data)
        batches = ([reader.get_batch(i) for i in range(reader.num_record_batches)]
                   if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader)
        yield from _rows_as_json(batches)
    except pa.ArrowInvalid as e:
        raise InputError(f"{path} is not a readable Arrow file: {e}") from e


def streams_records(path: str) -> bool:
    """Whether ``iter_records`` reads the file a record at a time (JSON Lines), not whole (a JSON
    array, Parquet, Arrow): a plan may then read its first records cheaply."""
    if _container(path):
        return False
    with _open_text_source(path) as f:
        first = f.readline()
    return _is_jsonl(path) or first.lstrip(UTF8_BOM).lstrip()[:1] != b"["


def _is_jsonl(path: str) -> bool:
    return ".jsonl" in path.lower() or ".ndjson" in path.lower()


def _iter_parquet(path: str) -> Iterator[tuple[int, str, str | None]]:
    import pyarrow.parquet as pq

    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        pf = pq.ParquetFile(io.BytesIO(f.read()) if is_url(path) else f)
        yield from _rows_as_json(pf.iter_batches(batch_size=4096))


def _rows_as_json(batches) -> Iterator[tuple[int, str, str | None]]:
    """Each row of Arrow record batches (Parquet's, an Arrow file's) as (row number, JSON text,
    problem or None): a binary column that is not text is refused, never replaced."""
    row = 0
    for batch in batches:
        for rec in batch.to_pylist():
            row += 1
            try:
                yield row, jsontext.dumps(rec, ensure_ascii=False, default=_json_default), None
            except UnicodeDecodeError as e:
                shown = jsontext.dumps(rec, ensure_ascii=False, default=_json_shown)
                yield row, shown, f"a binary column holds bytes that are not valid UTF-8: {e.reason} at byte {e.start}"


def _json_default(obj: Any) -> Any:
    """Parquet values JSON has no type for: arrays as lists, decimals as numbers, binary as UTF-8
    text (strictly: bytes that are not text raise), dates and times as ISO 8601 text."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, decimal.Decimal):
        return float(obj)
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).decode("utf-8")
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    return str(obj)


def _json_shown(obj: Any) -> Any:
    """As _json_default, but bytes that are not text are shown escaped (for the errors file only)."""
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).decode("utf-8", errors="backslashreplace")
    return _json_default(obj)


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

"""Raw data files as every command reads them: which files a pattern names, and each file's
records (JSON Lines, a JSON array, Parquet, Arrow; gzipped or not, whatever the name).

One reader for preprocess (the Beam stage), eval, batch scoring and the API, through a small
``FileSystem`` seam: ``LOCAL`` (the local disk, and any fsspec URL such as gs://) here, Beam's
FileSystems in ``pipelines.io``. Loads no Beam and no JAX. A pattern is matched as Beam matches
it (``*`` within a path component, ``**`` across them), so every reader lists the same files.
"""

from __future__ import annotations

import contextlib
import decimal
import gzip
import io
import json
import os
import re
from collections.abc import Iterator
from typing import Any, BinaryIO, Protocol

from rmflow.schemas import jsontext
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.outputs import output_type_of
from rmflow.schemas.paths import is_url

FileInfo = tuple[str, int, float]  # (path, size in bytes, modification time)


class FileSystem(Protocol):
    """What reading data files needs of a file system."""

    def match(self, pattern: str) -> list[FileInfo]:
        """Every file ``pattern`` names: itself when it has no wildcard, else the files below its
        fixed part that match it (``*`` within a component, ``**`` across them)."""

    def open(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """The file's bytes as stored (no decompression)."""

    def names_in(self, folder: str) -> set[str] | None:
        """The names directly inside ``folder``; None when nothing is there."""


def translate_pattern(pattern: str) -> str:
    """A path pattern as a regular expression, as Beam's FileSystem translates it: ``*`` is any
    run of characters but ``/``, ``**`` any run at all, ``?`` one character, ``[...]`` a class."""
    out, i, n = "", 0, len(pattern)
    while i < n:
        c, i = pattern[i], i + 1
        if c == "*":
            if i < n and pattern[i] == "*":
                out, i = out + ".*", i + 1
            else:
                out += r"[^/\\]*"
        elif c == "?":
            out += "."
        elif c == "[":
            j = i + (i < n and pattern[i] == "!")
            j += j < n and pattern[j] == "]"
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out += r"\["
            else:
                stuff = pattern[i:j].replace("\\", "\\\\")
                i = j + 1
                stuff = "^" + stuff[1:] if stuff[0] == "!" else "\\" + stuff if stuff[0] == "^" else stuff
                out += f"[{stuff}]"
        else:
            out += re.escape(c)
    return r"(?ms)" + out + r"\Z"


class LocalOrFsspec:
    """The local disk, and any other URL through fsspec (gs:// needs the gcp extra's gcsfs)."""

    def match(self, pattern: str) -> list[FileInfo]:
        if pattern.endswith("/"):
            pattern += "*"
        prefix = re.match(r"^[^[*?]*", pattern).group(0)
        if is_url(pattern):
            return self._match_remote(pattern, prefix)
        if prefix == pattern:
            return [(pattern, os.path.getsize(pattern), os.path.getmtime(pattern))] if os.path.exists(pattern) else []
        root, regex = os.path.dirname(prefix), re.compile(translate_pattern(pattern))
        found = []
        for folder, _, names in os.walk(root or "."):
            for name in names:
                path = os.path.join(folder, name) if root else os.path.relpath(os.path.join(folder, name))
                if regex.match(path):
                    with contextlib.suppress(OSError):  # a file gone since the listing
                        found.append((path, os.path.getsize(path), os.path.getmtime(path)))
        return found

    def _match_remote(self, pattern: str, prefix: str) -> list[FileInfo]:
        fs, root = _fsspec(prefix)
        proto = pattern[: pattern.index("://") + 3]
        if prefix == pattern:
            if not fs.exists(root) or fs.isdir(root):
                return []
            info = fs.info(root)
            return [(pattern, int(info.get("size") or 0), _mtime(info))]
        regex = re.compile(translate_pattern(pattern))
        listing = fs.find(root.rpartition("/")[0] if not prefix.endswith("/") else root, detail=True)
        return [(p, int(i.get("size") or 0), _mtime(i)) for p, i in
                ((proto + k if not k.startswith(proto) else k, v) for k, v in listing.items()) if regex.match(p)]

    @contextlib.contextmanager
    def open(self, path: str):
        if not is_url(path):
            with open(path, "rb") as f:
                yield f
            return
        fs, root = _fsspec(path)
        with fs.open(root, "rb") as f:
            yield f

    def names_in(self, folder: str) -> set[str] | None:
        folder = folder.rstrip("/")
        if not is_url(folder):
            return set(os.listdir(folder)) if os.path.isdir(folder) else None
        return {p[len(folder) + 1:].split("/")[0] for p, _, _ in self.match(folder + "/**")} or None


def _fsspec(url: str):
    try:
        import fsspec

        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise InputError(f"cannot open {url}: {e}. For gs:// install the gcp extra (pip install 'rmflow[gcp]')") from e


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("mtime") or info.get("updated") or info.get("LastModified") or 0
    return value.timestamp() if hasattr(value, "timestamp") else float(value) if isinstance(value, (int, float)) else 0.0


LOCAL = LocalOrFsspec()


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


def expand_inputs(patterns: tuple[str, ...], skipped: list[tuple[str, str]] | None = None,
                  fs: FileSystem | None = None) -> list[tuple[str, int]]:
    """Each pattern (file, glob or directory) to the sorted (path, size) of its data files."""
    return [(path, size) for path, size, _ in list_inputs(patterns, skipped, fs)]


def list_inputs(patterns: tuple[str, ...], skipped: list[tuple[str, str]] | None = None,
                fs: FileSystem | None = None) -> list[tuple[str, int, float]]:
    """The sorted (path, size, modification time) of the data files the patterns name: one
    listing per pattern, local or remote (metadata only). A file named on its own is read
    whatever its name (its content decides: gzip and Parquet by their magic bytes); a glob or
    a folder yields the files with a data suffix, except what lies under a hidden file or folder
    (``.ipynb_checkpoints``, ``.git``) or inside an earlier rmflow output (shards, a run, an eval):
    those are appended to ``skipped`` as (path, why)."""
    fs = fs or LOCAL
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
            metas = fs.match(query)
        except Exception as e:  # noqa: BLE001 - Beam raises BeamIOError, fsspec its own

            raise InputError(f"cannot list input {pattern!r}: {e}") from e
        if not has_glob and not is_dir:  # one file, named: read it whatever it is called
            files = {path: (size, mtime) for path, size, mtime in metas}
        else:
            root = stripped if is_dir else _glob_root(pattern)
            files = {}
            excluded = _excluded(root, [path for path, _, _ in metas])
            for path, size, mtime in metas:
                why = excluded.get(path)
                if why:
                    if skipped is not None and is_supported(path):
                        skipped.append((path, why))
                elif is_supported(path):
                    files[path] = (size, mtime)
        own = output_type_of(fs.names_in(stripped) or set()) if is_dir else None
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
    found = {folder: found_type for folder, names in names_in.items() if (found_type := output_type_of(names))}
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
            if folder in found:
                out[path] = f"inside an rmflow {found[folder]} ({folder})"
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


def iter_records(path: str, fs: FileSystem | None = None) -> Iterator[tuple[int, str, str | None]]:
    """(1-based line or row number, raw text, decode problem or None) for each record of a file.

    JSON Lines: every line that is not blank. A ``.json`` file whose first character is
    ``[`` is read as one JSON array. Parquet: each row, rendered as JSON. A line that is
    not valid UTF-8 comes back with the undecodable bytes replaced and a problem message.
    """
    fs = fs or LOCAL
    container = _container(path, fs)
    if container == "parquet":
        yield from _iter_parquet(path, fs)
        return
    if container == "arrow":
        yield from _iter_arrow(path, fs)
        return
    with _open_text_source(path, fs) as f:
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
def _open_text_source(path: str, fs: FileSystem):
    """Open a data file, gunzipping it when it starts with gzip's magic bytes, whatever its
    name, with Python's gzip module: unlike Beam's CompressedFile it raises on a truncated
    stream instead of ending early and quietly."""
    with fs.open(path) as raw:
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


def _container(path: str, fs: FileSystem) -> str | None:
    """"parquet" or "arrow" (datasets' save_to_disk writes Arrow IPC streams) by the file's suffix,
    else by its first bytes, read once (Parquet's ``PAR1``, an Arrow file's ``ARROW1``, a stream's
    continuation marker), whatever the file is called; None for text (JSON, gzipped or not)."""
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(ARROW_SUFFIXES):
        return "arrow"
    with fs.open(path) as f:
        head = f.read(6)
    if head[:4] == PARQUET_MAGIC:
        return "parquet"
    return "arrow" if head == ARROW_MAGIC or head[:4] == ARROW_STREAM_MARKER else None


def _iter_arrow(path: str, fs: FileSystem) -> Iterator[tuple[int, str, str | None]]:
    import pyarrow as pa

    with fs.open(path) as f:
        data = f.read()
    try:
        reader = pa.ipc.open_file(pa.BufferReader(data)) if data[:6] == ARROW_MAGIC else pa.ipc.open_stream(data)
        batches = ([reader.get_batch(i) for i in range(reader.num_record_batches)]
                   if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader)
        yield from _rows_as_json(batches)
    except pa.ArrowInvalid as e:
        raise InputError(f"{path} is not a readable Arrow file: {e}") from e


def streams_records(path: str, fs: FileSystem | None = None) -> bool:
    """Whether ``iter_records`` reads the file a record at a time (JSON Lines), not whole (a JSON
    array, Parquet, Arrow): a plan may then read its first records cheaply."""
    fs = fs or LOCAL
    if _container(path, fs):
        return False
    with _open_text_source(path, fs) as f:
        first = f.readline()
    return _is_jsonl(path) or first.lstrip(UTF8_BOM).lstrip()[:1] != b"["


def _is_jsonl(path: str) -> bool:
    return ".jsonl" in path.lower() or ".ndjson" in path.lower()


def _iter_parquet(path: str, fs: FileSystem) -> Iterator[tuple[int, str, str | None]]:
    import pyarrow.parquet as pq

    with fs.open(path) as f:
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



"""Shards and runs on object stores (``gs://``, any fsspec URL): staged through local disk.

Training reads shards with Grain's ArrayRecord reader, which needs local files, so remote shards
are copied once into a local cache (``RMFLOW_CACHE``, default ``~/.cache/rmflow``) before the
run starts; the copy needs as much free disk as the shards take, which is checked first and
said. A remote run directory is written locally (in the same cache) and mirrored to the remote
after every checkpoint and at the end; ``--resume`` first brings the remote run down. A remote
run given to eval, score or export is copied down the same way. ``gs://`` needs ``gcsfs``
(the ``gcp`` extra); any other fsspec protocol works the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

from rmflow.schemas.errors import RmflowError
from rmflow.schemas.manifest import COMPLETED_FILE, MANIFEST_FILE
from rmflow.schemas.paths import is_remote

log = logging.getLogger("rmflow")


class StorageError(RmflowError, OSError):
    """A remote path cannot be read or written, or the local disk is too small; says which."""


def _fs(url: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise StorageError(f"cannot open {url}: {e}. For gs:// install the gcp extra (pip install 'rmflow[gcp]')") from e


def cache_dir(url: str, purpose: str) -> str:
    """The local folder that mirrors ``url`` (stable per URL)."""
    root = os.environ.get("RMFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rmflow")
    tag = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]
    return os.path.join(root, purpose, f"{os.path.basename(url.rstrip('/')) or 'root'}-{tag}")


def _listing(fs, root: str) -> dict[str, int]:
    """Relative path -> size of every file under ``root``."""
    root = root.rstrip("/")
    return {p[len(root) + 1:]: int(info.get("size") or 0)
            for p, info in fs.find(root, detail=True).items() if info.get("type") != "directory"}


def _check_disk(needed: int, folder: str, what: str) -> None:
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise StorageError(f"{what} needs {needed / 2**30:.2f} GiB of local disk in {folder}, only "
                           f"{free / 2**30:.2f} GiB are free: set RMFLOW_CACHE to a larger disk")


def download(url: str, local: str, files: dict[str, int]) -> None:
    fs, root = _fs(url)
    root = root.rstrip("/")
    for rel in sorted(files):
        dest = os.path.join(local, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fs.get_file(f"{root}/{rel}", dest)


def stage_shards(url: str) -> str:
    """A local copy of a remote shard folder (reused while its manifest is unchanged)."""
    if not is_remote(url):
        return url
    fs, root = _fs(url)
    root = root.rstrip("/")
    if not fs.exists(f"{root}/{COMPLETED_FILE}"):
        if not fs.exists(root):
            raise StorageError(f"{url} does not exist: give a shard folder written by `rmflow preprocess`")
        raise StorageError(f"{url} has no COMPLETED marker: `rmflow preprocess` did not finish writing it")
    local = cache_dir(url, "shards")
    manifest = fs.cat_file(f"{root}/{MANIFEST_FILE}")
    if os.path.exists(os.path.join(local, COMPLETED_FILE)):
        with open(os.path.join(local, MANIFEST_FILE), "rb") as f:
            if f.read() == manifest:
                log.info("shards of %s already staged in %s", url, local)
                return local
    files = {k: v for k, v in _listing(fs, root).items() if k != COMPLETED_FILE}
    needed = sum(files.values())
    _check_disk(needed, os.path.dirname(local), f"staging {url}")
    log.info("staging %s (%.2f GiB) to %s", url, needed / 2**30, local)
    if os.path.exists(local):
        shutil.rmtree(local)
    download(url, local, files)
    open(os.path.join(local, COMPLETED_FILE), "w").close()  # last: the copy is complete
    return local


def has_manifest(url: str) -> bool:
    fs, root = _fs(url)
    return fs.exists(f"{root.rstrip('/')}/{MANIFEST_FILE}")


def is_shard_folder(paths: list[str]) -> bool:
    """Whether ``paths`` (an eval set's) is one shard folder, local or remote, not raw files."""
    return len(paths) == 1 and has_manifest(paths[0])


def stage_run(url: str, *, must_exist: bool = True) -> str:
    """A local copy of a remote run directory (for resume, eval, score, export)."""
    if not is_remote(url):
        return url
    fs, root = _fs(url)
    local = cache_dir(url, "runs")
    files = _listing(fs, root) if fs.exists(root) else {}
    if not files:
        if must_exist:
            raise StorageError(f"{url} does not exist or is empty: give a run directory written by `rmflow train`")
        os.makedirs(local, exist_ok=True)
        return local
    _check_disk(sum(files.values()), os.path.dirname(local), f"copying the run {url}")
    if os.path.exists(local):
        shutil.rmtree(local)
    download(url, local, files)
    return local


def local_run_dir(url: str, resume: bool) -> str:
    """Where a run writes: ``url`` itself when local; else a local mirror, seeded from the remote
    run when resuming."""
    if not is_remote(url):
        return url
    if resume:
        return stage_run(url, must_exist=False)
    fs, root = _fs(url)
    if fs.exists(root) and _listing(fs, root):  # the mirror would replace it: refuse, as for a local run
        raise StorageError(f"{url} already holds a run: pass --resume to continue it or choose another --output")
    local = cache_dir(url, "runs")
    if os.path.exists(local):
        shutil.rmtree(local)
    os.makedirs(local)
    return local


def mirror(local: str, url: str) -> None:
    """Make ``url`` hold what ``local`` holds: upload new or changed files, delete the remote files
    that are gone locally (older checkpoints)."""
    if not is_remote(url):
        return
    fs, root = _fs(url)
    root = root.rstrip("/")
    remote = _listing(fs, root) if fs.exists(root) else {}
    here = {}
    for folder, _, names in os.walk(local):
        for name in names:
            path = os.path.join(folder, name)
            here[os.path.relpath(path, local).replace(os.sep, "/")] = os.path.getsize(path)
    for rel, size in sorted(here.items()):
        if remote.get(rel) != size or rel.endswith((".json", ".jsonl")) or "tensorboard" in rel:
            fs.put_file(os.path.join(local, rel), f"{root}/{rel}")
    gone = [f"{root}/{rel}" for rel in remote if rel not in here]
    if gone:
        fs.rm(gone)

"""What a path names: an operating-system path, or a URL (``scheme://...``) that a filesystem
library reads (Beam's FileSystems, fsspec: gs://, s3://, hf://, file://). One home for the test,
so that every stage sends the same strings to the same kind of reader."""

from __future__ import annotations

import os


def is_url(path: str) -> bool:
    """A URL rather than an OS path: read through a filesystem library, never through ``os.path``."""
    return "://" in path


def is_remote(path: str) -> bool:
    """A URL of storage elsewhere (not ``file://``): the trainer copies it to a local folder
    before reading it, and uploads what it writes there."""
    return is_url(path) and not path.startswith("file://")


def absolute(path: str) -> str:
    """A local path made absolute (from the current directory); a URL unchanged."""
    return path if is_url(path) else os.path.abspath(path)


def absolute_if_local(path: str | None) -> str | None:
    """Absolute when it names an existing local file or folder; otherwise (a hub id, a URL) unchanged."""
    return absolute(path) if path and not is_url(path) and os.path.exists(path) else path

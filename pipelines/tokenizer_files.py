"""A tokenizer's files read where a job is launched and written where its workers read them.

``load_tokenizer_assets`` reads them once, from a local folder, any Beam filesystem path such
as gs://, or the Hugging Face Hub; ``write_tokenizer_files`` writes them, as used, into the
job's staging folder, so Dataflow workers need no access to where the tokenizer came from.
"""

from __future__ import annotations

import dataclasses
import os

from apache_beam.io.filesystems import FileSystems
from rmflow.pipelines import io as rio
from rmflow.rendering.tokenize import TokenizerAssets, TokenizerError
from rmflow.schemas.manifest import TOKENIZER_FILES
from rmflow.schemas.paths import is_url


def _looks_like_path(name: str) -> bool:
    """A hub id is 'name' or 'namespace/name'; anything else is meant as a path."""
    return is_url(name) or os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 \
        or os.sep != "/" and os.sep in name


def load_tokenizer_assets(name_or_path: str, chat_template_file: str | None = None) -> TokenizerAssets:
    """Read a tokenizer's files from a folder (local or any Beam filesystem) or a hub id."""
    files: dict[str, bytes] = {}
    folder = name_or_path.rstrip("/")
    if FileSystems.exists(folder + "/tokenizer_config.json") or FileSystems.exists(folder + "/tokenizer.json"):
        for name in TOKENIZER_FILES:
            path = f"{folder}/{name}"
            if FileSystems.exists(path):
                with FileSystems.open(path, compression_type="uncompressed") as f:
                    files[name] = f.read()
    elif os.path.exists(name_or_path):
        raise TokenizerError(
            f"{name_or_path} is not a tokenizer folder: it has no tokenizer.json or tokenizer_config.json"
        )
    elif _looks_like_path(name_or_path):  # not a hub id: no point asking the Hub
        raise TokenizerError(f"tokenizer folder {name_or_path} does not exist: pass a tokenizer folder "
                             "(with tokenizer.json) or a Hugging Face Hub id such as HuggingFaceTB/SmolLM2-135M")
    else:
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(name_or_path, allow_patterns=list(TOKENIZER_FILES))
        except Exception as e:  # offline, unknown repo, gated repo ...
            raise TokenizerError(
                f"tokenizer {name_or_path!r} is neither a folder nor a reachable Hugging Face Hub id "
                f"({type(e).__name__}: {e}). Pass a local tokenizer folder with --tokenizer."
            ) from e
        for name in TOKENIZER_FILES:
            path = os.path.join(local, name)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    files[name] = f.read()
    template = None
    if chat_template_file:
        if not FileSystems.exists(chat_template_file):
            raise TokenizerError(f"--chat-template file {chat_template_file} does not exist")
        with FileSystems.open(chat_template_file, compression_type="uncompressed") as f:
            template = f.read().decode("utf-8")
    return TokenizerAssets(name_or_path, files, template)


def write_tokenizer_files(assets: TokenizerAssets, folder: str) -> None:
    """Write the tokenizer's files as used (the chat template override applied) into ``folder``
    (local or any Beam filesystem)."""
    for name, data in assets.files_as_used().items():
        rio.write_bytes(f"{folder.rstrip('/')}/{name}", data)


def read_tokenizer_files(folder: str, name: str) -> TokenizerAssets:
    """The assets ``write_tokenizer_files`` wrote, named ``name`` again: the same tokenizer, the
    same identity (``key``, ``sha256``), as the template is in the files."""
    return dataclasses.replace(load_tokenizer_assets(folder), name=name)

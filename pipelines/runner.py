"""Which runner a Beam job runs on, and the pipeline for it: one place for the preprocess and
the batch scoring jobs.

A local runner ("DirectRunner") runs Beam's portable FnApiRunner directly: Beam's own
DirectRunner would first try Prism, which downloads a binary. ``launched`` removes the local
temporary folder every ``beam.Pipeline`` makes when it is built: Beam removes it only when the
pipeline runs, so a job refused before it starts (bad input, an output in the way) would leave
one folder in the system's temporary directory per attempt.
"""

from __future__ import annotations

import contextlib
import difflib
import shutil
from collections.abc import Iterator, Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from rmflow.schemas.errors import RmflowError

LOCAL_RUNNERS = ("directrunner", "direct", "fnapirunner")


def is_local(runner: str) -> bool:
    """Whether ``runner`` runs the job in this process (and its worker processes)."""
    return runner.lower() in LOCAL_RUNNERS


class UnknownOption(RmflowError, ValueError):
    """A flag given to a Beam job that neither its command nor Beam knows (Beam would drop it)."""


def unknown_beam_flags(beam_args: Sequence[str]) -> list[str]:
    """The flags of ``beam_args`` that no Beam pipeline option reads (Beam's own parser, which
    otherwise discards them with a log line nobody sees)."""
    from apache_beam.options.pipeline_options import _BeamArgumentParser

    parser = _BeamArgumentParser(allow_abbrev=False)
    for cls in {str(c): c for c in PipelineOptions.__subclasses__()}.values():
        cls._add_argparse_args(parser)
    _, unknown = parser.parse_known_args(list(beam_args))
    return [u for u in unknown if u.startswith("-")]


def runner_options(beam_args: Sequence[str], runner: str, own_flags: Sequence[str] = (),
                   command: str = "") -> PipelineOptions:
    """Beam's options from ``beam_args``, with ``runner`` where they name none. A flag that is no
    Beam option either (a misspelt option of the command, say ``--max-lenght``) is refused in one
    line, with the command's nearest flag (``own_flags``), never dropped."""
    unknown = unknown_beam_flags(beam_args)
    if unknown:
        flag = unknown[0].split("=")[0]
        near = difflib.get_close_matches(flag, list(own_flags), n=1)
        raise UnknownOption(f"{flag} is neither an option of rmflow {command} nor a Beam pipeline option"
                            + (f": did you mean {near[0]}?" if near else " (see --help)"))
    opts = PipelineOptions(list(beam_args))
    std = opts.view_as(StandardOptions)
    std.runner = std.runner or runner
    return opts


def new_pipeline(opts: PipelineOptions) -> beam.Pipeline:
    """A pipeline for the runner ``opts`` name (``runner_options``)."""
    if is_local(opts.view_as(StandardOptions).runner):
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return beam.Pipeline(runner=FnApiRunner(), options=opts)
    return beam.Pipeline(options=opts)


@contextlib.contextmanager
def launched(p: beam.Pipeline) -> Iterator[beam.Pipeline]:
    """``p`` for building and running; its local temporary folder is gone afterwards, whether
    the job ran, failed or was refused before it started."""
    try:
        yield p
    finally:
        shutil.rmtree(p.local_tempdir, ignore_errors=True)

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
import shutil
from collections.abc import Iterator, Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

LOCAL_RUNNERS = ("directrunner", "direct", "fnapirunner")


def is_local(runner: str) -> bool:
    """Whether ``runner`` runs the job in this process (and its worker processes)."""
    return runner.lower() in LOCAL_RUNNERS


def runner_options(beam_args: Sequence[str], runner: str) -> PipelineOptions:
    """Beam's options from ``beam_args``, with ``runner`` where they name none."""
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

"""Flex Template entry point: the launcher runs this file with --<parameter>=<value> arguments
and Dataflow's pipeline options; it submits the preprocess job and returns."""

from rmflow.pipelines.template import main

if __name__ == "__main__":
    main()

"""Flex Template entry point of the scoring job: the launcher runs this file with
--<parameter>=<value> arguments and Dataflow's pipeline options; it submits the job and returns."""

from rmflow.scoring.template import main

if __name__ == "__main__":
    main()

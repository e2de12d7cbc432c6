"""The preprocess stage (installed as ``rmflow.pipelines``): an Apache Beam pipeline from raw
preference or stepwise data to ArrayRecord shards and their manifest. Imports ``rmflow.schemas``,
never JAX."""

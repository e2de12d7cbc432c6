"""The preprocess stage (installed as ``rmflow.pipelines``): an Apache Beam pipeline from raw
preference, stepwise or K-response data to ArrayRecord shards and their manifest. Imports
``rmflow.schemas`` and ``rmflow.rendering``, never JAX."""

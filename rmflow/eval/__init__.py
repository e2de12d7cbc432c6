"""`rmflow eval`: metrics (pure numpy), RewardBench scoring, reports, the orchestration, and the
named eval sets a run preprocesses from raw files before it starts."""

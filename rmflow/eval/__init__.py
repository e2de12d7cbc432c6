"""`rmflow eval`: figures (its metrics, pure numpy), ranking (K responses per prompt),
RewardBench scoring, reports, the orchestration, and the named eval sets a run preprocesses from
raw files before it starts."""

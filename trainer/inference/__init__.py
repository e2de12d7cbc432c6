"""One inference path, in modules by job (``load``, ``programs``, ``shapes``, ``cores``,
``units``): a trained reward model loaded with what scoring it needs, and the scoring
core every consumer shares (`rmflow eval`, `rmflow score`, the Python API, export, the reward
server and batch scoring).

``load_model`` reads a run directory (its newest or a given checkpoint) or an exported
checkpoint folder, local or remote, with its tokenizer folder, pad id, step separator and kind
(``schemas.kinds``). ``score_sequences`` / ``score_pairs`` / ``score_steps`` /
``score_responses`` run it: pairs, solutions and K responses packed as in training and scored by
the training code's own forward (``RECORD_SCORING``: each data kind's). Consumers reach these
through the one front door, ``rmflow.RewardModel``; nothing here imports the training loop.
"""

from rmflow.trainer.inference.cores import (  # noqa: F401
    PACKED_CORES,
    SCORING_CORES,
    SequenceScorer,
    StepScorer,
    score_pairs,
    score_sequences,
    score_steps,
)
from rmflow.trainer.inference.load import (  # noqa: F401
    BARE_HEAD_SEED,
    NORMALIZATION_FILE,
    LoadedModel,
    ModelLoadError,
    exported_render,
    load_model,
    require_tokenizer,
    use_member_reward,
    write_normalization,
)
from rmflow.trainer.inference.packed import PackedScorer, PackedShapes  # noqa: F401
from rmflow.trainer.inference.programs import (  # noqa: F401
    _packed_pair_rewards,
    _rewards,
    _rewards_and_outputs,
    _step_probabilities,
)
from rmflow.trainer.inference.shapes import BATCH_OVERHEAD_TOKENS, ScoringShapes  # noqa: F401
from rmflow.trainer.inference.units import (  # noqa: F401
    RECORD_SCORING,
    UNIT_RESPONSES,
    response_units,
    score_groups,
    score_responses,
    score_responses_outputs,
    shared_prefix,
)

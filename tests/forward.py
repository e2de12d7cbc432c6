"""Our reward model's forward, jitted, for tests that compare it with another implementation:
one compilation a (model, shape), where running the model op by op compiles each of its hundreds
of operations for every new shape."""

from flax import nnx


@nnx.jit
def rewards(model, input_ids, positions, segment_ids, reward_index):
    return model(input_ids, positions, segment_ids, reward_index)


@nnx.jit
def logits(model, input_ids, positions, segment_ids, reward_index, branch_ids=None):
    return model.logits(input_ids, positions, segment_ids, reward_index, branch_ids)


@nnx.jit
def hidden_at(model, input_ids, positions, segment_ids, reward_index, branch_ids=None):
    return model.hidden_at(input_ids, positions, segment_ids, reward_index, branch_ids)


@nnx.jit
def hidden_states(model, input_ids, positions, segment_ids):
    return model.model.hidden_states(input_ids, positions, segment_ids)

"""Rewards from a trained model: the Python API (``RewardModel``), each kind's scorer (what
`rmflow score`, its Beam job and the server share), the batch-scoring Beam job and its Flex
Template."""

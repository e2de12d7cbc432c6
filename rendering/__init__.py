"""The rendering contract: how a raw record becomes the token ids a reward model reads.

What must be identical between the training data and what is scored later lives here, imported
by both stages' callers and by nothing of either stage's machinery: the raw layouts
(``formats``), the chat template and tokenization with the reward token of every reply and
step (``tokenize``), and the length policy (``length``). It loads no Beam and no JAX: the
Beam stage (``pipelines``) wraps it in its steps; the API, eval, batch scoring and the
server call it directly.
"""

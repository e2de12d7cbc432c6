"""The rendering contract: how a raw record becomes the token ids a reward model reads.

What must be identical between the training data and what is scored later lives here, imported
by both stages' callers and by nothing of either stage's machinery: the raw layouts
(``formats``; K responses per prompt: ``responses``), the chat template and tokenization with
the reward token of every reply and step (``tokenize``), and the length policy (``length``);
the one reader of raw files (``files``), the preprocess steps as pure functions (``steps``),
chained in one process (``prepare``), and their counts (``accounting``). It loads no Beam and
no JAX: the Beam stage (``pipelines``) wraps the steps in its DoFns; the API, eval, batch
scoring and the server call it directly.
"""

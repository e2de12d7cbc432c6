"""What scoring raises, apart from the API that raises it (``rmflow.scoring.api`` re-exports both),
so that modules the API builds on can name them."""


class BadConversation(ValueError):
    """A conversation that cannot be scored; the message says why."""


class WrongModelKind(TypeError):
    """A method for outcome reward models called on a process reward model, or the reverse."""

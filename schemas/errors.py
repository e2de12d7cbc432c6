"""The base of every error and warning rmflow raises for the user to act on.

An ``RmflowError`` is a problem with the input, the configuration or the environment that the
message explains (what is wrong and what to do); the CLI prints it as one line and exits 1.
Anything else that escapes a command is a bug and keeps its traceback.
"""


class RmflowError(Exception):
    """A problem the user can fix; the message says what and how."""


class RmflowWarning(UserWarning):
    """Something the user should know (a check that could not run, work set aside); the CLI
    prints it as one ``warning:`` line."""

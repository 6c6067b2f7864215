"""One exception type for mistakes a user can fix.

The CLI prints a ``UserError`` as a single line and exits non-zero; every other
exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's input: the message names the file, key or sample and the fix."""


def first_line(exc: BaseException) -> str:
    """The first line of an error's message, for a one-line report; its type's name if the message is empty."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

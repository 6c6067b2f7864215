"""One exception type for mistakes a user can fix.

The CLI prints a ``UserError`` as a single line and exits non-zero; every other
exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's input: the message names the file, key or sample and the fix."""

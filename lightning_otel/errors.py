"""The one exception type for mistakes a user can fix; the CLI prints it without a traceback."""


class UserError(Exception):
    """Something the user gave or set up is wrong; the message says what and what to do."""

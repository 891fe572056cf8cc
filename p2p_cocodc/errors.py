"""The one exception type users see: its message says what to fix, and the CLI prints it as one line."""


class UserError(Exception):
    """Bad input from a user or a peer (config, CLI value, data path, payload). Never a bug of ours."""

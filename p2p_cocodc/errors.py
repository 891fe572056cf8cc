"""The exceptions users see: their messages are one line the CLI prints as is, never a traceback."""


class UserError(Exception):
    """Bad input from a user or a peer (config, CLI value, data path, payload). Never a bug of ours."""


class Stopped(Exception):
    """A run stopped early on a signal. Not a success: the process exits with ``exit_code``
    (128 + the signal number), and the message says where the run stopped and how to go on."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

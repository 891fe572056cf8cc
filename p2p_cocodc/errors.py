"""The exceptions users see: their messages are one line the CLI prints as is, never a traceback."""

import errno


class UserError(Exception):
    """Bad input from a user or a peer (config, CLI value, data path, payload). Never a bug of ours."""


class Stopped(Exception):
    """A run stopped early on a signal. Not a success: the process exits with ``exit_code``
    (128 + the signal number), and the message says where the run stopped and how to go on."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def listen_failed(exc: OSError, in_use: str, other: str, not_here: str | None = None) -> UserError:
    """The one line for a server that could not listen (every server of ours says it this way):
    ``in_use`` when its port is taken, ``not_here`` (if given) when the address is not this
    machine's, else ``other`` with the system's reason where it says ``{reason}``."""
    if exc.errno == errno.EADDRINUSE:
        return UserError(in_use)
    if exc.errno == errno.EADDRNOTAVAIL and not_here is not None:
        return UserError(not_here)
    return UserError(other.format(reason=exc.strerror or exc))

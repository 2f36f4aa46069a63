"""User-facing errors."""


class FlowRLError(Exception):
    """An error whose message is one sentence for the user (the CLI prints it without a traceback)."""


class Preempted(BaseException):
    """A second SIGTERM: stop at once (a BaseException, so that no ``except Exception`` on the way swallows it)."""

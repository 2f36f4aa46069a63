"""User-facing errors."""


class FlowRLError(Exception):
    """An error whose message is one sentence for the user (the CLI prints it without a traceback)."""

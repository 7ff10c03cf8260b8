"""Errors a user can act on. A stage prints them as one clear message (no traceback) and exits 1."""


class PipelineError(Exception):
    """Base of every error that names what is wrong (a key, a file, a column, a micro-batch)."""

"""The one error type of unusable user input in apt_ds.io (data files, tokenizers, templates)."""


class DataError(ValueError):
    """Data or tokenizer input is unusable; the message names the file and the problem.
    Data, tokenizer and template code all raise it, so that callers catch one error for all inputs."""

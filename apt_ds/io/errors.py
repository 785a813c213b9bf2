"""The error types of unusable user input in apt_ds.io: data files, tokenizers and templates
(DataError); model checkpoints (ModelLoadError)."""


class DataError(ValueError):
    """Data or tokenizer input is unusable; the message names the file and the problem.
    Data, tokenizer and template code all raise it, so that callers catch one error for all inputs."""


class ModelLoadError(ValueError):
    """The model path does not hold a loadable checkpoint of a supported family."""

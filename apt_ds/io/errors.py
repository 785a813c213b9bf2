"""The error types of unusable user input in apt_ds.io: data files, tokenizers and templates
(DataError); model checkpoints (ModelLoadError)."""


class DataError(ValueError):
    """Data or tokenizer input is unusable; the message names the file and the problem.
    Data, tokenizer and template code all raise it, so that callers catch one error for all inputs."""


def row_text(row: dict, name: str, number: int, source: str, needs: str, empty_means: str) -> str:
    """A row's text field, or a DataError naming the row: missing (a key one row lacks reads as
    None: datasets fills the column), not a string, or blank. `needs`: what every row must have;
    `empty_means`: what an empty one would leave."""
    import json

    value = row.get(name)
    if value is None:
        raise DataError(f"{source}: row {number} has no {name!r}: {needs}")
    if not isinstance(value, str):
        shown = json.dumps(value, ensure_ascii=False, default=str)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise DataError(f"{source}: row {number} has {name!r} {shown}, which is not text")
    if not value.strip():
        raise DataError(f"{source}: row {number} has an empty {name!r}: {empty_means}")
    return value


class ModelLoadError(ValueError):
    """The model path does not hold a loadable checkpoint of a supported family."""


def weights_misfit(error: RuntimeError, expected, stored, head_names) -> str:
    """Why a model's files did not load into the class its config.json builds, in one short line
    (load_state_dict's own message lists every key). `expected`: the class's tensor names;
    `stored`: the files'; `head_names`: a classifier's head tensors (none for other families)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if any("size mismatch" in line for line in lines):  # the weights of another shape: the first one names it
        return f"the weights do not fit config.json ({next(l for l in lines if 'size mismatch' in l)})"
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if any(name in missing for name in head_names):
        return ("no classifier head in the files (a base checkpoint, e.g. a BertModel): train a classifier on it with "
                "launch/train.py, then load or evaluate its export")
    return (f"the weights do not fit config.json: {len(missing)} tensors missing (e.g. {missing[:2]}), "
            f"{len(unexpected)} not the model's (e.g. {unexpected[:2]})")

"""What an export refuses to write: a tensor with a NaN or inf, as the run holds it or once cast
to the export's dtype. A diverged run's weights exported and loaded would generate garbage with
no error anywhere; one whose values exceed fp16's range (±65504) turns them into inf on the cast."""

from __future__ import annotations

import numpy as np
import torch

from apt_ds.algorithm.finite import NonFiniteError, first_nonfinite

DIVERGED = ("the run's weights (or its base model's) hold NaN or inf, as a run that diverged does; "
            "nothing was written. Train again with a lower learning rate (--lr)")


def check_export_tensor(name: str, full: torch.Tensor, written, dtype: str) -> None:
    """`full`: the fp32 tensor; `written`: what goes into the file (a tensor, or a GGUF's numpy array)."""
    bad = first_nonfinite([(name, full)])
    if bad is not None:
        raise NonFiniteError(f"export refused: {bad} is not finite; {DIVERGED}")
    if _overflowed(written):
        raise NonFiniteError(f"export refused: {name} does not fit --dtype {dtype} (values beyond its range, "
                             f"largest |value| {float(full.abs().max()):.4g}, become inf); export with --dtype bf16 or fp32")


def _overflowed(written) -> bool:
    if isinstance(written, torch.Tensor):
        return first_nonfinite([("", written)]) is not None
    array = np.asarray(written)
    return array.dtype.kind == "f" and not bool(np.isfinite(array).all())  # q8_0 blocks are raw bytes: scales checked by fp32


def dtype_name(dtype: torch.dtype) -> str:
    """The --dtype name of a torch dtype (the messages name the flag's value)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

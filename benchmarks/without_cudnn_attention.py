"""Run a Python script with cuDNN's kernels for `scaled_dot_product_attention` turned off, so that
PyTorch picks flash or memory-efficient attention instead.

cuDNN builds an execution plan for every attention shape it has not seen (PyTorch caches one per
shape). A pruning event that changes layers' KV-group counts gives the next steps new shapes, and
the teacher's no-grad forward asks for other plans than the student's: on the H200 a profiled 7B
step after such an event spent 210 ms of host time in cuDNN attention's forward, against 9 ms for
LoRA (docs/BENCHMARKS.md, third lease): those plans, most likely, which a run through this
wrapper tells (`gpu_check.py --attention no-cudnn` runs its scale runs through it).

    python benchmarks/without_cudnn_attention.py launch/train.py --device cuda ...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        raise SystemExit("usage: python benchmarks/without_cudnn_attention.py SCRIPT.py [ARGUMENTS ...]")
    script = Path(sys.argv[1])
    if not script.is_file():
        raise SystemExit(f"error: no script {script}")
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    sys.argv = sys.argv[1:]  # the script sees its own name and arguments
    sys.path[0] = str(script.resolve().parent)  # as `python SCRIPT.py` would set it
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()

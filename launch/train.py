#!/usr/bin/env python
"""Fine-tune a LLaMA model with APT.  See `python launch/train.py --help`.

    python launch/train.py --out runs/demo                       # one process, built-in tiny model + demo data
    deepspeed --num_gpus 2 launch/train.py --deepspeed ds_configs/zero3.json --model path/to/llama \
        --data train.jsonl --target-density 0.7 --steps 1000 --out runs/r1
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

try:
    from apt_ds.cli.train import main  # noqa: E402
except KeyboardInterrupt:  # Ctrl-C while the libraries load: nothing was read or written yet
    print("interrupted while starting; nothing was written", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())

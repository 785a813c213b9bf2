#!/usr/bin/env python
"""Score a model with lm-evaluation-harness, offline.  See `python launch/evaluate.py --help`.

    python launch/evaluate.py compact/ --tasks arc_easy,arc_challenge,hellaswag,piqa,mmlu,sst2,boolq --out results.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

try:
    from apt_ds.cli.evaluate import main  # noqa: E402
except KeyboardInterrupt:  # Ctrl-C while the libraries load: nothing was read or written yet
    print("interrupted while starting; nothing was written", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())

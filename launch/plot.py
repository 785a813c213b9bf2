#!/usr/bin/env python
"""Draw a run's curves and final shape into PNGs.  See `python launch/plot.py --help`.

    python launch/plot.py runs/demo                                  # -> runs/demo/plots/{curves,shape}.png
    python launch/plot.py runs/apt runs/lora --out runs/compare      # several runs overlaid
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

try:
    from apt_ds.cli.plot import main  # noqa: E402
except KeyboardInterrupt:  # Ctrl-C while the libraries load: nothing was read or written yet
    print("interrupted while starting; nothing was written", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())

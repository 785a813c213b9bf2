#!/usr/bin/env python
"""Export a run as a merged, physically smaller dense model.  See `python launch/export.py --help`.

    python launch/export.py runs/r1 --out compact/
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    from apt_ds.cli.export import main  # noqa: E402
except KeyboardInterrupt:  # Ctrl-C while the libraries load: nothing was read or written yet
    print("interrupted while starting; nothing was written", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())

"""Print docs/RELIABILITY.md's bad-input table from the lines tests/cli/test_reliability.py recorded.

    rm -f /tmp/errors.jsonl
    APT_DS_RECORD_ERRORS=/tmp/errors.jsonl python -m pytest -q tests/cli/test_reliability.py
    python benchmarks/reliability_table.py /tmp/errors.jsonl
"""

import json
import sys

COMMON = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--checkpoint-every", "4",
          "--data", "data.jsonl"]


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    print(f"{len(rows)} cases (paths shown relative to that directory):\n")
    print("| # | case | command (beyond the common flags) | the one line printed |")
    print("|---|---|---|---|")
    for number, row in enumerate(rows, 1):
        argv = row["argv"]
        if argv[0] == "train" and argv[1:1 + len(COMMON)] == COMMON:
            argv = [argv[0], *argv[1 + len(COMMON):]]
        command = " ".join(argv).replace("|", "\\|")
        error = row["error"].replace("|", "\\|")
        print(f"| {number} | {row['case']} | `{command}` | {error} |")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    main(sys.argv[1])

"""The commands in README.md and docs/*.md cannot rot.

Fenced blocks tagged ```bash run on a 2-core CPU in under a minute from a checkout: each is run
here, in a scratch directory that sees the checkout's files. Blocks tagged ```bash long (longer,
or files the reader brings) and ```bash gpu (a GPU or several nodes) are not run. In every block,
each flag given to a launch/ command must be one that command's parser knows, so a renamed flag
fails here even where the block does not run (proved below on a README command).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```bash(?P<tags>[^\n`]*)\n(?P<body>.*?)^```", re.M | re.S)
TAGS = ("", "long", "gpu")


def command_blocks(page: Path) -> list[tuple[str, str, int]]:
    """(tag, body, line) of every ```bash block of `page`."""
    text = page.read_text()
    return [(m["tags"].strip(), m["body"], text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def _parsers() -> dict:
    from apt_ds.cli.arguments import build_export_parser, build_train_parser
    from apt_ds.cli.evaluate import build_evaluate_parser
    from apt_ds.cli.plot import build_parser as build_plot_parser

    return {"launch/train.py": build_train_parser(), "launch/export.py": build_export_parser(),
            "launch/evaluate.py": build_evaluate_parser(), "launch/plot.py": build_plot_parser()}


def launch_flags(body: str) -> list[tuple[str, str]]:
    """(launch script, flag) for every flag given after a launch/ script in `body` (comments and
    line continuations read as bash reads them)."""
    found = []
    for line in body.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in prose-like lines: the block's own problem, reported below
            words = line.split()
        script = None
        for word in words:
            if word in ("&&", "||", "|", ";") or word.endswith(";"):
                script = None
            elif re.fullmatch(r"(\./)?launch/\w+\.py", word):
                script = word.removeprefix("./")
            elif script and word.startswith("--"):
                found.append((script, word.split("=", 1)[0]))
    return found


def unknown_flags(body: str, parsers: dict) -> list[str]:
    return [f"{script} {flag}" for script, flag in launch_flags(body)
            if script not in parsers or flag not in parsers[script]._option_string_actions]


BLOCKS = [(page, *block) for page in PAGES for block in command_blocks(page)]


def _id(entry) -> str:
    page, tag, _, line = entry
    return f"{page.relative_to(ROOT)}:{line}" + (f"[{tag}]" if tag else "")


def test_the_pages_have_command_blocks_and_every_tag_is_known():
    assert any(page.name == "README.md" for page, *_ in BLOCKS)
    bad = [_id(entry) for entry in BLOCKS if entry[1] not in TAGS]
    assert not bad, f"```bash blocks with a tag other than {TAGS}: {bad}"


@pytest.mark.parametrize("entry", BLOCKS, ids=_id)
def test_every_flag_of_a_launch_command_exists(entry):
    page, tag, body, line = entry
    assert not unknown_flags(body, _parsers()), f"{_id(entry)}: flags the command does not take"


def test_a_renamed_flag_in_a_readme_command_is_caught():
    """The proof: a README command with one flag renamed fails the check above."""
    parsers = _parsers()
    readme = [body for page, _, body, _ in BLOCKS if page.name == "README.md" and launch_flags(body)]
    assert readme, "README.md has no launch/ command"
    body = readme[0]
    script, flag = launch_flags(body)[0]
    renamed = body.replace(flag, flag + "-renamed", 1)
    assert not unknown_flags(body, parsers)
    assert unknown_flags(renamed, parsers) == [f"{script} {flag}-renamed"]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory that sees the checkout's files (links), where the blocks' outputs land, and the
    command lines already run there: a line repeated on another page (the demo run is on three)
    wrote the same files the first time, so it is not run again."""
    work = tmp_path_factory.mktemp("docs") / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", "bench_out") and not entry.name.startswith("."):
            (work / entry.name).symlink_to(entry)
    return work, set()


@pytest.mark.parametrize("entry", [entry for entry in BLOCKS if entry[1] == ""], ids=_id)
def test_a_quick_block_runs(entry, scratch):
    page, _, body, _ = entry
    work, ran = scratch
    lines = [line for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    script = "\n".join(line for line in lines if line not in ran)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # `python` is this interpreter
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{_id(entry)} failed:\n{script}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    ran.update(lines)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_resolves():
    """A link to a file of the checkout, or to a heading of a page, that a move broke fails here."""
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # links in code are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md":
                headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken

"""Every ```python block in README.md and docs/*.md runs, and their relative links resolve.

The blocks of one file run in order in one namespace (a page may set up data in an early block and
use it later), inside pytest's temporary folder so files they write land there. One test per file,
so a failure names the file; the failing block's line number is in the message, and the traceback
points at the line of the Markdown file itself. Output and shell commands go in ```text / ```sh
blocks, which are not run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # runs the docs' code

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line number of the block's first code line, code)`` for each ```python block."""
    blocks, code, start, language = [], [], 0, None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(line.strip()) if language is None or line.strip() == "```" else None
        if fence is None:
            if language is not None:
                code.append(line)
        elif language is None:
            language, code, start = fence.group(1), [], number + 1
        else:
            if language == "python":
                blocks.append((start, "\n".join(code) + "\n"))
            language = None
    if language is not None:
        raise AssertionError(f"{path.name}: a code block opened at line {start - 1} is never closed")
    return blocks


def run_blocks(path: Path) -> None:
    """Run the file's python blocks in order in one namespace."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    namespace: dict = {"__name__": f"doc_{path.stem.replace('-', '_')}"}
    for line, code in python_blocks(path):
        # Padding with blank lines makes traceback line numbers those of the Markdown file.
        compiled = compile("\n" * (line - 1) + code, str(path), "exec")
        try:
            exec(compiled, namespace)
        except Exception as error:
            raise AssertionError(
                f"{name}: the python block starting at line {line} failed: {type(error).__name__}: {error}"
            ) from error


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    run_blocks(path)


def test_block_parser_reads_fences_and_lines(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n```python\na = 1\n```\n```text\nnot run\n```\n```python\nb = a\n\nc = 2\n```\n")
    assert python_blocks(page) == [(3, "a = 1\n"), (9, "b = a\n\nc = 2\n")]


def test_a_failing_block_names_the_file_and_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# title\n\n```python\nx = 1\n```\n\n```python\nok = True\nraise ValueError('boom')\n```\n")
    with pytest.raises(AssertionError, match=r"starting at line 8 failed: ValueError: boom") as info:
        run_blocks(page)
    assert info.value.__cause__.__traceback__.tb_next.tb_lineno == 9  # the line in the Markdown file


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    slugs = set()
    for line in prose(path):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return slugs


def prose(path: Path) -> list[str]:
    """The lines of a Markdown file outside code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(path: Path) -> None:
    broken = []
    for target in LINK.findall("\n".join(prose(path))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
            continue
        if not linked.exists():
            broken.append(f"{target} (no file {linked.relative_to(ROOT)})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)} has broken links: {broken}"

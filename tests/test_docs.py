"""The README and docs/ point only at files of the repository, and those files (and the sections a link names)
exist; the README stays a front door; the config reference is the schema's current rendering."""

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", REPO / "README_zh.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
README_MAX_LINES = 200


def github_anchor(heading: str) -> str:
    """The `#fragment` GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading counts by its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading's anchor on `page` (repeated headings get -1, -2, ... as on GitHub); code blocks skipped."""
    found: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} (.+?)\s*#*\s*$", line)
        if heading and not fenced:
            anchor = github_anchor(heading.group(1))
            count = found.get(anchor, 0)
            found[anchor] = count + 1
            out.add(anchor if count == 0 else f"{anchor}-{count}")
    return frozenset(out)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repository(page):
    targets = [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]
    assert targets or page.name != "README.md"
    for target in targets:
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.is_relative_to(REPO) and path.exists(), f"{page.name}: {target} does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page.name}: {target}: no heading '#{anchor}' in {path.name}"


@pytest.mark.parametrize("readme", ["README.md", "README_zh.md"])
def test_the_readme_is_a_front_door(readme):
    lines = len((REPO / readme).read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"{readme} has {lines} lines (at most {README_MAX_LINES}): move detail into a page under docs/"
    )


def test_no_page_sends_readers_outside_the_repository():
    for page in PAGES:
        assert not re.search(r"(?<![\w/])shared/(specs|assets)", page.read_text()), page.name


def test_the_config_reference_is_the_current_schema():
    result = subprocess.run(
        [sys.executable, "-m", "mmpt.config_reference", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, (
        "docs/config_reference.md differs from a fresh rendering of the config schema; regenerate it with "
        f"`python -m mmpt.config_reference` and commit it.\n{result.stdout}{result.stderr}"
    )


def test_the_config_reference_lists_the_keys_of_every_kind_a_section_may_be():
    """`method.loss` is a contrastive or a sigmoid loss: the sigmoid one's own key is listed too, marked."""
    from mmpt.config_reference import rows
    from mmpt.methods import get_method

    listed = {row.key: row for row in rows(get_method("clip").config_class, "method.")}
    assert listed["method.loss.name"].type == '`"contrastive" | "sigmoid"`'
    assert listed["method.loss.exchange"].description.startswith("(name: sigmoid) how texts reach the other ranks")
    assert listed["method.loss"].type == "`mapping`"


def test_github_anchors():
    assert github_anchor("Partial redundancy (ZeRO++ hpZ)") == "partial-redundancy-zero-hpz"
    assert github_anchor("method: m2_encoder") == "method-m2_encoder"
    assert github_anchor("5. Evaluate while training, then release") == "5-evaluate-while-training-then-release"
    assert github_anchor("`run`") == "run"

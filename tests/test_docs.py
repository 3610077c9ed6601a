"""The README and docs/ point only at files of the repository, and those files exist."""

import re

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repository(page):
    targets = [t.split("#")[0] for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]
    assert targets or page.name != "README.md"
    for target in filter(None, targets):
        path = (page.parent / target).resolve()
        assert path.is_relative_to(REPO) and path.exists(), f"{page.name}: {target}"


def test_no_page_sends_readers_outside_the_repository():
    for page in PAGES:
        assert not re.search(r"(?<![\w/])shared/(specs|assets)", page.read_text()), page.name

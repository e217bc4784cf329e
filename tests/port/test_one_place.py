"""Each feature's design is written in one place, its runtime room's README, and the port README is a
guide that links there:

- every runtime room (beam_hpu/runtime/<feature>/) has a README.md, and the port README links it;
- each runner unit's `why` is a short sentence that points to its room's README (the design is not
  retyped in the unit);
- the port README stays a guide: at most GUIDE_LINES lines, none longer than LINE_CHARS;
- the generated sections are current (`gen_readme.py --check`);
- no page of the guide or the rooms names a path of the old layout.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixes.unit import load_unit

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "beam_hpu/runtime"
GUIDE = REPO / "ports/beam-1-0/README.md"
ROOMS = sorted(p.parent.name for p in RUNTIME.glob("*/__init__.py"))
UNITS = sorted(RUNTIME.glob("*/beam-*.toml"))
GUIDE_LINES = 260
LINE_CHARS = 300
WHY_CHARS = 300
# Folders that no longer exist since the runtime rooms took their files.
OLD_PATHS = ("beam_hpu/hpu/", "beam_hpu/cpu/", "beam_hpu/patches/", "ports/beam-1-0/patches",
             "tests/hpu/", "tests/cpu/", "tests/patches/", "tests/speculative/")


def test_there_are_rooms_and_units():
    assert {"sliding_window", "window_kv", "prefill", "grammar", "speculative", "fp8", "expert_parallel",
            "guards"} <= set(ROOMS)
    assert len(UNITS) >= 11


@pytest.mark.parametrize("room", ROOMS)
def test_every_room_has_a_readme_the_guide_links(room):
    page = RUNTIME / room / "README.md"
    assert page.is_file(), page
    assert f"](../../beam_hpu/runtime/{room}/README.md)" in GUIDE.read_text(), room


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.stem)
def test_a_units_why_is_short_and_points_to_its_room(path):
    why = " ".join(load_unit(path).why.split())
    room = path.parent.name
    assert f"beam_hpu/runtime/{room}/README.md" in why, (path.name, why)
    assert len(why) <= WHY_CHARS, (path.name, len(why))


def test_the_guide_is_a_guide():
    lines = GUIDE.read_text().splitlines()
    assert len(lines) <= GUIDE_LINES, len(lines)
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > LINE_CHARS]
    assert long == []


def test_the_generated_sections_are_current():
    run = subprocess.run([sys.executable, str(REPO / "ports/beam-1-0/gen_readme.py"), "--check"],
                         cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_stale_room_page_fails_the_check(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gen_readme", REPO / "ports/beam-1-0/gen_readme.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = RUNTIME / "grammar" / "README.md"
    stale = re.sub(r"(<!-- generated:units -->\n).*?(<!-- end:units -->)", r"\1old text\n\2",
                   page.read_text(), flags=re.S)
    assert gen.render(stale, gen.page_sections()[page]) != stale


@pytest.mark.parametrize("page", [GUIDE, REPO / "README.md", *(RUNTIME / room / "README.md" for room in ROOMS)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_names_an_old_path(page):
    text = page.read_text()
    assert [old for old in OLD_PATHS if old in text] == []


@pytest.mark.parametrize("page", [GUIDE, *(RUNTIME / room / "README.md" for room in ROOMS)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_and_heading_a_page_links_exists(page):
    links = re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", page.read_text())
    assert sorted(p for p, _ in links if p and not (page.parent / p).exists()) == []
    for path, anchor in links:
        if anchor:
            target = (page.parent / path) if path else page
            assert anchor in slugs(target.read_text()), (path, anchor)


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    heads = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

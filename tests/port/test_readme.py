"""ports/beam-1-0/README.md explains every switch (generated from beam_hpu.settings.switches, so it cannot
drift), names every fix and patch with the room that describes it, and explains every flag and
variable of the recipe's launch block; the rooms' generated sections (their units, the KV pool table)
are current too."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from beam_hpu.settings import switches as envs
from serving.recipe import parse_launch_block

REPO = Path(__file__).resolve().parents[2]
README = REPO / "ports/beam-1-0/README.md"
# The published recipe, from the shared folder beside this clone (../shared), where there is one.
RECIPE_TEXT = REPO.parent / "shared" / "seeds" / "gaudi-recipe-beam-fp8.txt"


def gen_readme():
    spec = importlib.util.spec_from_file_location("gen_readme", REPO / "ports/beam-1-0/gen_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_sections_are_current():
    pages = gen_readme().page_sections()
    assert README in pages and len(pages) > 1
    for page, sections in pages.items():
        text = page.read_text()
        assert gen_readme().render(text, sections) == text, f"{page}: run python3 ports/beam-1-0/gen_readme.py"


def test_the_kv_pool_table_is_serving_kv_capacity_s():
    """The KV pool table (now in the window-KV room's README) is generated from serving.kv_capacity."""
    from serving.kv_capacity import pool_table

    page = REPO / "beam_hpu/runtime/window_kv/README.md"
    assert "<!-- generated:kv-pools -->\n" + "\n".join(pool_table()) + "\n<!-- end:kv-pools -->" in page.read_text()


def test_a_changed_switch_description_makes_the_readme_stale(monkeypatch):
    name = "BEAM_FSDPA_Q_TILE"
    switch = envs.SWITCHES[name]
    changed = envs.Switch(switch.name, switch.default, switch.parse, switch.description + " Changed.")
    monkeypatch.setitem(envs.SWITCHES, name, changed)
    text = README.read_text()
    assert gen_readme().render(text) != text


def test_every_switch_and_fix_is_described():
    text = README.read_text()
    flat = " ".join(text.split())  # the generated list wraps its lines
    for switch in envs.SWITCHES.values():
        assert f"**`{switch.name}`** (default `{switch.default}`): {' '.join(switch.description.split())}" in flat
    from fixes.profile import load_profile

    fixes = text[text.index("<!-- generated:fixes -->"):text.index("<!-- end:fixes -->")]
    port = load_profile("port-beam-1-0")
    base = {u.name for u in port.base.fixes}
    for unit in port.fixes:
        assert f"`{unit.name}`" in fixes, unit.name
        if unit.name in base:
            continue
        # A port unit: named in its room's row, and its why, scope and removal condition on the room's page.
        room = unit.source.parent.name
        row = next(line for line in fixes.splitlines() if f"runtime/{room}/README.md" in line)
        assert f"`{unit.name}`" in row, (unit.name, room)
        page = " ".join((unit.source.parent / "README.md").read_text().split())
        for said in (unit.scope, unit.remove_when):
            assert " ".join(said.split()).replace("|", "\\|") in page, (unit.name, said[:60])


def launch_blocks() -> list[str]:
    blocks = [(REPO / "serving/launch.sh").read_text()]
    if RECIPE_TEXT.is_file():
        blocks.append(RECIPE_TEXT.read_text())
    return blocks


@pytest.mark.parametrize("which", range(len(launch_blocks())), ids=["launch.sh", "published recipe"][: len(launch_blocks())])
def test_every_flag_and_variable_of_the_launch_block_is_explained(which):
    block = parse_launch_block(launch_blocks()[which])
    text = README.read_text()
    assert block.flags and block.env
    rows = set(re.findall(r"^\| `(--[a-z0-9-]+)[ `]", text, re.M))
    assert set(block.flags) <= rows, sorted(set(block.flags) - rows)
    env_rows = set(re.findall(r"^\| `([A-Z0-9_]+)`", text, re.M))
    for name in block.env:
        explained = name in env_rows or f"**`{name}`**" in text
        assert explained, name
    assert block.fix_profile == "v0.30.0" and "apply_all.py\" --profile v0.30.0" in text

#!/usr/bin/env python3
"""Regenerate the generated sections of the port's guide and of the runtime rooms' READMEs from
their one source each:

- ports/beam-1-0/README.md
  - switches: beam_hpu.settings.switches.SWITCHES (name, default, description) and
    beam_hpu.settings.guards.FORBIDDEN_ENV
  - fixes:    every runtime room (link, its README's title), its runner units (the port profile's)
              and runtime patches (beam_hpu.runtime.INDEX); then the v0.30.0 fixes
- beam_hpu/runtime/<room>/README.md
  - units:    the room's runner units (why, scope, remove_when of each beam-*.toml) and runtime
              patches (beam_hpu.runtime.INDEX: platform, why, scope, remove_when)
- beam_hpu/runtime/window_kv/README.md
  - kv-pools: serving.kv_capacity.pool_table (bf16 / FP8, full-context / window-sized KV pools)

    python3 ports/beam-1-0/gen_readme.py           # rewrite the sections
    python3 ports/beam-1-0/gen_readme.py --check   # exit 1 if a README is out of date
"""
from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = Path(__file__).resolve().parent / "README.md"
RUNTIME = REPO / "beam_hpu" / "runtime"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WIDTH = 110
# A unit's why ends with the pointer to its room's README; the room's own page drops it.
POINTER = re.compile(r"\s*See beam_hpu/runtime/\w+/README\.md\.?$")


def rooms() -> list[str]:
    """The runtime rooms: every folder of beam_hpu/runtime that is a package."""
    return sorted(p.parent.name for p in RUNTIME.glob("*/__init__.py"))


def room_of(unit) -> str | None:
    """The runtime room a port unit lives in, or None for a fix of fixes/units/."""
    try:
        rel = unit.source.resolve().relative_to(RUNTIME)
    except ValueError:
        return None
    return rel.parts[0]


def one_line(text: str) -> str:
    return " ".join(text.split())


def switches_section() -> str:
    from beam_hpu.settings.guards import FORBIDDEN_ENV
    from beam_hpu.settings.switches import SWITCHES

    items = [f"- **`{s.name}`** (default `{s.default}`): {s.description}" for s in SWITCHES.values()]
    items += [f"- **`{name}`** (refused when set): {reason}." for name, reason in FORBIDDEN_ENV.items()]
    return "\n".join(wrap(item) for item in items)


def wrap(item: str) -> str:
    """A list item in lines of at most WIDTH characters (markdown joins them again)."""
    return textwrap.fill(item, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def room_title(room: str) -> str:
    """The first heading of a room's README: what the room is about."""
    page = RUNTIME / room / "README.md"
    heads = [line[2:].strip() for line in page.read_text().splitlines() if line.startswith("# ")] if page.is_file() else []
    return heads[0] if heads else "(no README)"


def fixes_section() -> str:
    """Every runtime room (its README's title and link), its runner units in the profile's order
    and its runtime patches; then the v0.30.0 fixes the port profile applies first. A unit's
    package is named unless it is vllm_gaudi."""
    from beam_hpu.runtime import INDEX
    from fixes.profile import load_profile

    port = load_profile("port-beam-1-0")
    base = {u.name for u in port.base.fixes}
    named = lambda unit: f"`{unit.name}`" + ("" if unit.package == "vllm_gaudi" else f" ({unit.package})")  # noqa: E731
    out = ["| room: its design | runner units | runtime patches |", "|---|---|---|"]
    for room in rooms():
        units = [named(u) for u in port.fixes if u.name not in base and room_of(u) == room]
        patches = [f"`{p.name}`" for p in INDEX if p.module.split(".")[0] == room]
        out.append(f"| [`{room}`](../../beam_hpu/runtime/{room}/README.md): {room_title(room)} "
                   f"| {', '.join(units)} | {', '.join(patches)} |")
    fixes = [named(u) for u in port.fixes if u.name in base or room_of(u) is None]
    out += ["", wrap("- applied first, the v0.30.0 fix profile, each a file of [`fixes/units/`](../../fixes/units/): "
                     + ", ".join(fixes))]
    return "\n".join(out)


def units_section(room: str) -> str:
    """The room's runner units and runtime patches, from their own files."""
    from beam_hpu.runtime import INDEX
    from fixes.profile import load_profile

    cell = lambda text: one_line(text).replace("|", "\\|")  # noqa: E731
    out = []
    units = [u for u in load_profile("port-beam-1-0").fixes if room_of(u) == room]
    if units:
        out += ["Runner units (source edits of vllm-gaudi, profile `port-beam-1-0`; from their `beam-*.toml`):", "",
                "| unit | why | acts for | remove when |", "|---|---|---|---|"]
        for unit in units:
            why = POINTER.sub("", one_line(unit.why))
            out.append(f"| [`{unit.name}`]({unit.name}.toml) | {cell(why)} | {cell(unit.scope)} "
                       f"| {cell(unit.remove_when)} |")
    patches = [p for p in INDEX if p.module.split(".")[0] == room]
    if patches:
        if out:
            out.append("")
        out += ["Runtime patches (wraps in the running process; from `beam_hpu/runtime/__init__.py`'s index):", "",
                "| patch | platform | why | acts for | remove when |", "|---|---|---|---|---|"]
        for patch in patches:
            module = patch.module.split(".")[1]
            out.append(f"| [`{patch.name}`]({module}.py) | {patch.platform} | {cell(patch.why)} "
                       f"| {cell(patch.scope)} | {cell(patch.remove_when)} |")
    return "\n".join(out) if out else "(none)"


def kv_pools_section() -> str:
    from serving.kv_capacity import pool_table

    return "\n".join(pool_table())


def page_sections() -> dict[Path, dict]:
    """Each generated page and its sections: name -> function making the section's text."""
    pages = {README: {"switches": switches_section, "fixes": fixes_section}}
    for room in rooms():
        pages[RUNTIME / room / "README.md"] = {"units": lambda room=room: units_section(room)}
    pages[RUNTIME / "window_kv" / "README.md"]["kv-pools"] = kv_pools_section
    return pages


def render(text: str, sections: dict | None = None) -> str:
    """`text` with its generated sections rewritten (by default the port README's)."""
    for name, make in (page_sections()[README] if sections is None else sections).items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- end:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README has no generated:{name} section")
        text = pattern.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    stale = []
    for page, sections in page_sections().items():
        if not page.is_file():
            stale.append(f"{page.relative_to(REPO)} does not exist")
            continue
        text = page.read_text()
        new = render(text, sections)
        if new == text:
            continue
        if "--check" in argv:
            stale.append(f"{page.relative_to(REPO)} is out of date")
        else:
            page.write_text(new)
    for line in stale:
        print(f"{line}: run python3 {Path(__file__).relative_to(REPO)}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

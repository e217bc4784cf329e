#!/usr/bin/env python3
"""Regenerate the generated sections of ports/beam-1-0/README.md from their one source each:

- switches: beam_hpu.settings.switches.SWITCHES (name, default, description) and
  beam_hpu.settings.guards.FORBIDDEN_ENV
- fixes:    the fix profiles' units (name, package, why, scope, remove_when)
- kv-pools: serving.kv_capacity.pool_table (bf16 / FP8, full-context / window-sized KV pools)

    python3 ports/beam-1-0/gen_readme.py           # rewrite the sections
    python3 ports/beam-1-0/gen_readme.py --check   # exit 1 if the README is out of date
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = Path(__file__).resolve().parent / "README.md"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def switches_section() -> str:
    from beam_hpu.settings.guards import FORBIDDEN_ENV
    from beam_hpu.settings.switches import SWITCHES

    out = []
    for switch in SWITCHES.values():
        out.append(f"- **`{switch.name}`** (default `{switch.default}`): {switch.description}")
    for name, reason in FORBIDDEN_ENV.items():
        out.append(f"- **`{name}`** (refused when set): {reason}.")
    return "\n".join(out)


def fixes_section() -> str:
    from fixes.profile import load_profile

    port = load_profile("port-beam-1-0")
    out = ["| # | fix | package | why | acts for | remove when |", "|---|---|---|---|---|---|"]
    base = {u.name for u in port.base.fixes}
    for i, unit in enumerate(port.fixes, 1):
        where = "v0.30.0" if unit.name in base else "port"
        cell = lambda text: " ".join(text.split()).replace("|", "\\|")  # noqa: E731
        out.append(f"| {i} | `{unit.name}` ({where}) | {unit.package} | {cell(unit.why)} | {cell(unit.scope)} "
                   f"| {cell(unit.remove_when)} |")
    return "\n".join(out)


def kv_pools_section() -> str:
    from serving.kv_capacity import pool_table

    return "\n".join(pool_table())


SECTIONS = {"switches": switches_section, "fixes": fixes_section, "kv-pools": kv_pools_section}


def render(text: str) -> str:
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- end:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README has no generated:{name} section")
        text = pattern.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    text = README.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{README} is out of date: run python3 {Path(__file__).relative_to(REPO)}", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

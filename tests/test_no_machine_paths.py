"""No tracked file names a path of one machine: a clone anywhere else must work and read true.
Paths come from the checkout (`../shared` beside it), arguments or a temp dir. The image's own
path (`/opt/gaudi-cookbook`, the recipe's $COOKBOOK) is the image's, not a machine's."""

import re
import subprocess

from tests.support.engines import REPO

# Home and workspace roots of the machines this project has run on or could (built from pieces
# so this file does not name them itself).
MACHINE_ROOTS = re.compile("(?<![\\w.])/(" + "|".join(["wo" + "rk", "ro" + "ot", "ho" + "me", "Us" + "ers", "mnt"]) + ")/")


def machine_paths(text: str) -> list[str]:
    return [m.group(0) for m in MACHINE_ROOTS.finditer(text)]


def test_no_tracked_file_names_a_machine_path():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    found = {}
    for name in files.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        lines = [f"{i}: {line.strip()[:120]}" for i, line in enumerate(text.splitlines(), 1) if machine_paths(line)]
        if lines:
            found[name] = lines
    assert found == {}


def test_the_finder_sees_them():
    sample = "RECIPE = Path('/" + "work/shared/seeds/x.txt')\nhome = '/" + "root/.cache'"
    assert machine_paths(sample) == ["/" + "work/", "/" + "root/"]
    assert machine_paths("COOKBOOK=/opt/gaudi-cookbook ../shared/x ~/.cache/beam-hpu a/work/b") == []

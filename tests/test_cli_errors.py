"""Bad input on the command line is one line naming the flag or file at fault and exit 2, not a
traceback; called from Python, `main(argv)` raises, so tests and callers see the exception."""

import subprocess
import sys

import pytest

from beam_hpu.cli import main
from tests.support.engines import REPO

TINY = REPO / "beam_hpu" / "tiny" / "data" / "trained_tiny"


@pytest.mark.parametrize("argv, culprit", [
    (["reference", str(TINY), "--text", str(REPO / "README.md"), "--out", "{tmp}/r.json", "--kv-scales", "{tmp}/none"],
     "--kv-scales"),
    (["calibrate-kv", "{tmp}/none", "--text", str(REPO / "README.md"), "--out", "{tmp}/overlay"], "none/config.json"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, culprit):
    argv = [a.format(tmp=tmp_path) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "beam_hpu.cli", *argv], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"beam-hpu {argv[0]}: ") and culprit in last
    assert "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match=culprit):
        main(argv)

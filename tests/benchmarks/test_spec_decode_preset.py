"""benchmarks/spec_decode.py's `--preset all`: every method the README's one-run row compares, each
configured as the demo serves it (the committed drafters' own directories and k)."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import spec_decode  # noqa: E402

from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR, SERVED_DRAFTS  # noqa: E402
from beam_hpu.tiny.drafter import DRAFTER_DIR, SERVED_SPECULATIVE_TOKENS  # noqa: E402


def test_the_all_preset_runs_every_method_beside_a_second_plain_server():
    methods = dict(spec_decode.all_methods())
    assert list(methods) == ["plain", "ngram", "suffix", "eagle3", "dflash2"]
    assert methods["plain"] is None and methods["ngram"] == spec_decode.NGRAM
    assert methods["suffix"]["method"] == "suffix"
    assert methods["eagle3"] == {"method": "eagle3", "model": str(DRAFTER_DIR),
                                 "num_speculative_tokens": SERVED_SPECULATIVE_TOKENS}
    assert methods["dflash2"] == {"method": "dflash", "model": str(DFLASH2_DIR), "num_speculative_tokens": SERVED_DRAFTS}
    for name in ("eagle3", "dflash2"):
        assert (Path(methods[name]["model"]) / "config.json").is_file()
    json.dumps(methods)  # what --json writes

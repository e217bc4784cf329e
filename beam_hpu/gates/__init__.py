"""The gate suite of the recipe's "Verified" table, against any OpenAI-compatible Beam endpoint.

One module per gate, each with `run(endpoint, profile, **options) -> GateResult`; `run.py` runs
them (all or `--only`), prints the Markdown table and writes JSON. `tests/gates/run_gates.sh` is the
shell entry. Sizes come from a profile (`profile.py`): `gaudi` = the recipe's, `cpu` = CI's.
"""

GATES = ["smoke", "perplexity", "decode_prefill", "needles", "copy", "tools", "isolation", "stress"]

"""The tiny Beam: `checkpoint` (deterministic checkpoints in the published layout, the tokenizer,
the committed trained weights' location), `tasks` (the synthetic tasks the model learns and the
gates ask), `train` (the CPU trainer; only `python -m beam_hpu.tiny.train` and tests import it).
`data/` holds the tiny model's chat template and the committed trained weights."""

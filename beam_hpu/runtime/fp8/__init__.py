"""FP8 compute for Beam: activation rounding, portable and gathered FP8 experts."""

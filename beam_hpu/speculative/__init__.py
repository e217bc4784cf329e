"""Speculative decoding logic both platforms run: `rejection_sampling` verifies drafted tokens
(greedy and random acceptance, recovered tokens) for the CPU runtime patch cpu-rejection-sampler
and for the Gaudi port unit beam-sampled-verify alike."""

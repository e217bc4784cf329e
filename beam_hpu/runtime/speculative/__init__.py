"""Speculative decoding for Beam: drafting steps, verification under sampling and grammar."""

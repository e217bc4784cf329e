"""Serving configuration of the Beam port: recipe.yaml, launch.sh, the bucket file and its tools.

The tools run from the repository root: `python -m serving.make_buckets [--check]`,
`python -m serving.lint_buckets [FILE]`.
"""

"""`beam-hpu card-check`: on the node, measure each premise a switch waits on and print a verdict
per switch with the figures behind it (README.md in this folder)."""

"""HPU glue for the Beam port: the plain, CPU-tested functions the runner patches call.

`window`: exact sliding-window blocks and masks for paged decode and prefill with context.
`grammar_mask`: xgrammar's packed token bitmask applied on the logits' own device.
`prefill_attention`: prompt attention with cached context in query tiles under a workspace bound.
Nothing here imports the Habana bridge: the patches bring the tensors, these functions the math.
"""

"""The vllm-gaudi tree harness shared by the tree tests: a temp copy of the tree with a fix profile
applied (tree.py), slices of its source run on CPU (source.py, decode_step.py, window_kv_runner.py,
run_stubbed in tree.py with habana_stub.py), vLLM's layers dispatching to the tree's as on a node
(hpu_layers.py, with habana_ops.py's stand-ins for the Habana kernels; beam_layers.py builds Beam on
them and runs its modules one by one; hpu_attention_run.py prefills and decodes it through the
tree's attention backend, with habana_attention.py's stand-ins; trace.py records what a forward
there reached of vllm-gaudi and the Habana ops, trace_table.py makes beam_hpu/runtime/README.md's
table of it), and the vLLM trees the v0.30.0 fixes patch (fix_trees.py). Modules marked `gaudi_tree` skip without a tree (tests/conftest.py)."""

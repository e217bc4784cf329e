"""The consumer side of a step's metadata on a vllm-gaudi tree: the tree's own
HPUModelRunner._execute_model_generic (_seq_len, _num_blocks, _check_config, _use_graphs),
trim_attn_metadata, HpuModelAdapter.forward and HPUAttentionMetadataProcessor.process_metadata /
_set_block_mapping, into vLLM's real forward context, where the tree's own
patched_attention_forward (ops/hpu_attention.py) picks each layer's metadata.

Every layer's attention records the processed metadata it is handed (TreeRun.seen). Between the
trim and the forward sits a stand-in for the HPU graph wrapper: it hashes the inputs by the PT
bridge's rule (tuples by element, tensors by shape, the rest by value) and pops
bypass_hpu_graphs, as the wrapper does.
"""
from __future__ import annotations

import ast
import collections
import contextlib
import logging
import math
from types import SimpleNamespace

import torch

from tests.support.gaudi.source import PROCESSOR_CLS, RUNNER_CLS, load
from tests.support.gaudi.window_kv_decode import BS, WINDOW
from tests.support.hpu_graph_hash import bridge_hash, bridge_tensors


def dataclass_fields(root) -> list[str]:
    """The field names of the tree's HPUAttentionMetadata and HPUAttentionMetadataV1."""
    names = []
    for path, cls in (("vllm_gaudi/attention/backends/hpu_attn.py", "HPUAttentionMetadata"),
                      ("vllm_gaudi/v1/attention/backends/hpu_attn.py", "HPUAttentionMetadataV1")):
        module = ast.parse((root / path).read_text())
        node = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls)
        names += [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
    # HPUPagedAttentionMetadata's fields (the base of both)
    return list(dict.fromkeys(names + ["block_list", "block_mapping", "block_usage", "block_groups",
                                       "alibi_blocks"]))


class TreeRun:
    """The tree's runner, adapter and processor functions, bound to small records of their state."""

    def __init__(self, root, vllm_config):
        runner = root / "vllm_gaudi/v1/worker/hpu_model_runner.py"
        self.root, self.vllm_config = root, vllm_config
        type_cache: dict = {}
        subtuple = load(runner, "subtuple", collections=collections, _TYPE_CACHE=type_cache, Optional=None)
        replace = load(runner, "custom_tuple_replace", _TYPE_CACHE=type_cache)
        self.trim = load(runner, "trim_attn_metadata", subtuple=subtuple, HPUAttentionMetadataV1=None)
        mapping = load(runner, "_set_block_mapping", PROCESSOR_CLS, torch=torch, math=math,
                       is_fake_hpu=lambda: True, custom_tuple_replace=replace)
        process = load(runner, "process_metadata", PROCESSOR_CLS)
        self.processed = []  # (the metadata process_metadata was given, what it returned)
        # FusedSDPA prompts (the recipe's), window SDPA off: the prompt masks come from the block lists.
        processor = SimpleNamespace(interleaved_sliding_window=True, sliding_window=WINDOW, block_size=BS,
                                    prefill_use_fusedsdpa=True, use_window_sdpa=False, slice_size=1024,
                                    slice_thld=8192, vllm_config=SimpleNamespace(model_config=SimpleNamespace(
                                        hf_config=SimpleNamespace(model_type="beam"))))
        processor._set_block_mapping = lambda *a, **k: mapping(processor, *a, **k)
        for name in ("_set_attn_bias", "_set_attn_bias_for_sliding_window"):
            fn = load(runner, name, PROCESSOR_CLS, torch=torch, math=math, custom_tuple_replace=replace)
            setattr(processor, name, (lambda f: lambda *a, **k: f(processor, *a, **k))(fn))
        self.process_alone = lambda md, *args: process(processor, md, *args)

        def recorded_process(md, *args):
            out = process(processor, md, *args)
            self.processed.append((md, out))
            return out

        self.processor = SimpleNamespace(process_metadata=recorded_process)
        self.marked = []
        from vllm.forward_context import get_forward_context, set_forward_context

        no_lora = SimpleNamespace(setLoraMask=lambda m: None)
        adapter_forward = load(runner, "forward", "HpuModelAdapter", LoraMask=no_lora,
                               set_forward_context=set_forward_context,
                               set_hpu_dp_metadata=lambda *a: contextlib.nullcontext(),
                               _mark_unbacked_dim0=self.marked.append)
        attention = load(root / "vllm_gaudi/ops/hpu_attention.py", "patched_attention_forward",
                         get_forward_context=get_forward_context, torch=torch)
        self.seen = {}  # layer name -> the metadata its attention was handed
        self.model = SimpleNamespace()
        self.hashes = []
        self.replay_inputs = []  # each step's graph inputs as a replay binds them: by position

        def model(input_ids, positions, inputs_embeds=None):
            for layer in self.layers:
                attention(layer, input_ids, input_ids, input_ids)
            return torch.zeros(input_ids.numel(), 4)

        self.adapter = SimpleNamespace(metadata_processor=self.processor, pooling_model=False, flatten_input=True,
                                       dtype=torch.float32, _rotary_prepare_cos_sin=None, vllm_config=vllm_config,
                                       dummy_num_input_tokens=-1, dummy_num_tokens_across_dp_cpu=None, model=model)

        def graph_wrapper(*args, **kwargs):  # what wrap_in_hpu_graph does before it calls forward
            kwargs.pop("bypass_hpu_graphs", False)
            self.hashes.append((bridge_hash((args, kwargs)), bridge_tensors(kwargs["attn_metadata"])))
            self.replay_inputs.append(bridge_tensors((args, kwargs)))
            return adapter_forward(self.adapter, *args, **kwargs)

        self.runner = SimpleNamespace(seen_configs=set(), debug_fwd=None, model_has_chunked_attention=False,
                                      is_driver_worker=True, use_aux_hidden_state_outputs=False,
                                      model_config=SimpleNamespace(enforce_eager=False),
                                      max_cudagraph_capture_size=8192,
                                      profiler=SimpleNamespace(record_event=lambda *a: contextlib.nullcontext()),
                                      model=SimpleNamespace(forward=graph_wrapper, compute_logits=lambda h: h))
        for name in ("_seq_len", "_num_blocks", "_check_config", "_use_graphs"):
            fn = load(runner, name, RUNNER_CLS, logger=logging.getLogger("gaudi_tree"))
            setattr(self.runner, name, (lambda f: lambda *a, **k: f(self.runner, *a, **k))(fn))
        self.execute = load(runner, "_execute_model_generic", RUNNER_CLS, trim_attn_metadata=self.trim,
                            htorch=SimpleNamespace(utils=SimpleNamespace(internal=SimpleNamespace(
                                is_lazy=lambda: True))), LoraMask=no_lora)
        self.record_cls = metadata_record(dataclass_fields(root), load(
            root / "vllm_gaudi/v1/attention/backends/hpu_attn.py", "seq_len", "HPUAttentionMetadataV1"), load(
            root / "vllm_gaudi/v1/attention/backends/hpu_attn.py", "num_blocks", "HPUAttentionMetadataV1"))

    def use_layers(self, names_and_windows):
        self.layers = [SimpleNamespace(layer_name=name, use_direct_call=True, query_quant=None, kv_cache=None,
                                       attn_backend=SimpleNamespace(forward_includes_kv_cache_update=True),
                                       impl=SimpleNamespace(forward=self._recorder(name)), sliding_window=w)
                       for name, w in names_and_windows]

    def _recorder(self, name):
        def forward(layer, query, key, value, kv_cache, attn_metadata):
            self.seen[name] = attn_metadata
            return query
        return forward

    def run_step(self, metadata, rows: int):
        self.seen.clear()
        token_ids = torch.zeros((rows, 1), dtype=torch.int32)
        return self.execute(self.runner, token_ids, token_ids.clone(), metadata, torch.arange(rows), None, None, None)


def metadata_record(fields, seq_len, num_blocks):
    """The tree's HPUAttentionMetadataV1 as a plain record: every field (None unless given), and
    its own seq_len / num_blocks."""
    def init(self, **values):
        unknown = set(values) - set(fields)
        assert not unknown, unknown
        for f in fields:
            setattr(self, f, values.get(f))
    return type("HPUAttentionMetadataV1Record", (), {"__init__": init, "seq_len": seq_len, "num_blocks": num_blocks})

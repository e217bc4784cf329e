"""Keep each worker's model tensors as the loader left them, for loader identity tests.

vLLM's CPU linears repack their weights in `process_weights_after_loading` and leave an empty
`weight` behind, so a state dict taken after start-up no longer shows what the loader wrote.
This module is named as the engine's `worker_extension_cls`, so vLLM imports it in every worker
before the model loads; importing it wraps the loader's post-processing step with a snapshot.
"""

from vllm.model_executor.model_loader import base_loader

_process = base_loader.process_weights_after_loading

def _snapshot_then_process(model, model_config, target_device):
    model.loaded_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return _process(model, model_config, target_device)

if _process.__name__ != _snapshot_then_process.__name__:
    base_loader.process_weights_after_loading = _snapshot_then_process

class LoadedStateExtension:
    """Nothing to add to the worker: importing this module is the point."""

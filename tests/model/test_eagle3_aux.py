"""`BeamForCausalLM` as vLLM's `SupportsEagle3`: the auxiliary hidden states an EAGLE3 or DFlash
drafter reads equal transformers' `output_hidden_states` at the same ids, in fp32, TP 1 and 2.

vLLM's id i is transformers' `hidden_states[i]` (the tuple starts with the embeddings): the stream
after decoder layer i - 1, Beam's depth-scaled h, not the un-scaled sum the vLLM model carries.
One exception: transformers' last entry (i = n layers) is the final-normed state, while vLLM's id n
(like its Llama's) is the last layer's output before the final norm; the oracle for id n is taken
from a hook on transformers' last decoder layer.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support.prompts import prompts
from tests.support.engines import REPO, offline_env
from tests.support.parallel import both_cores

pytestmark = pytest.mark.slow

LAYERS = [0, 1, 3, 6]  # the embedding, two inner streams, the last layer's output (small preset: 6 layers)


def served_aux(model_dir, ids, layers, tp):
    with tempfile.TemporaryDirectory() as d:
        spec, out = Path(d, "spec.json"), Path(d, "out.json")
        spec.write_text(json.dumps({"model": str(model_dir), "ids": ids, "layers": layers, "tp": tp}))
        with both_cores(tp):
            proc = subprocess.run([sys.executable, "-m", "tests.model.aux_states_run", str(spec), str(out)], cwd=REPO,
                                  env=offline_env(tp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"engine failed (rc={proc.returncode}):\n{proc.stdout}")
        return json.loads(out.read_text())


def oracle_hidden_states(model_dir, ids):
    from transformers import BeamForCausalLM

    m = BeamForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    last_layer_out = []
    m.model.layers[-1].register_forward_hook(lambda module, args, out: last_layer_out.append(out[0]))
    with torch.no_grad():
        states = [h[0] for h in m(torch.tensor([ids]), output_hidden_states=True).hidden_states]
    assert (states[-1] - last_layer_out[0]).abs().max() > 1e-2  # the final norm is applied there
    return states[:-1] + last_layer_out


@pytest.mark.parametrize("tp", [1, 2])
def test_aux_hidden_states_equal_transformers_hidden_states(tiny_fp32, tp):
    ids = prompts(tiny_fp32)[0][:120]  # several 16-token windows: sliding layers matter
    served = served_aux(tiny_fp32, ids, LAYERS, tp)
    oracle = oracle_hidden_states(tiny_fp32, ids)
    assert all(s == LAYERS for s in served["set_layers"])
    assert len(served["ranks"]) == tp
    for rank in served["ranks"]:
        assert len(rank["aux"]) == len(LAYERS)
        for layer, got in zip(LAYERS, rank["aux"]):
            got = torch.tensor(got)
            assert got.shape == oracle[layer].shape
            assert (got - oracle[layer]).abs().max().item() <= 1e-4, f"aux layer {layer} (TP {tp})"
            # The comparison can fail: the neighbouring id's state is far off.
            if layer + 1 < len(oracle):
                assert (got - oracle[layer + 1]).abs().max().item() > 1e-2
        # Six layers: vLLM's rule (2, 3, 3) collapses, so Beam's default spreads its own.
        assert rank["default_layers"] == [1, 4, 5]

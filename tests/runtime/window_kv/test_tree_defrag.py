"""vllm-gaudi's own OnlineDefragmenter (extension/defragmentation.py of the tree named by
GAUDI_FIXES_ROOT, executed from the file on CPU) over KV buffers shared by cache groups, as a
window-sized cache lays them out (beam_hpu.runtime.window_kv.groups.shared_buffer_layers).

The runner hands the defragmenter its per-layer caches, in which every shared buffer appears once
per layer sharing it. With prefix caching on (the recipe's) the tree's swap is an exchange, so a
buffer listed an even number of times is exchanged back: the block ids are remapped, the contents
are not, and a live request then reads another block's keys. Given each buffer once
(window_kv.distinct_kv_caches) the contents follow the ids. Stand-ins only for what has no CPU
form: the Habana modules (tests/support/gaudi/habana_stub.py), get_config's answers, and the swap's host-to-device copy.
"""
from __future__ import annotations

import pytest
import torch

from beam_hpu.runtime.window_kv import groups as wkv
from tests.support.gaudi.tree import gaudi_root
from tests.support.gaudi.window_kv_cache import tree_defragmenter_class

pytestmark = pytest.mark.gaudi_tree
BS, NUM_BLOCKS = 4, 16


def host_swap(defragmenter):
    """The swap without its host-to-device copy: the tree's cache_utils over the key and value
    caches the defragmenter holds (-1 padding dropped: nothing to pad on the host)."""
    def swap(to_swap, _threshold):
        srcs, dsts = (torch.tensor(list(x), dtype=torch.long) for x in zip(*to_swap))
        for part in (0, 1):
            defragmenter.cache_utils(srcs, dsts, [cache[part] for cache in defragmenter.kv_caches], BS)
    return swap


def shared_caches():
    """Two groups of two layers: buffer j is the j-th layer of both. Each block's slots hold its
    block id (keys) and minus it (values); the last block is the runner's pad block."""
    groups = [["sw.0", "sw.1"], ["full.0", "full.1"]]
    buffers = []
    for _ in wkv.shared_buffer_layers(groups):
        ids = torch.arange(NUM_BLOCKS + 1, dtype=torch.float32).repeat_interleave(BS)  # [(N+1)*bs]
        buffers.append((ids.clone().unsqueeze(-1), (-ids).unsqueeze(-1)))  # [(N+1)*bs, 1] each
    buffer_of = {name: j for j, names in enumerate(wkv.shared_buffer_layers(groups)) for name in names}
    per_layer = [buffers[buffer_of[name]] for names in groups for name in names]  # as the runner binds them
    return buffers, per_layer


def block_contents(buffer, block: int) -> set[float]:
    return set(buffer[0][block * BS:(block + 1) * BS, 0].tolist())


@pytest.mark.parametrize("distinct", [False, True])
def test_defragmenter_moves_shared_blocks_only_when_given_each_buffer_once(distinct):
    cls = tree_defragmenter_class(gaudi_root())
    buffers, per_layer = shared_caches()
    caches = wkv.distinct_kv_caches(per_layer) if distinct else per_layer
    assert len(caches) == (2 if distinct else 4)
    defrag = cls(caches, BS)
    defrag._swap = host_swap(defrag)
    # A request holding high block ids, one per group (and the null block in a freed column).
    defrag.update_state({"r": [0, 12, 13]}, [])
    defrag.defragment()
    moved = {b: defrag.resolve(b) for b in (12, 13)}
    assert all(new < b for b, new in moved.items()), moved  # the ids were remapped
    assert defrag.resolve(0) == 0  # the null block never moves
    for b, new in moved.items():
        for buffer in buffers:
            if distinct:
                assert block_contents(buffer, new) == {float(b)}
            else:  # exchanged twice: the remapped id holds its old contents, not block b's keys
                assert block_contents(buffer, new) == {float(new)}

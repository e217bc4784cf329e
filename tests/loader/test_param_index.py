"""ParamIndex names the parameter, and the elements of it, that a loader's view covers, for
parameters whose storage tells nothing: meta tensors (every data pointer 0, as a lazy HPU
tensor's) and tensors whose views have storages of their own. The views are taken the ways
vLLM's loaders take them: `param.data`, `param.data.narrow(...)`, `param[...]`, an expert's
`param.data[expert_id]` narrowed to its gate or up rows."""

import pytest
import torch
from torch import nn

from beam_hpu.loader.param_index import FollowViews, ParamIndex
from tests.support.storage_free import StorageFreeTensor

ROWS, COLS, EXPERTS = 8, 6, 4


class TwinParams(nn.Module):
    """Two parameters of one shape (they would collide at one pointer), an expert stack, a buffer."""

    def __init__(self, make):
        super().__init__()
        self.first = nn.Parameter(make(ROWS, COLS), requires_grad=False)
        self.second = nn.Parameter(make(ROWS, COLS), requires_grad=False)
        self.w13 = nn.Parameter(make(EXPERTS, 2 * ROWS, COLS), requires_grad=False)
        self.register_buffer("scale", make(ROWS, 1))


def meta(*shape):
    return torch.empty(*shape, device="meta")


def storage_free(*shape):
    return StorageFreeTensor(torch.zeros(*shape))


EXPERT = 2 * ROWS * COLS
# (view taken by a loader, parameter, element runs relative to the parameter's first element)
CASES = [
    (lambda m: m.first.data, "first", [(0, ROWS * COLS)]),
    (lambda m: m.second.data, "second", [(0, ROWS * COLS)]),
    (lambda m: m.second.data.narrow(0, 2, 3), "second", [(2 * COLS, 3 * COLS)]),  # column-parallel rows
    (lambda m: m.first.data.narrow(1, 4, 2), "first", [(r * COLS + 4, 2) for r in range(ROWS)]),  # row-parallel
    (lambda m: m.w13[1], "w13", [(EXPERT, EXPERT)]),
    (lambda m: m.w13.data[2].narrow(0, ROWS, ROWS), "w13", [(2 * EXPERT + ROWS * COLS, ROWS * COLS)]),  # up rows
    (lambda m: m.w13.data.unbind(0)[3][:ROWS], "w13", [(3 * EXPERT, ROWS * COLS)]),
    (lambda m: m.scale.narrow(0, 4, 4), "scale", [(4, 4)]),
]


@pytest.mark.parametrize("make", [meta, storage_free], ids=["meta", "storage-free"])
@pytest.mark.parametrize("take,param,runs", CASES)
def test_view_names_its_parameter_and_elements(make, take, param, runs):
    model = TwinParams(make)
    params = ParamIndex(model)
    with FollowViews(params):
        view = take(model)
    found = params.find(view)
    assert found is not None and found.name == param
    assert tuple(found.layout.shape) == tuple(view.shape)
    write = params.writes(view, "ckpt.tensor")
    assert (write.param, write.tensor, write.runs) == (param, "ckpt.tensor", runs)
    assert found.param.shape == getattr(model, param).shape


@pytest.mark.parametrize("make", [meta, storage_free], ids=["meta", "storage-free"])
def test_tensors_that_are_no_parameter_are_not_found(make):
    model = TwinParams(make)
    params = ParamIndex(model)
    other = make(ROWS, COLS)
    with FollowViews(params):
        views = [other.narrow(0, 0, 2), model.first.data.clone(), model.first.data + 1]
    assert [params.find(v) for v in views] == [None, None, None]


def test_storage_free_views_still_write_their_parameter():
    """The stand-in is what it claims: its views start a storage of their own (offset 0) with no
    pointer to read, and a copy into a view still lands in the parameter."""
    model = TwinParams(storage_free)
    view = model.w13.data[2].narrow(0, ROWS, ROWS)
    assert view.storage_offset() == 0
    with pytest.raises(RuntimeError, match="data pointer"):
        view.untyped_storage().data_ptr()
    view.copy_(torch.ones(ROWS, COLS))
    inner = model.w13.inner
    assert inner[2, ROWS:].eq(1).all() and inner.sum() == ROWS * COLS

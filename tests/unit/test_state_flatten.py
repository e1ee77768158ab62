"""Flattening a state for a snapshot: DCP's keys, typed paths, opaque objects, missing keys."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from trainguard.checkpoint import state
from trainguard.checkpoint.api import CheckpointError


def test_keys_match_dcp_and_paths_keep_int_keys() -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    opt.zero_grad()
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()
    conv = {"optim": opt.state_dict(), "xs": [torch.ones(1), {"a": 1}], "plain": [1, 2]}
    flat, paths = state.flatten_typed(conv)
    dcp_flat, _ = flatten_state_dict(conv)
    assert list(flat) == list(dcp_flat)  # the same keys, in the same order, as DCP's
    assert paths["optim.state.0.step"] == ("optim", "state", 0, "step")  # 0 stays an int


def test_missing_keys_are_created_at_their_typed_path() -> None:
    conv: dict = {"optim": {"state": {}, "param_groups": [{"lr": 0.1}]}}
    saved = {
        "optim.state.0.step": (torch.float32, (), ("optim", "state", 0, "step")),
        "optim.state.0.exp_avg": (torch.bfloat16, (3,), ("optim", "state", 0, "exp_avg")),
        "optim.param_groups.0.lr": (None, (), ("optim", "param_groups", 0, "lr")),
        "gone.w": (torch.float32, (1,), ("gone", "w")),  # a top-level key the script dropped
    }
    filled = state.fill_missing(conv, ["optim.param_groups.0.lr"], saved)
    assert filled == ["optim.state.0.step", "optim.state.0.exp_avg"]
    assert set(conv["optim"]["state"]) == {0}
    assert conv["optim"]["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert "gone" not in conv


def test_objects_are_opaque_bytes_that_need_no_import() -> None:
    class Local:  # not importable anywhere: pickling it by reference fails
        pass

    codec = state.ObjectCodec()
    encoded = codec.encode({"a": {"epoch": 3}, "b": 1.5})
    blob = state.pack_objects(encoded)
    assert state.unpack_objects(blob) == encoded  # no class is looked up to read it
    assert state.decode_object(encoded["a"]) == {"epoch": 3}
    with pytest.raises(CheckpointError, match="obj: a value of type .*Local"):
        codec.encode({"obj": Local()})
    with pytest.raises(pickle.UnpicklingError):
        state.unpack_objects(pickle.dumps({"x": CheckpointError}))  # a blob naming a class


def test_sparse_tensor_is_refused_with_the_fix() -> None:
    with pytest.raises(CheckpointError, match="to_dense"):
        state.flatten({"w": torch.eye(3).to_sparse()}, 0)

"""The GPT example builds its state dict directly; it must be the dict DCP's get_state_dict
builds (same keys, same live tensors' values, same param groups), or resumes would drift."""

from __future__ import annotations

import sys

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "examples" / "gpt"))
from model import GPT, GPTConfig  # noqa: E402
from train import TrainState  # noqa: E402


def test_example_state_dict_equals_dcp_get_state_dict() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    state = TrainState(model, optim)
    x = torch.randint(0, 256, (2, 16))
    model(x, x).backward()
    optim.step()
    ours = state.state_dict()
    msd, osd = get_state_dict(model, optim)
    assert list(ours["model"]) == list(msd)
    assert all(torch.equal(ours["model"][k], msd[k]) for k in msd)
    assert ours["optim"]["param_groups"] == osd["param_groups"]
    assert list(ours["optim"]["state"]) == list(osd["state"])
    for fqn, st in osd["state"].items():
        assert st.keys() == ours["optim"]["state"][fqn].keys()
        assert all(torch.equal(v, ours["optim"]["state"][fqn][k]) for k, v in st.items())
    # the live tensors, not copies: a restore into them restores the model
    assert ours["model"]["tok.weight"].data_ptr() == model.tok.weight.data_ptr()

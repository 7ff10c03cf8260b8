"""Where one-process stages run their models (`runtime.device`), and the model store's moves between the
device and the CPU (the rollout engine's turn on a shared GPU).

This machine has no GPU, so the CUDA path itself has not run here. The moves are checked onto torch's
`meta` device instead, which has no data but is a device other than the CPU: what moves, what stays where
torch keeps it, and that an optimizer stays keyed by the model's parameters."""

from __future__ import annotations

import os

import pytest
import torch

from rlpipe.errors import PipelineError
from rlpipe.models.device import (gpu_memory_metrics, model_device, move_model, move_optimizer_state,
                                  reset_gpu_peak, resolve_device, use_deterministic_algorithms)
from rlpipe.models.store import ModelStore


def test_auto_takes_the_gpu_when_torch_sees_one_and_cuda_without_one_names_the_key():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: runtime.device cuda is valid here")
    with pytest.raises(PipelineError, match=r"runtime.device: 'cuda', but this torch .* sees no GPU"):
        resolve_device("cuda")


def test_deterministic_mode_sets_torch_and_cublas_and_keeps_a_workspace_the_user_chose(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        use_deterministic_algorithms(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        use_deterministic_algorithms(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        use_deterministic_algorithms(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_gpu_memory_is_counted_on_a_gpu_only():
    reset_gpu_peak("cpu")  # no CUDA call on the CPU: this torch has none
    assert gpu_memory_metrics("cpu") == {}
    if torch.cuda.is_available():
        reset_gpu_peak("cuda")
        held = torch.ones(2**20, device="cuda")
        figures = gpu_memory_metrics("cuda")
        assert figures["stage/gpu_peak_gib"] >= figures["stage/gpu_held_gib"] >= held.numel() * 4 / 2**30


def trained(model):
    """`model` after one AdamW step, and the optimizer: its state now holds step, exp_avg, exp_avg_sq."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    model(input_ids=torch.tensor([[1, 5, 6, 7]]), labels=torch.tensor([[1, 5, 6, 7]])).loss.backward()
    optimizer.step()
    model.eval()
    return optimizer


@pytest.fixture
def moves_keep_parameters():
    """`Module.to` onto meta as onto a GPU: the parameter objects kept (torch's swap-on-conversion), where
    by default meta gets new ones, unlike a GPU."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(False)


def test_the_optimizer_state_moves_with_the_model_and_the_step_counter_stays(tiny_model, moves_keep_parameters):
    """Everything but AdamW's step counter, which torch keeps on the CPU, goes with the model; the state
    stays keyed by the model's own parameters, tied ones included."""
    import copy

    model = copy.deepcopy(tiny_model)
    optimizer = trained(model)
    before = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    move_model(model, "cpu", optimizer)  # nothing to move
    for name, parameter in model.named_parameters():
        assert all(torch.equal(v, before[name][k]) for k, v in optimizer.state[parameter].items())
    move_model(model, "meta", optimizer)
    assert model_device(model).type == "meta"
    parameters = list(model.parameters())
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in parameters]
    for parameter in parameters:
        state = optimizer.state[parameter]
        assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu" and state["step"].item() == 1


def test_a_move_that_makes_new_parameters_stops_rather_than_train_the_old_ones(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model)
    optimizer = trained(model)
    with pytest.raises(RuntimeError, match="made new parameter objects"):
        move_model(model, "meta", optimizer)  # by default meta's conversion makes new parameters


def test_the_store_hands_out_on_its_device_what_it_holds_on_another(tiny_model, tiny_model_dir,
                                                                     moves_keep_parameters):
    """A model the store holds on the CPU (as `offload` leaves it, or as init writes it) comes out on the
    store's device, its optimizer state with it; the store's key names the device."""
    import copy

    store = ModelStore()
    model = copy.deepcopy(tiny_model)
    optimizer = trained(model)
    store.remember_policy(tiny_model_dir, model, optimizer)
    store.offload()  # on the CPU: nothing to move
    assert model_device(model).type == "cpu"
    store.device = "meta"
    assert store.policy_for_training(tiny_model_dir, "float32")[2] is None  # held for the CPU, not for meta
    store.device = "cpu"
    store.remember_policy(tiny_model_dir, model, optimizer)
    held = next(iter(store.held))
    store.held[held[:3] + ("meta",)] = store.held.pop(held)  # as a store on another device would hold it
    store.device = "meta"
    handed, _, handed_optimizer = store.policy_for_training(tiny_model_dir, "float32")
    assert handed is model and handed_optimizer is optimizer
    assert model_device(model).type == "meta"
    assert all(state["exp_avg"].device.type == "meta" for state in optimizer.state.values())

"""LoRA on the policy (`model.lora`): the adapters' math, their checkpoints, and the pipeline with them.

Hand-checked: a merged weight is the base weight plus (alpha / r) B A, and the policy an adapter
checkpoint holds computes what its merged weights compute. Through the real pipeline: only the adapters
train, each round stores only them, the base stays round 0's, and the store never serves an adapter
whose base changed on disk.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from rlpipe.config import LoRAConfig, params_from_dict
from rlpipe.config.params import ParamsError

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture
def project_with_adapter(tmp_path, tiny_model, tokenizer, monkeypatch):
    """A project root holding a base (runs/policy/r0) and an adapter checkpoint on it (runs/policy/r1),
    with random B so that the adapters change the model; the test runs from that root."""
    import copy

    from rlpipe.models import lora
    from rlpipe.models.policy import save_policy

    monkeypatch.chdir(tmp_path)
    base_dir, adapter_dir = tmp_path / "runs/policy/r0", tmp_path / "runs/policy/r1"
    base_dir.mkdir(parents=True), adapter_dir.mkdir(parents=True)
    save_policy(tiny_model, tokenizer, base_dir)
    model = lora.attach(copy.deepcopy(tiny_model), LORA, base_dir.relative_to(tmp_path), seed=0)
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.1
    save_policy(model, tokenizer, adapter_dir)
    return tmp_path, model


def test_config_names_the_bad_key():
    with pytest.raises(ParamsError, match=r"model\.lora\.target_modules"):
        params_from_dict({"model": {"lora": {"target_modules": []}}})
    with pytest.raises(ParamsError, match=r"model\.lora\.rank"):
        params_from_dict({"model": {"lora": {"rank": -1}}})
    with pytest.raises(ParamsError, match=r"model\.lora\.dropout"):
        params_from_dict({"model": {"lora": {"dropout": 1.0}}})
    with pytest.raises(ParamsError, match=r"model\.lora\.rank: LoRA trains under update.strategy 'ddp'"):
        params_from_dict({"model": {"lora": {"rank": 4}}, "update": {"nproc": 2, "strategy": "fsdp2"}})


def test_fresh_adapters_start_at_the_base_and_only_they_train(tiny_model, tmp_path):
    import copy

    from rlpipe.models import lora

    model = lora.attach(copy.deepcopy(tiny_model), LORA, tmp_path, seed=0)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    assert torch.equal(model(ids).logits, tiny_model(ids).logits)  # B = 0
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    # 2 layers x 3 target modules x (A, B)
    assert len(trainable) == 2 * 3 * 2
    again = lora.attach(copy.deepcopy(tiny_model), LORA, tmp_path, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded


def test_unknown_target_module_names_the_key(tiny_model, tmp_path):
    import copy

    from rlpipe.models import lora

    with pytest.raises(lora.LoRAMismatchError, match=r"model\.lora\.target_modules"):
        lora.attach(copy.deepcopy(tiny_model), LoRAConfig(rank=2, target_modules=["c_attn"]), tmp_path, seed=0)


def test_adapter_checkpoint_holds_only_adapters_and_names_its_base(project_with_adapter):
    root, _ = project_with_adapter
    files = sorted(os.listdir(root / "runs/policy/r1"))
    assert files == ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((root / "runs/policy/r1/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "runs/policy/r0"  # relative: bytes independent of the root


def test_merged_weights_are_base_plus_scaled_b_a(project_with_adapter):
    """W' = W + (alpha / r) B A, by hand from the two safetensors files, equals both rlpipe's merge and
    peft's merge_and_unload as written by `rlpipe merge-lora`."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlpipe.cli import main as cli

    root, _ = project_with_adapter
    base = load_file(str(root / "runs/policy/r0/model.safetensors"))
    adapters = load_file(str(root / "runs/policy/r1/adapter_model.safetensors"))
    scale = LORA.alpha / LORA.rank
    name = "model.layers.1.self_attn.v_proj.weight"
    a = adapters["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    b = adapters["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    by_hand = base[name] + scale * b @ a
    from rlpipe.models.lora import merged_weights

    merged = dict(merged_weights(root / "runs/policy/r1"))
    torch.testing.assert_close(merged[name], by_hand, rtol=0, atol=1e-6)
    assert torch.equal(merged["model.layers.1.self_attn.k_proj.weight"], base["model.layers.1.self_attn.k_proj.weight"])
    assert set(merged) == set(base)

    assert cli(["merge-lora", "runs/policy/r1", "merged"]) == 0
    assert not (root / "merged/adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(str(root / "merged")).state_dict()
    for key, value in merged.items():
        torch.testing.assert_close(plain[key], value, rtol=0, atol=1e-6)


def test_checkpoint_opens_with_automodel_and_equals_its_merge(project_with_adapter):
    from transformers import AutoModelForCausalLM

    from rlpipe.models.lora import merge_checkpoint
    from rlpipe.models.policy import load_policy

    root, trained = project_with_adapter
    merge_checkpoint(root / "runs/policy/r1", root / "merged")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = trained(ids).logits
        opened = AutoModelForCausalLM.from_pretrained("runs/policy/r1")  # transformers loads base + adapters
        assert torch.equal(opened(ids).logits, expected)
        loaded, _ = load_policy("runs/policy/r1")
        assert torch.equal(loaded(ids).logits, expected)
        merged = AutoModelForCausalLM.from_pretrained(str(root / "merged"))
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)


def test_store_reloads_an_adapter_whose_base_changed(project_with_adapter):
    from rlpipe.models.store import ModelStore, checkpoint_identity

    root, _ = project_with_adapter
    store = ModelStore()
    store.policy(root / "runs/policy/r1", "float32")
    store.policy(root / "runs/policy/r1", "float32")
    assert (store.loads, store.reused) == (1, 1)
    before = checkpoint_identity(root / "runs/policy/r1")
    weights = root / "runs/policy/r0/model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten in place: same bytes, new mtime
    assert checkpoint_identity(root / "runs/policy/r1") != before
    store.policy(root / "runs/policy/r1", "float32")
    assert store.loads == 2


def test_adapter_that_does_not_match_params_is_refused(project_with_adapter):
    from rlpipe.models import lora

    root, _ = project_with_adapter
    lora.check_matches(root / "runs/policy/r1", LORA)
    with pytest.raises(lora.LoRAMismatchError, match="model.lora asks for"):
        lora.check_matches(root / "runs/policy/r1", LoRAConfig(rank=8, alpha=8.0, target_modules=["q_proj"]))
    with pytest.raises(lora.LoRAMismatchError, match="model.lora.rank is 0"):
        lora.check_matches(root / "runs/policy/r1", LoRAConfig())


# --- through the real pipeline ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """`dvc repro` of the miniature params with LoRA on q_proj and v_proj (2 rounds)."""
    from scratch import MINI_PARAMS, dvc, make_project

    params = yaml.safe_load(MINI_PARAMS.read_text())
    params["model"]["lora"] = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    params["update"]["lr"] = 0.003
    path = tmp_path_factory.mktemp("lora") / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    root = make_project(tmp_path_factory.mktemp("lora") / "project", path)
    return root, dvc(root, "repro")


def test_pipeline_trains_only_the_adapters(lora_run, monkeypatch):
    from safetensors.torch import load_file

    from rlpipe.models.policy import OPTIMIZER_FILE, load_policy

    root, _ = lora_run
    monkeypatch.chdir(root)
    base = load_file("runs/policy/r0/model.safetensors")
    for round_name in ("r1", "r2"):
        directory = root / "runs/policy" / round_name
        assert not (directory / "model.safetensors").exists() and (directory / "adapter_model.safetensors").is_file()
        model, _ = load_policy(f"runs/policy/{round_name}")
        weights = {name.removeprefix("base_model.model.").replace(".base_layer", ""): p.detach()
                   for name, p in model.named_parameters()}
        for name, value in base.items():
            assert torch.equal(weights[name], value), f"{round_name}: base weight {name} changed"
        adapters = load_file(str(directory / "adapter_model.safetensors"))
        assert any(bool(t.abs().sum() > 0) for k, t in adapters.items() if "lora_B" in k), "the adapters never moved"
        # the optimizer state is the adapters': one AdamW entry per adapter matrix (2 layers x 2 modules x A, B)
        state = torch.load(directory / OPTIMIZER_FILE, weights_only=True)
        assert len(state["state"]) == len(adapters) == 8
    r1 = load_file(str(root / "runs/policy/r1/adapter_model.safetensors"))
    r2 = load_file(str(root / "runs/policy/r2/adapter_model.safetensors"))
    assert any(not torch.equal(r1[k], r2[k]) for k in r1), "round 2 did not continue training the adapters"


def test_pipeline_eval_scores_the_lora_rounds(lora_run):
    root, log = lora_run
    assert "Running stage 'evaluate'" in log
    curve = json.loads((root / "runs/metrics/rounds.json").read_text())
    assert [row["round"] for row in curve] == [0, 1, 2]

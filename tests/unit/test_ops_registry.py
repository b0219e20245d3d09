"""The op registry: lookup by name, clear errors, registration rules, bindings from recipes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kiln.ops  # noqa: F401  (registers the built-ins)
from kiln.ops import registry
from kiln.ops.registry import (
    OPS,
    DuplicateImplementationError,
    UnknownImplementationError,
    UnknownOpError,
    get,
    implementations,
    register,
    unregister,
)
from kiln.workloads.models.binding import BindError, LossyImplementationError, OpBinding
from kiln.workloads.models.slots import Site
from kiln.workloads.weights import WeightStore


@pytest.fixture
def scratch_impl() -> Iterator[str]:
    """A name for a test implementation of ``sampler``, removed afterwards."""
    yield "test_scratch"
    if "test_scratch" in implementations("sampler"):
        unregister("sampler", "test_scratch")


def test_every_op_has_a_reference() -> None:
    for op in OPS:
        assert implementations(op)[0] == "reference"


def test_required_alternatives_are_registered() -> None:
    assert "sdpa" in implementations("attention")
    assert "fused" in implementations("qkv_proj")
    assert "fused_gate_up" in implementations("mlp")
    assert "fused_residual" in implementations("rms_norm")


def test_unknown_op_names_the_known_ones() -> None:
    with pytest.raises(UnknownOpError) as err:
        get("atention", "reference")
    assert isinstance(err.value, KeyError)
    assert "'atention'" in str(err.value) and "attention" in str(err.value)
    with pytest.raises(UnknownOpError):
        implementations("nope")
    with pytest.raises(UnknownOpError):
        register("nope", "x")


def test_unknown_implementation_names_the_registered_ones() -> None:
    with pytest.raises(UnknownImplementationError) as err:
        get("attention", "flash")
    assert isinstance(err.value, KeyError)
    message = str(err.value)
    assert message.startswith("op 'attention' has no implementation 'flash' (known: reference, ")
    assert "sdpa" in message


def test_register_get_replace_unregister(scratch_impl: str) -> None:
    @register("sampler", scratch_impl)
    def first(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmin(-1)

    assert get("sampler", scratch_impl).fn is first
    assert get("sampler", scratch_impl)(torch.tensor([[3.0, 1.0]])).tolist() == [1]
    with pytest.raises(DuplicateImplementationError):
        register("sampler", scratch_impl)(first)
    register("sampler", scratch_impl, replace=True)(torch.argmax)
    assert get("sampler", scratch_impl).fn is torch.argmax
    unregister("sampler", scratch_impl)
    assert scratch_impl not in implementations("sampler")
    with pytest.raises(ValueError, match="cannot be unregistered"):
        unregister("sampler", "reference")


def test_binding_defaults_to_reference_and_rejects_bad_recipes() -> None:
    binding = OpBinding.from_recipe({"attention": "sdpa"})
    assert binding.recipe["attention"] == "sdpa"
    assert binding.recipe["mlp"] == "reference"
    assert binding.recipe["moe"] == "reference"
    assert not binding.lossy
    with pytest.raises(UnknownImplementationError):
        OpBinding.from_recipe({"attention": "flash"})
    with pytest.raises(UnknownOpError):
        OpBinding.from_recipe({"attn": "sdpa"})
    with pytest.raises(UnknownImplementationError, match="moe"):
        OpBinding({}).impl("moe")


def test_lossy_implementations_need_opt_in(scratch_impl: str) -> None:
    register("sampler", scratch_impl, lossy=True)(torch.argmax)
    with pytest.raises(LossyImplementationError, match=f"sampler={scratch_impl}"):
        OpBinding.from_recipe({"sampler": scratch_impl})
    assert OpBinding.from_recipe({"sampler": scratch_impl}, allow_lossy=True).lossy


def test_bind_checks_params_and_caches_derived_layouts() -> None:
    w = torch.randn(6, 4)
    store = WeightStore({"w": w})
    site = Site(
        "qkv_proj",
        "layer0",
        {
            "q_weight": w[:2],
            "k_weight": w[2:4],
            "v_weight": w[4:],
            "q_bias": None,
            "k_bias": None,
            "v_bias": None,
            "num_heads": 1,
            "num_kv_heads": 1,
            "head_dim": 2,
        },
    )
    fused = OpBinding.from_recipe({"qkv_proj": "fused"})
    fused.bind(site, store)
    fused.bind(site, store)
    assert store.derived_keys() == [("fused_qkv", "layer0")]
    bad = Site("qkv_proj", "layer1", {"q_weight": w})
    with pytest.raises(BindError, match="missing"):
        OpBinding.from_recipe().bind(bad, store)
    assert registry.get("qkv_proj", "fused").derived is not None

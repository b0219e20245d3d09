"""Turning an LLM completion into a validated code module (kiln.agent_runner.llm.parse)."""

from __future__ import annotations

import re

import pytest

from kiln.agent_runner.llm import LLMReplyError, parse_completion
from kiln.agent_runner.llm.parse import MAX_EXPLANATION_CHARS, extract_code

MODULE = """\
import torch

from kiln.ops.registry import register


@register("rms_norm", "llm_fast", replace=True)
def llm_fast(x, residual=None, *, weight, eps):
    if residual is not None:
        x = x + residual
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), x
"""


def _reply(code: str, before: str = "Fewer passes over x.", after: str = "") -> str:
    return f"{before}\n\n```python\n{code}```\n{after}"


def test_first_python_block_becomes_a_named_module_with_its_impl() -> None:
    text = _reply(MODULE, after="Hope it helps.") + "\n```python\nprint('second block')\n```\n"
    parsed = parse_completion(text, "rms_norm")
    assert (parsed.op, parsed.impl) == ("rms_norm", "llm_fast")
    assert parsed.module.source == MODULE
    assert re.fullmatch(r"llm_rms_norm_[0-9a-f]{8}", parsed.module.name)
    assert "Fewer passes over x." in parsed.explanation and "Hope it helps." in parsed.explanation
    assert "print('second block')" in parsed.explanation  # only the first block is the module
    # Same source, same name (content-addressed); other source, other name.
    assert parse_completion(_reply(MODULE, before="other words"), "rms_norm").module == (
        parsed.module
    )
    other = MODULE.replace("llm_fast", "llm_faster")
    assert parse_completion(_reply(other), "rms_norm").module.name != parsed.module.name


def test_a_bare_python_reply_is_the_module() -> None:
    parsed = parse_completion(MODULE, "rms_norm")
    assert parsed.impl == "llm_fast" and parsed.explanation == ""


def test_explanation_is_bounded() -> None:
    parsed = parse_completion(_reply(MODULE, before="x" * 5000), "rms_norm")
    assert len(parsed.explanation) == MAX_EXPLANATION_CHARS


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("I cannot help with that, sorry.", "no ```python block"),
        ("Here:\n```python\nimport torch\n", "not closed"),
        (_reply("def f(:\n    pass\n"), "does not parse"),
        (_reply(MODULE.replace('"rms_norm"', '"mlp"')), "registers op 'mlp', but 'rms_norm'"),
        (_reply(MODULE.replace("import torch", "import os\nimport torch")), "import of os"),
        (_reply("from subprocess import run\n" + MODULE), "import of subprocess"),
        (_reply("from . import x\n" + MODULE), "relative imports"),
        (_reply(MODULE.replace('"llm_fast"', '"reference"')), "'reference' is taken"),
        (_reply(MODULE.replace('"llm_fast"', '"fused_residual"')), "is taken"),
        (_reply(MODULE.replace('"llm_fast"', '"not a name"')), "not an identifier"),
        (_reply("import torch\n"), "exactly once; it calls register 0"),
        (_reply(MODULE + MODULE.replace("llm_fast", "llm_two")), "calls register 2"),
        (_reply(MODULE + "\neval('1')\n"), "'eval'"),
        (_reply(MODULE + "\nx = __import__('os')\n"), "'__import__'"),
        (_reply(MODULE + "\nregistry.unregister('rms_norm', 'reference')\n"), "unregister"),
        (_reply(MODULE.replace("replace=True", "replace=True, lossy=True")), "lossy"),
        (_reply(MODULE.replace('"llm_fast"', "NAME")), "as literals"),
    ],
)
def test_unusable_replies_are_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(LLMReplyError) as err:
        parse_completion(text, "rms_norm")
    assert reason in err.value.message


def test_size_limit() -> None:
    big = MODULE + "\n" + "# padding\n" * 100
    with pytest.raises(LLMReplyError, match=r"bytes; the limit is 500"):
        parse_completion(_reply(big), "rms_norm", max_bytes=500)
    assert parse_completion(_reply(big), "rms_norm").impl == "llm_fast"


def test_triton_only_when_allowed_and_submodules_of_allowed_packages_pass() -> None:
    code = MODULE.replace("import torch", "import torch\nimport triton\nimport triton.language")
    with pytest.raises(LLMReplyError, match="import of triton"):
        parse_completion(_reply(code), "rms_norm")
    assert parse_completion(_reply(code), "rms_norm", triton=True).impl == "llm_fast"
    ok = "import math\nimport torch.nn.functional as F\nfrom kiln.ops import rms_norm\n" + MODULE
    assert parse_completion(_reply(ok), "rms_norm").impl == "llm_fast"
    with pytest.raises(LLMReplyError, match=r"import of kiln\.engine_pool"):
        parse_completion(_reply("import kiln.engine_pool\n" + MODULE), "rms_norm")


def test_taken_names_can_be_given() -> None:
    with pytest.raises(LLMReplyError, match="taken"):
        parse_completion(_reply(MODULE), "rms_norm", taken=("reference", "llm_fast"))


def test_extract_code_accepts_py_fences() -> None:
    code, rest = extract_code("intro\n```py\nx = 1\n```\noutro")
    assert code == "x = 1\n" and rest == "intro\n\noutro"

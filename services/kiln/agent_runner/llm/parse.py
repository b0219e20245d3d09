"""From a completion to a validated code module registering one new implementation of one op.

The module is the first ```python block (or the whole text if it parses). It must parse, stay
under a size limit, import only allowed modules, call no dynamic-code builtin, and call
``register("<op>", "<new impl>", ...)`` exactly once for the op asked for. Correctness is the
engine's gate's.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
from collections.abc import Collection
from dataclasses import dataclass

from kiln.agent_runner.llm.errors import LLMReplyError
from kiln.domain.candidate import CodeModule

MAX_SOURCE_BYTES = 64 * 1024
"""Largest accepted module, bytes (UTF-8)."""
MAX_EXPLANATION_CHARS = 1000
"""The explanation kept from the text around the code block, characters."""

BASE_IMPORTS = frozenset({"__future__", "math", "typing", "torch", "kiln.ops"})
"""Modules (and their submodules) a code module may import."""

FORBIDDEN_NAMES = frozenset(
    {"__import__", "eval", "exec", "compile", "open", "breakpoint", "input", "_REGISTRY"}
)
"""Names a code module may not use: dynamic code, files, the registry's internals."""

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)[ \t]*\r?\n(.*?)```", re.DOTALL | re.I)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)\b", re.I)
_IMPL_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True)
class ParsedModule:
    """A usable completion.

    Attributes:
        module: the code module, named ``llm_<op>_<first 8 hex of the source's SHA-256>``.
        explanation: the text around the code (at most :data:`MAX_EXPLANATION_CHARS`).
        devices: the device types ``register`` names literally, or None.
    """

    op: str
    impl: str
    module: CodeModule
    explanation: str
    devices: tuple[str, ...] | None = None


def triton_available() -> bool:
    """True when the ``triton`` package is importable here."""
    return importlib.util.find_spec("triton") is not None


def allowed_imports(*, triton: bool = False) -> frozenset[str]:
    """:data:`BASE_IMPORTS`, plus ``triton`` when ``triton``."""
    return BASE_IMPORTS | {"triton"} if triton else BASE_IMPORTS


def extract_code(text: str) -> tuple[str, str]:
    """(module source, text around it); LLMReplyError without a closed ```python block or Python
    text.
    """
    match = _FENCE.search(text)
    if match:
        explanation = (text[: match.start()] + text[match.end() :]).strip()
        return match.group(1), explanation
    if _OPEN_FENCE.search(text):
        raise LLMReplyError("the ```python block is not closed (the reply may have hit max_tokens)")
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        raise LLMReplyError(
            "the reply has no ```python block and is not Python source either"
        ) from None
    return text, ""


def _is_register(call: ast.Call, attr: str) -> bool:
    f = call.func
    return (isinstance(f, ast.Name) and f.id == attr) or (
        isinstance(f, ast.Attribute) and f.attr == attr
    )


def _string_arg(call: ast.Call, index: int, keyword: str) -> str | None:
    node: ast.expr | None = call.args[index] if len(call.args) > index else None
    for kw in call.keywords:
        if kw.arg == keyword:
            node = kw.value
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _check_imports(tree: ast.Module, allowed: frozenset[str]) -> None:
    def ok(name: str) -> bool:
        return any(name == a or name.startswith(a + ".") for a in allowed)

    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise LLMReplyError("relative imports are not allowed")
            names = [node.module or ""]
        bad = [n for n in names if not ok(n)]
        if bad:
            raise LLMReplyError(
                f"import of {', '.join(bad)} is not allowed (allowed: {', '.join(sorted(allowed))})"
            )


def _check_names(tree: ast.Module) -> None:
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else None
        if isinstance(node, ast.Attribute):
            name = node.attr
        if name in FORBIDDEN_NAMES:
            raise LLMReplyError(f"the module uses {name!r}, which is not allowed")


def _devices(call: ast.Call) -> tuple[str, ...] | None:
    """The literal tuple or list of strings a ``register`` call passes as ``devices``."""
    for kw in call.keywords:
        if kw.arg == "devices" and isinstance(kw.value, ast.Tuple | ast.List):
            items = kw.value.elts
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in items):
                return tuple(str(e.value) for e in items if isinstance(e, ast.Constant))
    return None


def _registration(tree: ast.Module, op: str, taken: Collection[str]) -> ast.Call:
    """The module's one ``register`` call, checked."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    if any(_is_register(c, "unregister") for c in calls):
        raise LLMReplyError("the module calls unregister(), which is not allowed")
    registers = [c for c in calls if _is_register(c, "register")]
    if len(registers) != 1:
        raise LLMReplyError(
            f"the module must call register({op!r}, <name>, ...) exactly once; "
            f"it calls register {len(registers)} time(s)"
        )
    call = registers[0]
    got_op, impl = _string_arg(call, 0, "op"), _string_arg(call, 1, "impl")
    if got_op is None or impl is None:
        raise LLMReplyError("register(...) needs the op and the implementation name as literals")
    if got_op != op:
        raise LLMReplyError(f"the module registers op {got_op!r}, but {op!r} was asked for")
    if not _IMPL_RE.match(impl):
        raise LLMReplyError(f"implementation name {impl!r} is not an identifier of <= 64 chars")
    if impl == "reference" or impl in taken:
        raise LLMReplyError(
            f"implementation name {impl!r} is taken for {op!r} (taken: {', '.join(taken)})"
        )
    for kw in call.keywords:
        if kw.arg == "lossy" and not (isinstance(kw.value, ast.Constant) and not kw.value.value):
            raise LLMReplyError("lossy implementations are not accepted from the LLM agent")
    return call


def parse_completion(
    text: str,
    op: str,
    *,
    taken: Collection[str] | None = None,
    triton: bool = False,
    max_bytes: int = MAX_SOURCE_BYTES,
) -> ParsedModule:
    """Validate a completion as a code module registering a new implementation of ``op``.

    ``taken``: implementation names in use (default the registry's); ``triton`` allows ``import
    triton``; ``max_bytes`` bounds the source. Raises LLMReplyError with the reason.
    """
    if taken is None:
        import kiln.ops  # noqa: F401  (registers the built-in implementations)
        from kiln.ops import registry

        taken = registry.implementations(op)
    source, explanation = extract_code(text)
    source = source.strip("\n") + "\n"
    size = len(source.encode())
    if size > max_bytes:
        raise LLMReplyError(f"the module is {size} bytes; the limit is {max_bytes}")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise LLMReplyError(f"the module does not parse: {exc.msg} (line {exc.lineno})") from None
    _check_imports(tree, allowed_imports(triton=triton))
    _check_names(tree)
    call = _registration(tree, op, taken)
    impl = _string_arg(call, 1, "impl")
    assert impl is not None  # checked by _registration
    digest = hashlib.sha256(source.encode()).hexdigest()[:8]
    return ParsedModule(
        op=op,
        impl=impl,
        module=CodeModule(f"llm_{op}_{digest}", source),
        explanation=explanation[:MAX_EXPLANATION_CHARS],
        devices=_devices(call),
    )

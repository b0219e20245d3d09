"""buf's checks of the API (proto/buf.yaml): lint passes, the protos are compatible with the
committed baseline (proto/baseline.binpb), and a breaking edit of a copy of the protos fails
the breaking check. Skipped without buf (tests/buf.py says where it is looked for); .ci/run
installs it and fails when these skip there."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ..buf import REPO_ROOT, require_buf

PROTO = REPO_ROOT / "proto"
BASELINE = PROTO / "baseline.binpb"


def run_buf(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_buf(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def breaking_rules(tree: Path) -> set[str]:
    """The rule ids `buf breaking` reports for ``tree``'s protos against the baseline."""
    done = run_buf(
        "breaking", "proto", "--against", str(BASELINE), "--error-format", "json", cwd=tree
    )
    assert done.returncode in (0, 100), done.stderr  # 100: breaking changes found
    rules = {json.loads(line)["type"] for line in done.stdout.splitlines() if line.strip()}
    assert (done.returncode == 100) == bool(rules), (done.returncode, done.stdout)
    return rules


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of proto/ (with its buf.yaml, without the baseline) under ``tmp_path/proto``."""
    shutil.copytree(PROTO, tmp_path / "proto", ignore=shutil.ignore_patterns("*.binpb"))
    return tmp_path


def edit(tree: Path, name: str, old: str, new: str) -> None:
    path = tree / "proto" / "kiln" / "v1" / name
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not once in {name}"
    path.write_text(text.replace(old, new))


def test_lint_passes() -> None:
    done = run_buf("lint", "proto", cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compatible_with_the_baseline() -> None:
    assert BASELINE.is_file(), "proto/baseline.binpb is missing (see proto/buf.yaml)"
    assert breaking_rules(REPO_ROOT) == set()


def test_an_unchanged_copy_is_compatible(copy: Path) -> None:
    assert breaking_rules(copy) == set()


def test_adding_a_field_is_compatible(copy: Path) -> None:
    edit(copy, "common.proto", "  uint64 seed = 5;\n", "  uint64 seed = 5;\n  string note = 99;\n")
    assert breaking_rules(copy) == set()


def test_removing_a_field_breaks(copy: Path) -> None:
    edit(copy, "common.proto", "  string dtype = 4;\n", "")
    assert "FIELD_NO_DELETE" in breaking_rules(copy)


def test_renaming_an_rpc_breaks(copy: Path) -> None:
    edit(copy, "compiler.proto", "rpc Get(", "rpc Fetch(")
    assert "RPC_NO_DELETE" in breaking_rules(copy)


def test_renaming_a_field_breaks_json(copy: Path) -> None:
    """Same number, same binary encoding, another JSON name: FILE (not WIRE) catches it."""
    edit(copy, "common.proto", "  string dtype = 4;\n", "  string data_type = 4;\n")
    assert {"FIELD_SAME_NAME", "FIELD_SAME_JSON_NAME"} <= breaking_rules(copy)


def test_lint_catches_a_bad_enum_zero_value(copy: Path) -> None:
    """Lint runs the rules it claims to (STANDARD): a new enum without *_UNSPECIFIED fails."""
    path = copy / "proto" / "kiln" / "v1" / "common.proto"
    path.write_text(path.read_text() + "\nenum Colour {\n  RED = 0;\n}\n")
    done = run_buf("lint", "proto", "--error-format", "json", cwd=copy)
    assert done.returncode == 100, done.stdout + done.stderr
    rules = {json.loads(line)["type"] for line in done.stdout.splitlines() if line.strip()}
    assert "ENUM_ZERO_VALUE_SUFFIX" in rules

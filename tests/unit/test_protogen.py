"""The committed gRPC code in services/kiln/v1 must equal what the protos generate now."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from kiln import protogen


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    pytest.importorskip("mypy_protobuf")
    generated = protogen.generate(tmp_path)
    committed_dir = protogen.OUTPUT_ROOT / protogen.PACKAGE_DIR
    fresh_names = {p.name for p in generated}
    committed_names = {p.name for p in committed_dir.iterdir() if p.is_file()}
    assert fresh_names == committed_names, (
        "generated files differ from the committed ones; run `python -m kiln.protogen`"
    )
    stale = [p.name for p in generated if not filecmp.cmp(p, committed_dir / p.name, shallow=False)]
    assert not stale, f"stale generated code {stale}; run `python -m kiln.protogen`"


def test_every_proto_has_generated_modules() -> None:
    committed_dir = protogen.OUTPUT_ROOT / protogen.PACKAGE_DIR
    for proto in protogen.proto_files():
        assert (committed_dir / f"{proto.stem}_pb2.py").is_file()
        assert (committed_dir / f"{proto.stem}_pb2_grpc.py").is_file()

"""Generate the Python gRPC code in ``services/kiln/v1`` from ``proto/kiln/v1/*.proto``.

Run ``python -m kiln.protogen`` from the repository root after editing a proto. The generated
files are committed; ``tests/unit/test_protogen.py`` regenerates into a temporary directory and
fails when the committed files are stale. Output is deterministic for a pinned
``grpcio-tools`` / ``mypy-protobuf`` (see pyproject's ``dev`` extra).

Raises:
    FileNotFoundError: when run outside a checkout (no ``proto/`` directory).
    RuntimeError: when protoc reports an error.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path("kiln") / "v1"
OUTPUT_ROOT = REPO_ROOT / "services"


def proto_files() -> list[Path]:
    """The .proto files of package kiln.v1, sorted (so generation order is stable)."""
    files = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not files:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    return files


def generate(out_root: Path) -> list[Path]:
    """Run protoc for every kiln.v1 proto, writing ``out_root/kiln/v1/*``.

    Returns the generated file paths. Raises RuntimeError when protoc fails.
    """
    import grpc_tools
    from grpc_tools import protoc  # dev dependency

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    pkg = out_root / PACKAGE_DIR
    (pkg / "__init__.py").write_text(
        '"""Generated gRPC code for package kiln.v1 (python -m kiln.protogen)."""\n'
    )
    (pkg / "py.typed").write_text("")
    return sorted(p for p in pkg.iterdir() if p.is_file())


def main() -> int:
    """Regenerate into services/kiln/v1, replacing what is there."""
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        target = OUTPUT_ROOT / PACKAGE_DIR
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for path in generated:
            shutil.copy2(path, target / path.name)
    print(f"generated {len(generated)} files in {target.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The container images (Dockerfile, Dockerfile.engine, .dockerignore) and docker-compose.yml's
use of them, checked statically: there is no Docker daemon on CI's machine, so nothing here
builds or runs an image (README, "Deploying")."""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.engine")


@dataclass
class Stage:
    """One build stage: its base (an image or an earlier stage), name and instructions."""

    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def chain(self, stage: Stage) -> list[Stage]:
        """``stage`` and the stages it is built FROM, nearest first."""
        names = {s.name: s for s in self.stages}
        out = [stage]
        while out[-1].base in names:
            out.append(names[out[-1].base])
        return out

    def user(self, stage: Stage) -> str:
        """The user a container of ``stage`` runs as (root unless a USER says otherwise)."""
        for s in self.chain(stage):
            users = [arg for op, arg in s.instructions if op == "USER"]
            if users:
                return users[-1]
        return "root"

    def runs(self, stage: Stage) -> str:
        """Every RUN command of ``stage`` and its parents, one text."""
        return "\n".join(
            arg for s in self.chain(stage) for op, arg in s.instructions if op == "RUN"
        )

    def expand(self, text: str, stage: Stage | None = None) -> str:
        """``text`` with ``${ARG}`` replaced by the ARG defaults (global, then the stage's)."""
        values = dict(self.args)
        for s in reversed(self.chain(stage)) if stage else ():
            for op, arg in s.instructions:
                if op == "ARG" and "=" in arg:
                    k, v = arg.split("=", 1)
                    values[k.strip()] = v.strip()
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions of ``path``: continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        op, _, arg = line.partition(" ")
        op, arg = op.upper(), arg.strip()
        if op == "FROM":
            words = arg.split()
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else ""
            stages.append(Stage(words[0], name))
        elif not stages:
            assert op == "ARG", f"{path.name}: {op} before the first FROM"
            k, _, v = arg.partition("=")
            args[k] = v
        else:
            stages[-1].instructions.append((op, arg))
    return Dockerfile(path, args, stages)


@pytest.fixture(scope="module")
def dockerfiles() -> dict[str, Dockerfile]:
    return {name: parse_dockerfile(REPO / name) for name in DOCKERFILES}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _extras() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return set(project.get("optional-dependencies", {}))


# --- Dockerfiles ------------------------------------------------------------------------------
def test_every_base_image_is_pinned_by_tag(dockerfiles: dict[str, Dockerfile]) -> None:
    for df in dockerfiles.values():
        names = {s.name for s in df.stages}
        for stage in df.stages:
            base = df.expand(stage.base)
            if base in names:
                continue
            image, _, tag = base.rpartition(":")
            assert image and "/" not in tag and tag not in ("", "latest"), (df.path.name, base)


def test_images_run_as_a_non_root_user(dockerfiles: dict[str, Dockerfile]) -> None:
    for df in dockerfiles.values():
        bases = {s.base for s in df.stages}
        for stage in (s for s in df.stages if s.name not in bases):  # the targets one builds
            user = df.user(stage).split(":")[0]
            assert user not in ("root", "0"), (df.path.name, stage.name)
            created = df.runs(stage)
            assert re.search(rf"useradd\b[^\n]*\b{re.escape(user)}\b", created), (
                f"{df.path.name}:{stage.name}: USER {user} is never created"
            )


def test_the_default_target_is_the_slim_services_image(dockerfiles: dict[str, Dockerfile]) -> None:
    df = dockerfiles["Dockerfile"]
    last = df.stages[-1]
    assert last.name == "services", "a plain `docker build .` must build the services image"
    assert "torch" not in df.runs(last), "the services image has no torch"


def test_the_engine_image_has_cuda_torch_triton_and_a_compiler(
    dockerfiles: dict[str, Dockerfile],
) -> None:
    df = dockerfiles["Dockerfile.engine"]
    stage = df.stages[-1]
    assert df.expand(stage.base).startswith("nvidia/cuda:")
    runs = df.expand(df.runs(stage), stage)
    version = re.search(r"torch==(\d+)\.(\d+)", runs)
    assert version and (int(version[1]), int(version[2])) >= (2, 11), "torch >= 2.11"
    assert re.search(r"--index-url\s+\S*download\.pytorch\.org/whl/cu\d+", runs), "CUDA wheels"
    assert re.search(r"\bgcc\b", runs) and re.search(r"\bpython3-dev\b", runs), (
        "Triton compiles its launcher with the host's C compiler and Python's headers"
    )
    assert re.search(r"import torch, triton", runs), "the build checks torch and Triton import"
    cmd = [arg for op, arg in stage.instructions if op in ("ENTRYPOINT", "CMD")]
    assert "engine-pool" in " ".join(cmd)
    assert any(op == "HEALTHCHECK" and "kiln" in arg for op, arg in stage.instructions)


def test_the_cpu_engine_target_has_torch_and_a_compiler(dockerfiles: dict[str, Dockerfile]) -> None:
    df = dockerfiles["Dockerfile"]
    stage = df.stage("engine-cpu")
    runs = df.expand(df.runs(stage), stage)
    assert re.search(r"torch==\d", runs) and re.search(r"\bg\+\+", runs)
    assert re.search(r"\.\[[^\]]*\bengine\b", runs)


def test_pip_extras_exist_and_include_the_services_dependencies(
    dockerfiles: dict[str, Dockerfile],
) -> None:
    extras = _extras()
    for df in dockerfiles.values():
        for stage in df.stages:
            for op, arg in stage.instructions:
                if op != "RUN":
                    continue
                for group in re.findall(r'"\.\[([^\]]+)\]"', df.expand(arg, stage)):
                    used = {e.strip() for e in group.split(",")}
                    assert used <= extras, (df.path.name, used - extras)
                    if "server" in extras:  # plain `kiln` is the gRPC client only
                        assert "server" in used, (df.path.name, stage.name)


def _copies(df: Dockerfile) -> list[str]:
    sources = []
    for stage in df.stages:
        for op, arg in stage.instructions:
            if op in ("COPY", "ADD"):
                words = [w for w in shlex.split(arg) if not w.startswith("--")]
                assert not any(w.startswith("--from") for w in shlex.split(arg))
                sources.extend(words[:-1])
    return sources


def test_every_copy_source_exists(dockerfiles: dict[str, Dockerfile]) -> None:
    for df in dockerfiles.values():
        for src in _copies(df):
            if any(c in src for c in "*?["):
                continue  # a wildcard may match nothing (LICENSE* before there is one)
            assert (REPO / src).exists(), f"{df.path.name}: COPY {src}: no such path"
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        for pattern in project.get("license-files", []):
            assert any(fnmatch.fnmatch(pattern, src) for src in _copies(df)), (
                f"{df.path.name} copies no {pattern} (pyproject's license-files)"
            )


def _ignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def test_dockerignore_keeps_local_state_out_but_not_what_is_copied(
    dockerfiles: dict[str, Dockerfile],
) -> None:
    patterns = _ignore_patterns()
    assert not any(p.startswith("!") for p in patterns)

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) for p in patterns)

    for path in (".venv", ".git", ".whl", ".data", ".head", ".devrun", ".env", "x.whl"):
        assert ignored(path), path
    assert ignored("benchmarks/results") or ignored("benchmarks")
    for df in dockerfiles.values():
        for src in _copies(df):
            assert not ignored(src.rstrip("*")) or "*" in src, f"{src} is copied but ignored"


# --- docker-compose.yml -----------------------------------------------------------------------
def _build(service: dict) -> tuple[str, str | None]:
    build = service["build"]
    return build.get("dockerfile", "Dockerfile"), build.get("target")


def test_compose_builds_each_service_from_a_real_target(
    compose: dict, dockerfiles: dict[str, Dockerfile]
) -> None:
    images: dict[str, tuple[str, str | None]] = {}
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        dockerfile, target = _build(service)
        df = dockerfiles[dockerfile]
        stage = df.stage(target) if target else df.stages[-1]
        assert stage is not None, (name, target)
        image = service["image"]
        assert images.setdefault(image, (dockerfile, target)) == (dockerfile, target), (
            f"image {image} is built from two targets"
        )
    assert _build(compose["services"]["engine-pool"]) == ("Dockerfile", "engine-cpu"), (
        "CPU engines in compose (no GPU needed) run the engine-cpu target"
    )
    assert _build(compose["services"]["engine-pool-gpu"])[0] == "Dockerfile.engine"
    for name in ("ledger", "agent-runner", "cost-model", "migrate", "pki"):
        assert _build(compose["services"][name]) == ("Dockerfile", "services"), name


def compose_images() -> dict[str, tuple[str, str | None]]:
    """Image name (no tag) -> (Dockerfile, target) of every image docker-compose.yml builds."""
    data = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return {s["image"].split(":")[0]: _build(s) for s in data["services"].values() if "build" in s}


def test_only_the_ledger_and_the_migration_get_the_database_password() -> None:
    """The database URL (with its password) reaches no other container: the engine pool runs
    candidate code."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    given = {n for n, s in services.items() if "KILN_DATABASE_URL" in (s.get("environment") or {})}
    assert given == {"ledger", "migrate"}

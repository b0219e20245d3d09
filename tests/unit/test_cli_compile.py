"""``kiln compile`` input handling (no services needed): budgets and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli.budget import parse_duration_s
from kiln.cli.main import app

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
LLAMA = DATA / "models" / "llama-3.2-1b.json"
CONV = DATA / "traces" / "azure_llm_2023_conv.csv"


@pytest.mark.parametrize(
    ("text", "seconds"), [("300", 300), ("2.5", 2.5), ("90s", 90), ("5m", 300), ("1h30m", 5400)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5", "5x", "m5", "1h 30m", "nan", "inf", "5m3"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="budget"):
        parse_duration_s(text)


@pytest.mark.skipif(not LLAMA.is_file(), reason="../shared/data is not here")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nope/config.json", "--traffic", str(CONV)], "does not exist"),
        (["--model", str(LLAMA), "--traffic", "/nope.csv"], "does not exist"),
        (
            [
                "--model",
                str(Path(__file__).parent / "data" / "mamba2-config.json"),
                "--traffic",
                str(CONV),
            ],
            "unsupported architecture 'mamba2'",
        ),
        (["--model", str(LLAMA), "--traffic", str(LLAMA)], "malformed rows"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_sent(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens here: if the command got as far as submitting, the error would differ.
    monkeypatch.setenv("KILN_AGENT_RUNNER_ADDR", "127.0.0.1:1")
    result = CliRunner().invoke(app, ["compile", *args])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output


@pytest.mark.skipif(not LLAMA.is_file(), reason="../shared/data is not here")
def test_unreachable_agent_runner_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_AGENT_RUNNER_ADDR", "127.0.0.1:1")
    result = CliRunner().invoke(app, ["compile", "--model", str(LLAMA), "--traffic", str(CONV)])
    assert result.exit_code == 1
    assert "agent runner at 127.0.0.1:1 is not reachable" in result.output


def test_a_bad_budget_is_a_usage_error_naming_the_option() -> None:
    result = CliRunner().invoke(app, ["compile", "--model", "m", "--traffic", "t", "--budget", "0"])
    assert result.exit_code == 2
    assert "--budget" in result.output and "positive duration" in result.output


def test_the_live_view_names_the_agent_and_candidate_of_each_result() -> None:
    from google.protobuf.struct_pb2 import Struct

    from kiln.cli.compile_view import CompileView
    from kiln.v1 import compiler_pb2

    def event(kind: str, **detail: object) -> compiler_pb2.CompilationEvent:
        s = Struct()
        s.update(detail)
        return compiler_pb2.CompilationEvent(type=kind, detail=s)

    view = CompileView("c", budget_s=60)
    sdpa = {"ops": {"attention": "sdpa"}, "transforms": [], "code_modules": [], "lossy": False}
    fused = {"ops": {"qkv_proj": "fused"}, "transforms": [], "code_modules": [], "lossy": False}
    view.update(event("ExperimentRequested", agent="coordinate", candidate_id="a", candidate=sdpa))
    view.update(event("ExperimentRequested", agent="random", candidate_id="b", candidate=fused))
    view.update(event("ExperimentCompleted", candidate_id="b", status="ok", tokens_per_s=26.2))
    assert view.recent[-1] == "random: ok 26.2 tok/s ← qkv_proj=fused"
    assert view.agents == {
        "coordinate": "measuring attention=sdpa",
        "random": "ok 26.2 tok/s ← qkv_proj=fused",
    }
    # At 80 columns each line keeps its result; a long candidate is cut at its end.
    from rich.console import Console

    long = {"ops": {f"op{i}": "fused_variant" for i in range(12)}, "transforms": []}
    view.update(event("ExperimentRequested", agent="random", candidate_id="c", candidate=long))
    view.update(event("ExperimentCompleted", candidate_id="c", status="ok", tokens_per_s=31.5))
    console = Console(width=80, record=True)
    console.print(view.render())
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80
    assert any(line.startswith("random: ok 31.5 tok/s ← op0=fused_variant") for line in lines)
    assert sum("ok 31.5 tok/s" in line for line in lines) == 2  # the agents table and the line

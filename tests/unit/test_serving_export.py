"""``kiln.export.serving``: a plan as vLLM, SGLang and TensorRT-LLM launch files, and ``kiln
export --format``. Every flag and YAML key the renderers emit must be in the allow-lists below,
which were checked by hand against each engine's source, so an invented spelling fails here.

The CLI is tested through its command with ``Compiler.Get`` replaced by a hand-built
``Compilation``: a real agent runner needs PostgreSQL and NATS (tests/integration), which is not
cheap enough for these checks."""

from __future__ import annotations

import math
import os
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kiln.cli.errors import CliError
from kiln.cli.export import ExportFormat, launch_files
from kiln.cli.main import app
from kiln.common.errors import NotFound, Unavailable
from kiln.export.serving import (
    FORMATS,
    LAUNCH_SCRIPT,
    TRTLLM_CONFIG,
    VLLM_CONFIG,
    cuda_graph_sizes,
    launch_of,
    render,
)
from kiln.v1 import common_pb2, compiler_pb2

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"

# vLLM, vllm/engine/arg_utils.py at 99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b
# (EngineArgs.add_cli_args; `vllm serve --config FILE` takes the long option names without the
# dashes:
# vllm/utils/argparse_utils.py FlexibleArgumentParser.load_config_file at
# 00da11e37d1ffac917c3427fff227500302eb452; kv cache dtypes: vllm/config/cache.py CacheDType at
# 002f10e0cfa1373a19a0d2756598a34b700d20e5).
VLLM_FLAGS = {"--config"}
VLLM_KEYS = {
    "tensor-parallel-size",
    "pipeline-parallel-size",
    "data-parallel-size",
    "decode-context-parallel-size",
    "enable-expert-parallel",
    "max-num-seqs",
    "max-model-len",
    "max-num-batched-tokens",
    "enable-chunked-prefill",
    "cudagraph-capture-sizes",
    "gpu-memory-utilization",
    "kv-cache-dtype",
    "quantization",
}
# SGLang, python/sglang/srt/server_args.py at 001067fffe33427bee0ed2f007fb7551a1d76b44 (ServerArgs
# fields, flag = --field-name; --cuda-graph-max-bs is now a deprecated alias of
# --cuda-graph-max-bs-decode); python/sglang/launch_server.py at
# 046a9e4088f7d500fb3c4d14afabc031208c739a.
SGLANG_FLAGS = {
    "--model-path",
    "--tp-size",
    "--pp-size",
    "--dp-size",
    "--ep-size",
    "--dcp-size",
    "--enable-dp-attention",
    "--max-running-requests",
    "--context-length",
    "--chunked-prefill-size",
    "--cuda-graph-max-bs-decode",
    "--mem-fraction-static",
    "--kv-cache-dtype",
    "--quantization",
}
# TensorRT-LLM, tensorrt_llm/commands/serve.py at 00209af149e7774406881a37283dce303571eb11 (the
# click options of `trtllm-serve serve`) and tensorrt_llm/llmapi/llm_args.py at
# 0004396720054fd8e205cbf616f21f0b57c6b412 (BaseLlmArgs, TorchLlmArgs.cuda_graph_config,
# BaseCudaGraphConfig, KvCacheConfig).
TRTLLM_FLAGS = {
    "--backend",
    "--tp_size",
    "--pp_size",
    "--ep_size",
    "--max_batch_size",
    "--max_seq_len",
    "--max_num_tokens",
    "--kv_cache_free_gpu_memory_fraction",
    "--extra_llm_api_options",
    "--port",
}
TRTLLM_KEYS = {
    "enable_chunked_prefill",
    "enable_attention_dp",
    "cuda_graph_config",
    "cuda_graph_config.enable_padding",
    "cuda_graph_config.batch_sizes",
    "kv_cache_config",
    "kv_cache_config.dtype",
    "kv_cache_config.free_gpu_memory_fraction",
}
ALLOWED_FLAGS = {"vllm": VLLM_FLAGS, "sglang": SGLANG_FLAGS, "trtllm": TRTLLM_FLAGS}
ALLOWED_KEYS = {"vllm": VLLM_KEYS, "sglang": set(), "trtllm": TRTLLM_KEYS}
COMMANDS = {
    "vllm": ["vllm", "serve"],
    "sglang": ["python3", "-m", "sglang.launch_server"],
    "trtllm": ["trtllm-serve"],
}

pytestmark = pytest.mark.skipif(
    not (MODELS / "llama-3.2-1b.json").is_file(), reason="../shared/data/models is absent"
)


def _workload(
    model: str, batch: int, *, isl: tuple[float, float] = (900, 1800), osl=(150, 400), dtype=""
) -> common_pb2.Workload:
    return common_pb2.Workload(
        model=common_pb2.ModelSpec(
            name=model, config_json=(MODELS / f"{model}.json").read_text(), dtype=dtype
        ),
        traffic=common_pb2.TrafficShape(
            isl_tokens=common_pb2.Distribution(p50=isl[0], p99=isl[1]),
            osl_tokens=common_pb2.Distribution(p50=osl[0], p99=osl[1]),
            batch_size=batch,
            context_len=1200,
        ),
        hardware=common_pb2.HardwareTarget(name="h200", num_devices=8),
    )


def _plan(tp: int, batch: int, *, ep: int = 1, dp: int = 1, dcp: int = 1, pp: int = 1) -> Any:
    return common_pb2.ParallelismPlan(
        tp=tp,
        ep=ep,
        dp=dp,
        pp=pp,
        dcp=dcp,
        batch_size=batch,
        ttft_ms=123.4,
        tpot_ms=9.87,
        throughput_tokens_per_s=4321.0,
        throughput_per_device=4321.0 / (tp * dp * pp),
        estimate_tier="roofline",
        feasible=True,
    )


CASES = {
    "llama-tp1": ("llama-3.2-1b", _plan(1, 1)),
    "qwen3-moe-tp4-ep4-dp2": ("qwen3-30b-a3b", _plan(4, 64, ep=4, dp=2)),
    "deepseek-tp8-dcp8": ("deepseek-v3", _plan(8, 32, dcp=8)),
    "deepseek-attention-dp": ("deepseek-v3", _plan(1, 256, ep=8, dp=8)),
}


def _launch(case: str, **kw: Any) -> Any:
    model, plan = CASES[case]
    return launch_of(plan, _workload(model, plan.batch_size), compilation_id="c-123", **kw)


def _argv(script: str) -> list[str]:
    """The words of the script's engine command (continuations joined, comments dropped)."""
    text = script.replace("\\\n", " ")
    return shlex.split(text, comments=True)


def _flags(script: str) -> dict[str, str | None]:
    """Each ``--flag`` of the script and the word after it (None for a switch)."""
    words = _argv(script)
    out: dict[str, str | None] = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else None
            out[w] = None if nxt is None or nxt.startswith("--") or nxt == "$@" else nxt
    return out


def _keys(conf: dict[str, Any]) -> set[str]:
    keys = set(conf)
    for k, v in conf.items():
        if isinstance(v, dict):
            keys |= {f"{k}.{sub}" for sub in v}
    return keys


def _config(files: dict[str, str]) -> dict[str, Any]:
    yml = [name for name in files if name != LAUNCH_SCRIPT]
    return yaml.safe_load(files[yml[0]]) if yml else {}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_only_verified_flags_and_keys_and_the_files_parse(
    fmt: Any, case: str, tmp_path: Path
) -> None:
    files = render(fmt, _launch(case))
    assert LAUNCH_SCRIPT in files
    script = files[LAUNCH_SCRIPT]
    assert script.startswith("#!/usr/bin/env bash\n# Generated by kiln")
    assert "set -euo pipefail" in script
    path = tmp_path / LAUNCH_SCRIPT
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    head = COMMANDS[fmt]
    words = _argv(script)
    assert any(words[i : i + len(head)] == head for i in range(len(words))), words
    emitted = {w for w in words if w.startswith("--")}
    assert emitted <= ALLOWED_FLAGS[fmt], emitted - ALLOWED_FLAGS[fmt]
    conf = _config(files)
    assert _keys(conf) <= ALLOWED_KEYS[fmt], _keys(conf) - ALLOWED_KEYS[fmt]
    for name, text in files.items():
        comments = [line for line in text.splitlines() if line.startswith("#")][:4]
        header = "\n".join(comments)
        assert "Generated by kiln" in header and "c-123" in header, name
        for word in ("TPOT 9.87 ms", "TTFT 123.4 ms", "4,321.0 tokens/s", "per GPU", "roofline"):
            assert word in header, (name, word)
    if fmt == "vllm":
        assert set(files) == {LAUNCH_SCRIPT, VLLM_CONFIG}
    if fmt == "trtllm":
        assert set(files) == {LAUNCH_SCRIPT, TRTLLM_CONFIG}
        assert _flags(script)["--backend"] == "pytorch"


def test_launch_values_per_plan() -> None:
    llama = _launch("llama-tp1")
    assert (llama.tp, llama.ep, llama.dp, llama.max_num_seqs) == (1, 1, 1, 1)
    assert llama.cuda_graph_sizes == (1,) and llama.quantization is None
    assert llama.max_model_len == 1800 + 400 and llama.max_batched_tokens == 8192  # priced
    assert llama.model_path == "llama-3.2-1b"  # no _name_or_path in the config: its name
    qwen = _launch("qwen3-moe-tp4-ep4-dp2")
    assert (qwen.tp, qwen.ep, qwen.dp, qwen.max_num_seqs) == (4, 4, 2, math.ceil(64 / 2))
    assert qwen.cuda_graph_sizes == (1, 2, 4, 8, 16, 24, 32) and not qwen.attention_dp
    ds = _launch("deepseek-tp8-dcp8")
    assert (ds.tp, ds.dcp, ds.ep, ds.quantization) == (8, 8, 1, "fp8")
    assert ds.kv_cache_dtype == "auto"


def test_vllm_values() -> None:
    conf = _config(render("vllm", _launch("qwen3-moe-tp4-ep4-dp2")))
    assert conf["tensor-parallel-size"] == 4 and conf["data-parallel-size"] == 2
    assert conf["enable-expert-parallel"] is True and conf["max-num-seqs"] == 32
    assert conf["cudagraph-capture-sizes"] == [1, 2, 4, 8, 16, 24, 32]
    assert conf["enable-chunked-prefill"] is True and "quantization" not in conf
    ds = _config(render("vllm", _launch("deepseek-tp8-dcp8")))
    assert ds["decode-context-parallel-size"] == 8 and ds["quantization"] == "fp8"
    assert "enable-expert-parallel" not in ds and ds["kv-cache-dtype"] == "auto"
    llama = _config(render("vllm", _launch("llama-tp1")))
    assert llama["tensor-parallel-size"] == 1 and llama["cudagraph-capture-sizes"] == [1]
    assert "enable-expert-parallel" not in llama and "decode-context-parallel-size" not in llama


def test_sglang_values() -> None:
    qwen = _flags(render("sglang", _launch("qwen3-moe-tp4-ep4-dp2"))[LAUNCH_SCRIPT])
    assert qwen["--tp-size"] == "4" and qwen["--dp-size"] == "2" and qwen["--ep-size"] == "4"
    assert "--enable-dp-attention" not in qwen  # experts stay inside each replica's TP group
    assert qwen["--max-running-requests"] == "32" and qwen["--cuda-graph-max-bs-decode"] == "32"
    assert "--quantization" not in qwen
    adp = _flags(render("sglang", _launch("deepseek-attention-dp"))[LAUNCH_SCRIPT])
    assert "--enable-dp-attention" in adp and adp["--enable-dp-attention"] is None
    assert adp["--tp-size"] == "8" and adp["--dp-size"] == "8" and adp["--ep-size"] == "8"
    assert adp["--max-running-requests"] == "256"  # SGLang divides it over the DP ranks
    assert adp["--cuda-graph-max-bs-decode"] == "32" and adp["--quantization"] == "fp8"
    ds = _flags(render("sglang", _launch("deepseek-tp8-dcp8"))[LAUNCH_SCRIPT])
    assert ds["--dcp-size"] == "8" and "--ep-size" not in ds


def test_trtllm_values() -> None:
    files = render("trtllm", _launch("deepseek-attention-dp"))
    flags, conf = _flags(files[LAUNCH_SCRIPT]), _config(files)
    assert flags["--tp_size"] == "8" and flags["--ep_size"] == "8"
    assert flags["--max_batch_size"] == "32" and conf["enable_attention_dp"] is True
    assert conf["cuda_graph_config"] == {
        "enable_padding": True,
        "batch_sizes": [1, 2, 4, 8, 16, 24, 32],
    }
    assert conf["kv_cache_config"] == {"dtype": "auto", "free_gpu_memory_fraction": 0.9}
    ds = render("trtllm", _launch("deepseek-tp8-dcp8"))
    assert "dcp=8 is not exported" in ds[LAUNCH_SCRIPT]
    assert "enable_attention_dp" not in _config(ds)
    llama = _flags(render("trtllm", _launch("llama-tp1"))[LAUNCH_SCRIPT])
    assert llama["--tp_size"] == "1" and "--ep_size" not in llama


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def test_the_scripts_run_the_engine_with_extra_arguments(tmp_path: Path) -> None:
    """vLLM's script runs ``vllm serve`` with its YAML beside it; TensorRT-LLM's starts one
    server per DP replica on its own GPUs and port."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    _stub(bin_dir, "vllm", f'printf "%s\\n" "$@" > {log}/vllm\n')
    _stub(
        bin_dir,
        "trtllm-serve",
        f'printf "%s\\n" "$CUDA_VISIBLE_DEVICES" "$@" > "{log}/trt.$$"\n'
        f'for _ in $(seq 50); do [ "$(ls {log} | grep -c trt)" -ge 2 ] && exit 0; sleep 0.1\n'
        "done\n",
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PORT": "9100"}
    for fmt in ("vllm", "trtllm"):
        out = tmp_path / fmt
        out.mkdir()
        for name, text in render(fmt, _launch("qwen3-moe-tp4-ep4-dp2")).items():
            (out / name).write_text(text)
        run = subprocess.run(
            ["bash", str(out / LAUNCH_SCRIPT), "--trust-remote-code"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert run.returncode == 0, run.stderr
    vllm = (log / "vllm").read_text().split("\n")
    assert vllm[:4] == ["serve", "qwen3-30b-a3b", "--config", str(tmp_path / "vllm" / VLLM_CONFIG)]
    assert vllm[4] == "--trust-remote-code"
    replicas = sorted((p.read_text().split("\n") for p in log.glob("trt.*")), key=lambda r: r[0])
    assert [r[0] for r in replicas] == ["0,1,2,3", "4,5,6,7"]
    for i, argv in enumerate(replicas):
        assert argv[argv.index("--port") + 1] == str(9100 + i) and "--trust-remote-code" in argv


def test_values_are_shell_quoted() -> None:
    odd = "/models/it's a $HOME; dir"
    for fmt in FORMATS:
        script = render(fmt, _launch("llama-tp1", model_path=odd))[LAUNCH_SCRIPT]
        assert odd in _argv(script), fmt


@pytest.mark.parametrize(
    ("n", "sizes"),
    [(1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20)), (33, None)],
)
def test_cuda_graph_sizes(n: int, sizes: tuple[int, ...] | None) -> None:
    expected = sizes or (1, 2, 4, 8, 16, 24, 32, 33)
    assert cuda_graph_sizes(n) == expected


def test_model_length_and_model_path() -> None:
    plan = _plan(1, 4)
    long = launch_of(plan, _workload("llama-3.2-1b", 4, isl=(100_000, 500_000)))
    assert long.max_model_len == 131072  # max_position_embeddings
    assert long.max_batched_tokens == 8192
    p50 = _workload("llama-3.2-1b", 4, isl=(500, 0), osl=(100, 0))
    assert launch_of(plan, p50).max_model_len == 1200  # the plan's context beats 500 + 100
    named = _workload("llama-3.2-1b", 4)
    named.model.config_json = named.model.config_json.replace(
        "{", '{"_name_or_path": "meta-llama/Llama-3.2-1B",', 1
    )
    assert launch_of(plan, named).model_path == "meta-llama/Llama-3.2-1B"
    assert not launch_of(plan, named).model_path_guessed
    assert launch_of(plan, _workload("llama-3.2-1b", 4)).model_path_guessed  # callers warn
    assert launch_of(plan, named, "/ckpt").model_path == "/ckpt"
    fp8 = launch_of(plan, _workload("llama-3.2-1b", 4, dtype="float8_e4m3fn"))
    assert fp8.quantization == "fp8"
    batch = launch_of(_plan(1, 300), _workload("llama-3.2-1b", 300, isl=(100, 100), osl=(20, 20)))
    assert batch.max_batched_tokens == 8192 and batch.max_num_seqs == 300
    crowd = launch_of(_plan(1, 9000), _workload("llama-3.2-1b", 9000, isl=(100, 100)))
    assert crowd.max_batched_tokens == 9000  # a decode step of every sequence fits


def test_an_infeasible_plan_is_refused() -> None:
    plan = _plan(2, 1)
    plan.feasible, plan.infeasible_reason = False, "memory: needs 90 GB per device"
    with pytest.raises(ValueError, match="infeasible: memory"):
        launch_of(plan, _workload("llama-3.2-1b", 1))


# ------------------------------------------------------------------------------- the command


def _compilation(case: str = "qwen3-moe-tp4-ep4-dp2", plan: bool = True) -> Any:
    model, p = CASES[case]
    c = compiler_pb2.Compilation(compilation_id="c-123", workload=_workload(model, p.batch_size))
    if plan:
        c.plan.CopyFrom(p)
    return c


def _fake_get(monkeypatch: pytest.MonkeyPatch, answer: Any) -> list[Any]:
    seen: list[Any] = []

    async def call(ctx: Any, method: str, request: Any) -> Any:
        seen.append((method, request.compilation_id))
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr("kiln.cli.compiler_call.call", call)
    return seen


def test_launch_files_need_a_plan() -> None:
    with pytest.raises(CliError, match="compilation c-123 has no plan yet"):
        launch_files(_compilation(plan=False), ExportFormat.vllm)
    files = launch_files(_compilation(), ExportFormat.sglang, "/ckpt")
    assert "--model-path /ckpt" in files[LAUNCH_SCRIPT]


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_format_writes_the_files(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _fake_get(monkeypatch, _compilation())
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", "c-123", "--out", str(out), "--format", fmt])
    assert result.exit_code == 0, result.output
    assert seen == [("Get", "c-123")]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(render(fmt, _launch("qwen3-moe-tp4-ep4-dp2")))
    lines = [line for line in result.output.splitlines() if line.strip()]
    warning, *wrote = lines  # no --model-path, no _name_or_path: the name, with a warning
    assert warning.startswith("warning: serving 'qwen3-30b-a3b', the model's name")
    assert len(wrote) == len(names) and all(line.startswith("wrote ") for line in wrote)
    assert (out / LAUNCH_SCRIPT).stat().st_mode & stat.S_IXUSR


@pytest.mark.parametrize(
    ("args", "answer", "message"),
    [
        ([], _compilation(plan=False) if MODELS.is_dir() else None, "has no plan yet"),
        ([], NotFound("compilation c-123 not found"), "NOT_FOUND: compilation c-123 not found"),
        ([], Unavailable("connection refused"), "is not reachable: connection refused"),
        (["--candidate", "abc"], None, "--candidate applies to --format artifact only"),
    ],
)
def test_export_format_errors_are_one_line(
    args: list[str], answer: Any, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_AGENT_RUNNER_ADDR", "127.0.0.1:1")
    _fake_get(monkeypatch, answer)
    argv = ["export", "c-123", "--out", str(tmp_path / "o"), "--format", "vllm", *args]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == (2 if message.startswith("--") else 1)  # 2: bad options
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "o").exists()


def test_export_format_refuses_a_used_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _fake_get(monkeypatch, _compilation())
    (tmp_path / "keep").write_text("x")
    argv = ["export", "c-123", "--out", str(tmp_path), "--format", "trtllm"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1 and "is not an empty directory" in result.output
    assert seen == []  # refused before the call


def test_export_format_of_a_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake_get(monkeypatch, _compilation())
    monkeypatch.setattr("kiln.cli.export._active_of", lambda ctx, name: ("c-123", "cand-1"))
    argv = ["export", "--deployment", "prod", "--out", str(tmp_path / "o"), "--format", "vllm"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert seen == [("Get", "c-123")] and (tmp_path / "o" / VLLM_CONFIG).is_file()


def test_model_path_is_for_engine_formats_only(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["export", "c-123", "--out", str(tmp_path / "o"), "--model-path", "/m"]
    )
    assert result.exit_code == 2 and "--model-path applies to --format" in result.output


def test_a_plan_with_an_fp8_kv_cache_exports_it_to_every_engine() -> None:
    model, plan = CASES["llama-tp1"]
    fp8 = common_pb2.ParallelismPlan()
    fp8.CopyFrom(plan)
    fp8.kv_cache_dtype = "float8_e4m3fn"  # the cost model's choice where a BF16 cache does not fit
    launch = launch_of(fp8, _workload(model, fp8.batch_size))
    assert launch.kv_cache_dtype == "fp8"
    assert _config(render("vllm", launch))["kv-cache-dtype"] == "fp8"
    assert _flags(render("sglang", launch)[LAUNCH_SCRIPT])["--kv-cache-dtype"] == "fp8_e4m3"
    assert _config(render("trtllm", launch))["kv_cache_config"]["dtype"] == "fp8"


def test_attention_dp_with_experts_split_by_tp_is_exported_as_such() -> None:
    # DeepSeek-V3 on 8 H200: attention tp4 in two DP replicas, every expert split over all 8
    model, _ = CASES["deepseek-tp8-dcp8"]
    plan = _plan(4, 64, dp=2)
    plan.moe_tp = 8
    launch = launch_of(plan, _workload(model, plan.batch_size))
    assert launch.attention_dp and launch.moe_tp == 8 and "etp8" in launch.label
    sglang = _flags(render("sglang", launch)[LAUNCH_SCRIPT])
    assert sglang["--tp-size"] == "8" and sglang["--dp-size"] == "2"
    assert "--enable-dp-attention" in sglang and "--ep-size" not in sglang  # MoE TP over 8
    vllm_files = render("vllm", launch)
    assert _config(vllm_files)["enable-expert-parallel"] is True
    assert "splits each expert moe_tp=8 ways" in vllm_files[LAUNCH_SCRIPT]
    trt_files = render("trtllm", launch)
    assert _flags(trt_files[LAUNCH_SCRIPT])["--tp_size"] == "8"
    assert _config(trt_files)["enable_attention_dp"] is True


def test_a_model_path_that_reads_as_a_flag_is_refused() -> None:
    model, plan = CASES["llama-tp1"]
    with pytest.raises(ValueError, match="starts with '-'"):
        launch_of(plan, _workload(model, plan.batch_size), model_path="--trust-remote-code")

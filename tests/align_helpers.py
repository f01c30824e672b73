"""Run the real `trace-fp4 align --model DIR` command once per test module (test helper)."""

import json
import subprocess
import sys
from pathlib import Path


def run_align(model: Path, workdir: Path, *, num_prompts: int, max_tokens: int):
    """(the finished process, its JSON result); the process must exit 0 (its stderr tail otherwise)."""
    out = workdir / "align.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trace_fp4.cli", "align", "--model", str(model), "--num-prompts", str(num_prompts),
         "--max-tokens", str(max_tokens), "--workdir", str(workdir / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads(out.read_text())

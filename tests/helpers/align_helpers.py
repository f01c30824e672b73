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


def config_variant(model: Path, tmp_path: Path, edit) -> Path:
    """`tmp_path / "model"`: checkpoint `model` with its config.json replaced by `edit(config)` (a JSON
    value; a str is written as it is, e.g. a file that is not valid JSON); the other files are symlinks
    to `model`'s. For the tests of bad configs: one tiny checkpoint, many broken config.json files."""
    d = tmp_path / "model"
    d.mkdir()
    for f in model.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = edit(json.loads((model / "config.json").read_text()))
    (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return d

"""The measurement tables in README.md and docs/measurements.md are rendered from bench/results/*.json
(bench/render_results.py): a table edited by hand, or a JSON re-measured without re-rendering, fails here."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_results", REPO / "bench" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_rendered_table_equals_its_json():
    rr = _renderer()
    for path in rr.TARGETS:
        text = path.read_text()
        assert rr.BLOCK.search(text), f"{path} has no rendered results block"
        assert rr.render(text, path) == text, f"{path.relative_to(REPO)}: re-run bench/render_results.py"


def test_a_changed_figure_changes_the_table(monkeypatch):
    rr = _renderer()
    align = json.loads((REPO / "bench" / "results" / "align.json").read_text())
    align["modes"]["fp4_rtn"]["codeword_mismatch_rate"] = 0.5
    monkeypatch.setattr(rr, "_load", lambda name: align if name == "align" else None)
    readme = REPO / "README.md"
    text = readme.read_text()
    rendered = rr.render(text, readme)
    assert rendered != text and "50.000%" in rendered

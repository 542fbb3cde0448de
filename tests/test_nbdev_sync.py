"""The notebook/library sync check passes on this tree and catches both kinds of drift."""
import json
import shutil

from nbdev_sync import ROOT, sync_problems


def copy_project(tmp_path):
    for name in ("settings.ini",):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "nbs", tmp_path / "nbs")
    shutil.copytree(ROOT / "slm_bench", tmp_path / "slm_bench", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_tree_is_in_sync():
    assert sync_problems() == []


def test_detects_a_notebook_with_outputs(tmp_path):
    root = copy_project(tmp_path)
    path = root / "nbs" / "core" / "02_store.ipynb"
    nb = json.loads(path.read_text())
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["execution_count"] = 3
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["hi\n"]}]
    path.write_text(json.dumps(nb, indent=1))
    assert sync_problems(root) == ["nbs/core/02_store.ipynb is not clean (outputs, execution counts or metadata): run `make export` and commit it"]


def test_detects_a_module_edited_without_its_notebook(tmp_path):
    root = copy_project(tmp_path)
    module = root / "slm_bench" / "core" / "store.py"
    module.write_text(module.read_text() + "\nEDITED_BY_HAND = True\n")
    (root / "slm_bench" / "stray.py").write_text("x = 1\n")
    (root / "slm_bench" / "train" / "__init__.py").write_text('"""Training."""\nfrom .engine import Trainer\n')
    problems = sync_problems(root)
    assert any(p.startswith("slm_bench/core/store.py differs") for p in problems), problems
    assert any(p.startswith("slm_bench/stray.py comes from no notebook") for p in problems), problems
    assert any(p.startswith("slm_bench/train/__init__.py differs") for p in problems), problems  # code, not a docstring
    assert not any(p.startswith("slm_bench/lm/__init__.py") for p in problems), problems  # docstring-only markers are fine

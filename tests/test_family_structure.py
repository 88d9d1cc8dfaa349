"""The engine asks the model's AttentionFamily; it does not sniff (issue 31, part 1).

Checked over the source of atom/model_engine/ (ast, nothing imported):

- no `hasattr(...)` / `getattr(...)` whose first argument mentions a model or a layer
  (`self.model`, `model_class(hf)`, `layers[0]`, `layer`...): what a family has or supports
  is a method or a field of its family object (atom/attention/family.py);
- no family named by string or sniffed by a marker attribute: no `is_v4`, `latent_dim` or
  `attention_backend` anywhere in atom/model_engine/.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "atom" / "model_engine"

# First arguments that mention "model" without being a model: the engine's runner (a
# ModelRunner, a DistributedRunner or a test's fake; its protocol is part 3's), not a model.
NOT_A_MODEL = {"self.model_runner"}
FAMILY_MARKERS = ("is_v4", "latent_dim", "attention_backend")


def _sniffing_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("hasattr", "getattr") or not node.args:
            continue
        target = ast.unparse(node.args[0])
        lowered = target.lower()
        if ("model" in lowered or "layer" in lowered) and target not in NOT_A_MODEL:
            yield node.lineno, ast.unparse(node)


def test_sniffing_finder_sees_model_and_layer_dispatch():
    source = (
        "getattr(self.model, 'state_layers', [])\n"
        "hasattr(layers[0], 'latent_dim')\n"
        "getattr(model_class(hf), 'stage_holds', None)\n"
        "getattr(self.model_runner, 'num_state_slots', 0)\n"
        "getattr(hf_config, 'max_position_embeddings', 1)\n"
    )
    found = [line for line, _ in _sniffing_calls(ast.parse(source))]
    assert found == [1, 2, 3]


def test_no_model_or_layer_sniffing_in_model_engine():
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for line, call in _sniffing_calls(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(ROOT).as_posix()}:{line}: {call}")
    assert offenders == []


def test_no_family_marker_in_model_engine():
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for marker in FAMILY_MARKERS:
                if marker in line:
                    offenders.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {marker}")
    assert offenders == []


def test_no_string_registry_of_backends():
    assert not (ROOT / "atom" / "attention" / "registry.py").exists()
    for path in (ROOT / "atom").rglob("*.py"):
        assert "attention.registry" not in path.read_text(), path

"""docs/architecture.md's "Adding a method", run: its three blocks (a config leaf, a method
module, a test) written to a temporary folder, imported, and the method run through the
conformance checks and its own test; then forgotten."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from fedpeft.config.methods import registry as config_registry
from fedpeft.methods import REGISTRY
from fedpeft.methods.registry import unregister_method
from tests.helpers.conformance import assert_conforms

ARCHITECTURE = Path(__file__).parents[2] / "docs" / "architecture.md"

#: the worked example's modules, as this test names them (in-tree: fedpeft.config.methods.damped,
#: fedpeft.methods.damped, tests.methods.test_damped)
MODULES = ("toy_damped_config", "toy_damped", "toy_test_damped")


def example_blocks() -> list[str]:
    section = ARCHITECTURE.read_text().split("## Adding a method", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture
def damped(tmp_path, monkeypatch):
    """The example's method, registered from modules of a temporary folder; forgotten after."""
    leaf, method, test = example_blocks()
    method = method.replace("fedpeft.config.methods.damped", MODULES[0])
    for name, text in zip(MODULES, (leaf, method, test), strict=True):
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = importlib.import_module(MODULES[0]).DampedConfig.model_fields["name"].default
    try:
        importlib.import_module(MODULES[1])
        yield name
    finally:
        unregister_method(name)
        for module in MODULES:
            sys.modules.pop(module, None)


def test_the_guide_has_a_leaf_a_method_and_a_test():
    leaf, method, test = example_blocks()
    assert "@register_method_config(" in leaf and "@register_method(" in method and "def test_" in test


def test_a_method_added_from_scratch_conforms(damped, tiny_config):
    assert list(REGISTRY)[-1] == damped and list(config_registry.method_configs())[-1] == damped
    assert_conforms(damped, tiny_config)
    own_test = importlib.import_module(MODULES[2])
    for test in [f for n, f in vars(own_test).items() if n.startswith("test_")]:
        test(tiny_config)


def test_a_forgotten_method_is_unknown_again(damped):
    unregister_method(damped)
    assert damped not in REGISTRY and damped not in config_registry.method_configs()
    with pytest.raises(Exception, match=damped):
        config_registry.validate_method_config({"name": damped})

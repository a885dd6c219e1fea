"""The distribution installs both packages and the console script."""

import ast
import subprocess
import sys

import pytest


def test_packages_import():
    import engine
    import lmsp_min

    assert lmsp_min.__version__
    assert engine.__doc__


def test_cli_help():
    out = subprocess.run(
        [sys.executable, "-m", "lmsp_min.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    assert "lmsp-min" in out.stdout


def _imported_after(statement: str) -> list[str]:
    """The numpy and engine modules a fresh interpreter holds after `statement`."""
    code = f"import sys; {statement}; print(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('engine')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout)


# The engine's modules the protocol package may import: they read and describe a model's
# GGUF header with the standard library (engine/gguf_header.py, engine/describe.py).
HEADER_MODULES = ["engine", "engine.describe", "engine.gguf_header"]


def test_the_protocol_package_does_not_import_numpy():
    # lmsp_min knows nothing of numpy: the client, the CLI's parsing and the server's
    # modules import without it; only loading a model brings in the rest of the engine.
    modules = _imported_after("import lmsp_min.app, lmsp_min.cli, lmsp_min.client, lmsp_min.registry, "
                              "lmsp_min.service, lmsp_min.tasks")
    assert modules == HEADER_MODULES


def test_the_header_modules_and_the_engine_package_import_without_numpy():
    assert _imported_after("import engine") == ["engine"]
    assert _imported_after("import engine.gguf_header, engine.describe") == HEADER_MODULES


def test_the_engine_s_public_names_are_there_on_first_use():
    import engine

    out = subprocess.run([sys.executable, "-c", "from engine import *; import engine; "
                          "print(all(globals()[name] is getattr(engine, name) for name in engine.__all__))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    assert engine.load_model.__module__ == "engine.model"
    assert set(engine.__all__) <= set(dir(engine))
    with pytest.raises(AttributeError, match="no_such_name"):
        engine.no_such_name

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


# The engine's modules the protocol package may import, standard library only: they read
# and describe a model's GGUF header (engine/gguf_header.py, engine/describe.py) and hold
# what the server and the engine exchange (engine/api.py, engine/errors.py), with the
# engine's table of constants that api.py's embedding_groups reads (engine/tuning.py).
PLAIN_MODULES = ["engine", "engine.api", "engine.describe", "engine.errors", "engine.gguf_header",
                 "engine.tuning"]


def test_the_protocol_package_does_not_import_numpy():
    # lmsp_min knows nothing of numpy: the client, the CLI's parsing and the server's
    # modules, every one of them, import without it; only loading a model brings in the
    # rest of the engine.
    modules = _imported_after("import importlib, pkgutil, lmsp_min; "
                              "[importlib.import_module(m.name) "
                              "for m in pkgutil.walk_packages(lmsp_min.__path__, 'lmsp_min.')]")
    assert modules == PLAIN_MODULES


def test_the_engine_package_and_its_plain_modules_import_without_numpy():
    assert _imported_after("import engine") == ["engine"]
    assert _imported_after("import engine.api, engine.errors, engine.gguf_header, engine.describe") == PLAIN_MODULES


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

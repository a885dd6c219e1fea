"""The `lmsp-min` command line: help, pull, models, run, bench."""

import io
import os
import pty
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from server_harness import tiny_path  # noqa: F401
from tiny import write_tiny_model
from lmsp_min import cli, fetch


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSP_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


@pytest.mark.parametrize("command", [[], ["pull"], ["models"], ["run"], ["serve"]])
def test_help_everywhere(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--help"])
    assert e.value.code == 0
    assert "usage: lmsp-min" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "pull" in capsys.readouterr().out


def test_pull_a_local_file_then_list_it(store, tmp_path, capsys):
    source = write_tiny_model(tmp_path / "tiny-llama.gguf", "llama")
    assert cli.main(["pull", str(source)]) == 0
    assert capsys.readouterr().out.strip() == str(store / "tiny-llama.gguf")
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "SIZE", "PARAMETERS", "ARCHITECTURE", "QUANTIZATION", "CONTEXT", "FILE"]
    assert lines[1].split()[0] == "tiny:llama" and "llama" in lines[1].split()
    assert cli.resolve_model("tiny:llama") == store / "tiny-llama.gguf"
    assert cli.resolve_model("tiny-llama.gguf") == store / "tiny-llama.gguf"


def test_models_on_an_empty_store(store, capsys):
    assert cli.main(["models"]) == 0
    assert f"lmsp-min pull {fetch.DEFAULT_MODEL}" in capsys.readouterr().out


def test_a_file_name_that_is_not_utf8_is_listed(store, monkeypatch):
    """As the bytes it is, on a strict UTF-8 stdout (a UTF-8 locale's): it was a UnicodeEncodeError."""
    store.mkdir(parents=True)
    (store / os.fsdecode(b"caf\xe9.gguf")).write_bytes(b"not a model")
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="utf-8"))
    assert cli.main(["models"]) == 0
    sys.stdout.flush()
    assert b"caf\xe9.gguf" in out.getvalue()


def test_offline_pull_is_one_clear_line(store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"LMSP_HOME": str(store.parent), "LMSP_PYPI_URL": f"http://127.0.0.1:{port}/simple"}
    out = subprocess.run(
        [sys.executable, "-m", "lmsp_min.cli", "pull", fetch.DEFAULT_MODEL],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert out.returncode == 1
    assert "--model PATH" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name", ["nope:1b", "~no-such-user-lmsp/m.gguf", "x" * 300 + ".gguf"],
                         ids=["unknown", "no-user", "too-long"])
def test_unknown_model_for_run(store, capsys, name):
    """One line, also for a path Path.is_file raises on (a name too long) or a `~user` of no user."""
    assert cli.main(["run", name, "hi"]) == 1
    assert f"no model {name!r}" in capsys.readouterr().err


def test_bench_runs_the_checkout_script_with_its_arguments(tmp_path, monkeypatch, capfd):
    script = tmp_path / "run.py"
    script.write_text("import sys; print('bench args', sys.argv[1:])")
    monkeypatch.setattr(cli, "benchmarks_script", lambda: script)
    assert cli.main(["bench", "--quick", "--help"]) == 0
    assert "bench args ['--quick', '--help']" in capfd.readouterr().out


def test_bench_without_a_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "benchmarks_script", lambda: None)
    assert cli.main(["bench"]) == 1
    assert "source checkout" in capsys.readouterr().err
    assert cli.main(["bench", "--help"]) == 0
    assert "usage: lmsp-min bench" in capsys.readouterr().out


def test_bench_finds_the_checkout_it_runs_from():
    assert cli.benchmarks_script() == Path(cli.__file__).resolve().parent.parent / "benchmarks" / "run.py"


def test_serve_refuses_a_models_dir_that_is_not_one(store, tmp_path, monkeypatch, capsys):
    """A typo was an empty directory: no model, so the default one was fetched and served."""
    monkeypatch.setenv("LMSP_PYPI_URL", "http://127.0.0.1:9/simple")  # (nothing fetched, whatever happens)
    (tmp_path / "file").write_text("x")
    for models_dir in (tmp_path / "no-such-dir", tmp_path / "file"):
        assert cli.main(["serve", "--models-dir", str(models_dir)]) == 1
        assert capsys.readouterr().err == f"lmsp-min serve: --models-dir {models_dir}: not a directory\n"


def test_unknown_arguments_are_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["models", "--bad"])
    assert e.value.code == 2


@pytest.mark.parametrize("args", [
    ["serve", "--event-retention", "-5"], ["serve", "--event-retention", "nan"], ["serve", "--max-body-bytes", "0"],
    ["serve", "--max-body-bytes", "1023"], ["serve", "--store-timeout", "0"], ["serve", "--store-timeout", "nan"],
    ["serve", "--port", "70000"], ["run", "m", "--max-tokens", "0"], ["run", "m", "--temperature", "nan"],
    ["run", "m", "--top-p", "0"], ["run", "m", "--min-p", "5"], ["run", "m", "--seed", "-1"], ["run", "m", "--ctx", "-5"],
])
def test_out_of_range_options_are_usage_errors(args, capsys):
    """Refused before any model loads, in one line (they gave tracebacks from the engine)."""
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2 and "must be " in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["serve", "--cors-origin", "localhost:3000"], "is not an origin"),
    (["serve", "--cors-origin", "http://localhost:3000/app"], "is not an origin"),
    (["serve", "--allow-host", "*"], "is not a host name"),
    (["serve", "--allow-host", "host.docker.internal:8080"], "is not a host name"),
])
def test_a_bad_origin_or_allowed_host_is_a_usage_error_saying_what_it_must_be(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_serve_passes_the_store_timeout_on(monkeypatch, tiny_path):
    from lmsp_min import service

    configs = []
    monkeypatch.setattr(service, "run", lambda config, host, port: configs.append(config))
    assert cli.main(["serve", "--model", str(tiny_path), "--store-timeout", "1.5"]) == 0
    assert cli.main(["serve", "--model", str(tiny_path)]) == 0
    assert [config.store_timeout for config in configs] == [1.5, 5.0]


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    from tiny import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat-q8_0.gguf")


@pytest.fixture(scope="module")
def tiny_chat_model(tiny_chat):
    from engine import load_model

    with load_model(tiny_chat) as model:
        yield model


@pytest.fixture
def load_once(tiny_chat, tiny_chat_model, monkeypatch):
    """`run` gets the tiny model loaded once for this module (loading takes seconds)."""
    import engine

    def load_model(path, n_ctx=None):
        assert path == tiny_chat
        return tiny_chat_model

    monkeypatch.setattr(engine, "load_model", load_model)
    monkeypatch.setattr(tiny_chat_model, "close", lambda: None)  # (`run` closes it; the module does, at its end)


def test_run_answers_a_prompt(tiny_chat, load_once, capsys):
    assert cli.main(["run", str(tiny_chat), "Hello!", "--temperature", "0", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and "[stopped at the token limit]" in out


def test_run_without_prompt_chats_and_keeps_the_conversation(tiny_chat, load_once, monkeypatch):
    from engine.model import Model

    seen = []
    prepare_chat = Model.prepare_chat

    def spy(self, request):
        seen.append([(m["role"], m["content"]) for m in request.messages])
        return prepare_chat(self, request)

    monkeypatch.setattr(Model, "prepare_chat", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("First\nSecond\n/clear\n\nThird\n/bye\nnever read\n"))
    args = ["run", str(tiny_chat), "--system", "Be brief.", "--temperature", "0", "--max-tokens", "3"]
    assert cli.main(args) == 0
    assert [[role for role, _ in messages] for messages in seen] == [
        ["system", "user"],
        ["system", "user", "assistant", "user"],
        ["system", "user"],  # after /clear only the system message is left
    ]
    assert seen[1][1] == ("user", "First") and seen[1][3] == ("user", "Second")
    assert seen[2][1] == ("user", "Third")


@pytest.mark.slow
def test_run_the_default_model(smollm2_path, capsys):
    prompt = "What is the capital of France? Answer in one word."
    assert cli.main(["run", str(smollm2_path), prompt, "--temperature", "0", "--max-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_ctrl_d_at_the_prompt_ends_the_line(tiny_chat, load_once, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", Terminal(""))  # Ctrl-D at the first prompt
    assert cli.main(["run", str(tiny_chat)]) == 0
    assert capsys.readouterr().out.endswith(">>> \n")


def test_ctrl_c_at_the_prompt_ends_the_line(tiny_chat, load_once, monkeypatch, capsys):
    """As Ctrl-D does; the shell's prompt followed ">>> " on the same line."""
    class CtrlC(Terminal):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", CtrlC())
    assert cli.main(["run", str(tiny_chat)]) == 130  # (128 + SIGINT, as a shell reports a command Ctrl-C stopped)
    assert capsys.readouterr().out.endswith(">>> \n")


def _read_terminal(fd: int, until: bytes, timeout: float = 60) -> bytes:
    """What a program writes to its terminal, up to `until` or its end (EIO: it closed the terminal)."""
    seen = b""
    while not seen.endswith(until) and select.select([fd], [], [], timeout)[0]:
        try:
            chunk = os.read(fd, 1024)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    return seen


def test_the_chat_edits_its_lines_on_a_terminal(tiny_chat):
    """An arrow key moves in the line (it was sent to the model as "\\x1b[D")."""
    controller, terminal = pty.openpty()
    command = [sys.executable, "-m", "lmsp_min.cli", "run", str(tiny_chat), "--max-tokens", "1"]
    with subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal,
                          cwd=Path(cli.__file__).resolve().parent.parent, env={**os.environ, "LMSP_HELPER": "0"}) as chat:
        os.close(terminal)
        try:
            assert _read_terminal(controller, b">>> ").endswith(b">>> ")
            os.write(controller, b"/be\x1b[Dy\r")  # "/be", left arrow, "y": "/bye"
            after = _read_terminal(controller, b">>> ")  # a prompt again only if it answered "/be\x1b[Dy"
        finally:
            if chat.poll() is None:
                os.write(controller, b"\x04")  # Ctrl-D
            os.close(controller)
    assert b">>> " not in after and chat.returncode == 0


def test_chat_goes_on_when_the_conversation_outgrows_the_window(tiny_chat, load_once, monkeypatch, capsys):
    long_line = "word " * 600  # more tokens than the tiny model's 512-token window
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{long_line}\nHi\n"))
    assert cli.main(["run", str(tiny_chat), "--temperature", "0", "--max-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert "the context window is 512 tokens" in captured.err
    assert "/clear" not in captured.err  # the conversation was empty: forgetting it would not help
    assert captured.out.strip()  # the second line was still answered


def test_chat_says_clear_helps_when_there_is_a_conversation_to_forget(tiny_chat, load_once, monkeypatch, capsys):
    long_line = "word " * 400  # fits alone, not after an earlier exchange
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{long_line}\n{long_line}\n"))
    assert cli.main(["run", str(tiny_chat), "--temperature", "0", "--max-tokens", "60"]) == 0
    assert "/clear starts a new conversation" in capsys.readouterr().err


@pytest.mark.parametrize("shell", [
    "{run} 'Once upon a time' --max-tokens 300 | head -c 1",       # the reader leaves early
    "printf 'caf\\351\\n' | PYTHONIOENCODING=utf-8 {run} --max-tokens 2",  # latin-1 bytes on a strict stdin
])
def test_run_in_a_pipe_ends_without_a_traceback(tiny_chat, shell):
    run = f"{sys.executable} -m lmsp_min.cli run {tiny_chat}"
    done = subprocess.run(shell.format(run=run), shell=True, capture_output=True, text=True, timeout=120,
                          cwd=Path(cli.__file__).resolve().parent.parent, env={**os.environ, "LMSP_HELPER": "0"})
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full, a device every write to fails")
@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("command", ["models", "run {model} Hi --max-tokens 2"], ids=["models", "run"])
def test_an_output_that_cannot_be_written_is_one_line(tiny_chat, store, command, unbuffered):
    """As on a full disk: it was a traceback (unbuffered), or "Exception ignored" and status 120 at exit."""
    run = f"{sys.executable} -m lmsp_min.cli {command.format(model=tiny_chat)} > /dev/full"
    env = {**os.environ, "LMSP_HOME": str(store.parent), "LMSP_HELPER": "0", "PYTHONUNBUFFERED": unbuffered}
    done = subprocess.run(run, shell=True, capture_output=True, text=True, timeout=120,
                          cwd=Path(cli.__file__).resolve().parent.parent, env=env)
    name = command.split()[0]
    assert (done.returncode, done.stderr) == (1, f"lmsp-min {name}: cannot write the output: No space left on device\n")


@pytest.mark.parametrize("command, error", [
    ("models >&-", "lmsp-min models: cannot write the output: stdout is closed"),
    ("pull {model} >&-", "lmsp-min pull: cannot write the output: stdout is closed"),
    ("run {model} Hi >&-", "lmsp-min run: cannot write the output: stdout is closed"),
    ("run {model} <&-", "lmsp-min run: no PROMPT, and stdin is closed: there is no chat to read"),
], ids=["models", "pull", "run", "chat"])
def test_a_closed_stdout_or_stdin_is_one_line(tiny_chat, store, command, error):
    """Python sets sys.stdout (sys.stdin) to None: `run` ended in an AttributeError traceback, and
    `models` and `pull` printed nothing and said it went well."""
    run = f"{sys.executable} -m lmsp_min.cli {command.format(model=tiny_chat)}"
    done = subprocess.run(run, shell=True, capture_output=True, text=True, timeout=120,
                          cwd=Path(cli.__file__).resolve().parent.parent,
                          env={**os.environ, "LMSP_HOME": str(store.parent), "LMSP_HELPER": "0"})
    assert (done.returncode, done.stderr) == (1, error + "\n")
    assert not store.exists()  # refused before pull stored anything


def test_max_tokens_past_the_window_is_what_the_window_has_left(tiny_chat, load_once, monkeypatch, capsys):
    """--max-tokens reads "at most": past the window, every turn was refused (context_length_exceeded)."""
    from engine.model import Model

    asked = []
    generate = Model.generate

    def spy(self, prompt_ids, *, max_tokens, **options):
        asked.append(len(prompt_ids) + max_tokens)
        return generate(self, prompt_ids, max_tokens=max_tokens, **options)

    monkeypatch.setattr(Model, "generate", spy)
    assert cli.main(["run", str(tiny_chat), "word " * 400, "--temperature", "0", "--max-tokens", "1000"]) == 0
    assert asked == [512]  # the prompt and the answer fill the tiny model's window, no more
    assert capsys.readouterr().out.strip()

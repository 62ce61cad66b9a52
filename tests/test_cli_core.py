"""The CLI core: help, --version, one-line user errors, tracebacks only for bugs, Ctrl-C, broken pipes, progress."""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import normatlas
from normatlas import cli
from normatlas.cli import main

SRC = str(Path(normatlas.__file__).resolve().parents[1])  # the package under test, for subprocesses
ROOT = str(Path(__file__).resolve().parents[1])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, ROOT]), HF_HUB_OFFLINE="1", **extra)
    env.pop("COLUMNS", None)
    return env


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Callable[[BaseException], None]:
    """Register a subcommand ``_fake`` that raises the given exception."""
    cli.build_parser()  # registers the real commands first

    def install(exc: BaseException) -> None:
        def boom(args: argparse.Namespace) -> int:
            raise exc

        monkeypatch.setitem(cli.COMMANDS, "_fake", cli.Command("_fake", "raises", lambda p: None, boom))

    return install


def test_bare_normatlas_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: normatlas") and "inspect" in out and "matrix" in out and "--version" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"normatlas {normatlas.__version__}"


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (PermissionError(errno.EACCES, "Permission denied", "/out/model.safetensors"), "Permission denied: /out/"),
        (OSError(errno.ENOSPC, "No space left on device", "/out/x"), "No space left on device: /out/x"),
        (OSError(errno.EROFS, "Read-only file system", "/ro/x"), "Read-only file system: /ro/x"),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp"), "Is a directory: /tmp"),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/etc/passwd/x"), "Not a directory: /etc/passwd/x"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "cfg.json"), "No such file or directory"),
        (json.JSONDecodeError("Expecting value", "{not json", 1), "not valid JSON (Expecting value"),
        (ValueError("eps=-1 must be > 0\n(second line)"), "eps=-1 must be > 0 (second line)"),
        (TypeError("model must be an nn.Module"), "model must be an nn.Module"),
        (cli.CliError("give a TARGET"), "give a TARGET"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None,
)
def test_user_errors_are_one_line_exit_2(
    exc: BaseException, message: str, fake: Callable[[BaseException], None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake(exc)
    code, out, err = run(capsys, "_fake")
    assert code == 2 and out == ""
    assert err.startswith("normatlas _fake: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "exc", [RuntimeError("a bug"), KeyError("k"), AttributeError("x"), OSError(errno.EIO, "I/O error")]
)
def test_a_library_bug_still_shows_its_traceback(exc: BaseException, fake: Callable[[BaseException], None]) -> None:
    fake(exc)
    with pytest.raises(type(exc)):
        main(["_fake"])


def test_traceback_on_request(
    fake: Callable[[BaseException], None], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake(ValueError("bad"))
    monkeypatch.setenv("NORMATLAS_TRACEBACK", "1")
    with pytest.raises(ValueError, match="bad"):
        main(["_fake"])


def test_ctrl_c_in_process_is_exit_130_one_line(
    fake: Callable[[BaseException], None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake(KeyboardInterrupt())
    try:
        code, _, err = run(capsys, "_fake")
    except KeyboardInterrupt:  # it would also stop pytest itself
        pytest.fail("KeyboardInterrupt escaped main()")
    assert code == 130 and err.strip() == "normatlas _fake: interrupted"


def _start(code: str, tmp_path: Path, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(**env),
        cwd=tmp_path,
        start_new_session=True,  # its own process group: Ctrl-C on a terminal signals the whole group
    )


def _wait_for(proc: subprocess.Popen[bytes], marker: bytes, limit: float = 120.0) -> bytes:
    """Read stderr until ``marker`` (the child is then inside main()); returns what was read."""
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + limit
    while marker not in seen:
        chunk = os.read(proc.stderr.fileno(), 4096)
        assert chunk and time.monotonic() < deadline, seen
        seen += chunk
    return seen


_DRIVER = """
import sys
import torch
import normatlas.inspect as inspect_package
from normatlas.cli import main

real = inspect_package.inspect_target

def forever(*args, **kwargs):  # the command's own work (build and trace), again and again: a signal sent after
    sys.stderr.write("inside the command\\n")  # this line (one write: the signal cannot split it) always finds
    sys.stderr.flush()  # the command running
    while True:
        real(*args, **kwargs)

inspect_package.inspect_target = forever
print("ready", file=sys.stderr, flush=True)
sys.exit(main(sys.argv[2:] or ["inspect", "llama"]))
"""


def _left_running(marker: bytes, limit: float = 60.0) -> list[str]:
    """The processes whose command line holds ``marker``, polled until there are none (``limit`` bounds a hang)."""
    deadline = time.monotonic() + limit
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                    left.append(pid)
            except OSError:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_ctrl_c_exits_130_without_traceback(tmp_path: Path) -> None:
    proc = _start(_DRIVER, tmp_path)
    seen = _wait_for(proc, b"inside the command\n")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the process and its workers
    _, err = proc.communicate(timeout=60)
    err = (seen + err).decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == "normatlas inspect: interrupted"


def test_ctrl_c_during_the_sweep_leaves_nothing_behind(tmp_path: Path) -> None:
    """The forked workers are stopped, no worker prints a traceback, and no output file is half written."""
    out_dir = tmp_path / "sweep-out"
    code = _DRIVER.replace('sys.argv[2:] or ["inspect", "llama"]', '["inspect", "--all-transformers", '
                           '"--only", "gpt2,llama,qwen3,gemma2", "--out", sys.argv[1] + "/sweep-out"]')  # fmt: skip
    proc = _start(code, tmp_path, NORMATLAS_PROGRESS="1")
    seen = _wait_for(proc, b"inside the command\n")  # inside the sweep: a forked worker is building an architecture
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the process and its workers
    _, err = proc.communicate(timeout=60)
    err = (seen + err).decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert not out_dir.exists() or not any(out_dir.iterdir())
    left = _left_running(str(tmp_path).encode())
    assert not left, f"worker processes left running: {left}"


def test_closed_stdout_exits_quietly(tmp_path: Path) -> None:
    """``normatlas matrix --all-fields | head -1``: the reader goes away; no traceback, the SIGPIPE status."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "normatlas", "matrix", "--all-fields"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=tmp_path,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child has printed anything (it is still importing torch)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert err == "" and proc.returncode == 141, err


def test_progress_is_silent_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from normatlas.cli import _progress

    monkeypatch.delenv("NORMATLAS_PROGRESS", raising=False)
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    code, out, err = run(capsys, "inspect", "tests.test_inspect_cli:toy")
    assert code == 0 and out and err == ""


def test_progress_phases_show_and_clear_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from normatlas.cli import _progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NORMATLAS_PROGRESS", raising=False)
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    monkeypatch.setattr(_progress.time, "monotonic", lambda: 100.0)  # a clock that stands still: 0 s elapsed
    stream = Tty()
    with _progress.phase("loading checkpoint", stream=stream) as ph:
        _progress._status.redraw()  # what the ticker does every 0.25 s
        ph.update("model.safetensors")
    text = stream.getvalue()
    assert "\rloading checkpoint ... 0 s" in text and "loading checkpoint: model.safetensors" in text
    assert text.endswith("\r\x1b[K")  # erased: the result is what stays on the screen
    quiet = io.StringIO()  # not a terminal
    with _progress.phase("loading", stream=quiet):
        _progress._status.redraw()  # the ticker's turn: still nothing on a stream that is not a terminal
    assert quiet.getvalue() == ""
    monkeypatch.setenv("NORMATLAS_PROGRESS", "1")
    assert _progress.enabled(quiet)
    monkeypatch.setenv("NORMATLAS_PROGRESS", "0")
    assert not _progress.enabled(stream)
    assert list(_progress.steps([1, 2, 3], "items")) == [1, 2, 3]


def test_forced_progress_on_a_log_writes_whole_lines_at_most_every_line_every(monkeypatch: pytest.MonkeyPatch) -> None:
    """NORMATLAS_PROGRESS=1 with stderr in a file (a long background run): plain lines, no carriage returns or
    escapes, one when the text changed and LINE_EVERY seconds have passed, nothing to erase at the end."""
    from normatlas.cli import _progress

    monkeypatch.setenv("NORMATLAS_PROGRESS", "1")
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    now = [100.0]  # a clock the test moves (the ticker thread reads it too, so what it writes is the same)
    monkeypatch.setattr(_progress.time, "monotonic", lambda: now[0])
    log = io.StringIO()
    with _progress.phase("experiment 1/3: depth", stream=log) as ph:
        ph.update("seed 0: Pre-LN: step 1/2000")
        now[0] += 10
        ph.update("seed 0: Pre-LN: step 21/2000")  # replaced before LINE_EVERY passed: never written
        now[0] += 10
        ph.update("seed 0: Pre-LN: step 41/2000")
        now[0] += 11
        _progress._status.redraw()  # what the ticker does every 0.25 s
        _progress._status.redraw()  # the same text again: no second line
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()
    assert lines[0].startswith("experiment 1/3: depth: seed 0: Pre-LN: step 1/2000 ... ")
    assert not any("step 21/2000" in line for line in lines)
    assert lines[-1].startswith("experiment 1/3: depth: seed 0: Pre-LN: step 41/2000 ... ")
    assert len(lines) == 2


def test_ctrl_c_while_the_console_script_starts_is_one_line(tmp_path: Path) -> None:
    """The installed ``normatlas`` script imports ``normatlas.cli`` before main() runs; the package's top level is
    lazy, so the first heavy import (torch) happens inside main()'s handler. Ctrl-C there: exit 130, one line."""
    import shutil

    script = shutil.which("normatlas", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the console script is not installed beside this interpreter")
    code = "import sys, normatlas; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=_env()).stdout.strip() == "False"  # fmt: skip
    # each import prints its line on stderr as it completes: Ctrl-C once torch's first submodule is in (no fixed
    # sleep: the command starts in well under a second now, so a timed Ctrl-C could land anywhere)
    env = dict(_env(), PYTHONPROFILEIMPORTTIME="1")
    proc = subprocess.Popen([script, "inspect", "llama"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=tmp_path, start_new_session=True)  # fmt: skip
    assert proc.stderr is not None
    seen: list[str] = []  # stderr before the Ctrl-C, less the import lines
    for line in iter(proc.stderr.readline, b""):
        if re.search(r"\|\s+torch\.", line.decode()):
            break
        if not line.startswith(b"import time:"):
            seen.append(line.decode())
    else:
        pytest.fail(f"the command ended before it imported torch: {''.join(seen)}")
    os.killpg(proc.pid, signal.SIGINT)  # inside main(), importing torch
    _, err = proc.communicate(timeout=60)
    text = "".join([*seen, *(x for x in err.decode().splitlines(True) if not x.startswith("import time:"))])
    assert proc.returncode == 130, text
    assert "Traceback" not in text, text


def test_make_demo_echoes_no_line_over_120_columns() -> None:
    """make prints each recipe line it runs (unless it starts with @): those lines are part of `make demo`'s output
    too, and the MiniLM path expansion made two of them 173-190 columns wide."""
    text = (Path(ROOT) / "Makefile").read_text()
    recipe = text[text.index("\ndemo:") :].split("\n\n")[0].splitlines()[1:]
    variables = dict(re.findall(r"^(\w+) [:?]?= ?(.*)$", text, re.M))  # what make substitutes into an echo
    expand = lambda line: re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), line)
    echoed = [expand(expand(line.strip())).replace("$$", "$") for line in recipe
              if line.startswith("\t") and not line.strip().startswith("@")]  # fmt: skip
    assert echoed, "the demo target runs commands"
    assert all(len(line) <= 120 for line in echoed), [line for line in echoed if len(line) > 120]


def test_third_party_progress_bars_are_off_in_the_cli(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """transformers' "Loading weights" tqdm bar printed a 146-column line into `make demo`'s log; the commands show
    their own phases instead (a user who wants the bars sets HF_HUB_DISABLE_PROGRESS_BARS=0)."""
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    assert cli.main([]) == 0  # bare: the help
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    assert cli.main([]) == 0  # bare: the help
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


def test_ctrl_c_inside_the_fork_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT that lands while the sweep forks (inside after-fork hooks, which swallow exceptions, as logging's
    and threading's do) still stops the sweep: ``run_isolated`` raises KeyboardInterrupt once the fork returns."""
    import multiprocessing.context

    from normatlas.inspect.sweep import run_isolated

    real_start = multiprocessing.context.ForkProcess.start

    def start_with_ctrl_c(self: multiprocessing.context.ForkProcess) -> None:
        real_start(self)
        try:  # what an after-fork hook does with an exception raised inside it: "Exception ignored"
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here
        except KeyboardInterrupt:
            pass

    monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", start_with_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run_isolated(lambda mt: {"model": mt}, "toy", timeout=30)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back

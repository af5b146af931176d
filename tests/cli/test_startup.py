"""A Ctrl-C while the ``lowprec`` command imports torch ends it with one line, never a
traceback; one during the interpreter's shutdown after the command ends it quietly;
importing lowprec as a library, or calling ``main`` from a program, changes no signal
handler."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_sigint_after_the_package_import_of_a_cli_process_is_one_line() -> None:
    # sys.argv[0] == "lowprec": the console script; cli.main() has not run yet
    r = _run(
        "import sys; sys.argv = ['lowprec']\n"
        "import os, signal, time, lowprec\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)\n"
    )
    assert r.returncode == 130, r.stderr
    assert r.stderr == "lowprec: interrupted while starting; nothing was written\n"


def test_library_import_keeps_python_s_handler_and_main_restores_it() -> None:
    r = _run(
        "import signal, lowprec\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
        "from lowprec.cli import main\n"
        "assert main(['recipes']) == 0\n"  # a program's call: Python's handler stays
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
        "import sys; sys.argv = ['lowprec']\n"
        "import lowprec._startup as s; s.guard_startup()\n"
        "assert signal.getsignal(signal.SIGINT) is s._quit\n"
        "assert main(['recipes']) == 0\n"  # the command: its shutdown is guarded
        "assert signal.getsignal(signal.SIGINT) is s._exit_quietly\n"
    )
    assert r.returncode == 0, r.stderr


def test_sigint_during_the_shutdown_after_the_command_is_quiet() -> None:
    """The second Ctrl-C of a double Ctrl-C can land after ``main`` has returned, while
    Python runs its ``atexit`` callbacks: seen in CI as "Exception ignored in atexit
    callback ... KeyboardInterrupt" after an interrupted run's own message. Delivered
    inside an ``atexit`` callback here, it must end the process with 130 and no
    traceback, the command's output intact."""
    r = _run(
        "import sys; sys.argv = ['lowprec', 'recipes']\n"
        "import atexit, os, signal, lowprec\n"
        "def late():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    for _ in range(10**7): pass\n"  # Python code for the handler to run in
        "atexit.register(late)\n"
        "from lowprec.cli import main\n"
        "sys.exit(main())\n"
    )
    assert r.returncode == 130, r.stderr
    assert r.stderr == "", r.stderr
    assert "fp8-tensorwise" in r.stdout  # printed and flushed before the quiet exit


def test_sigint_in_the_last_teardown_keeps_the_command_status() -> None:
    """After the atexit callbacks that came with the command, SIGINT is ignored: Python's
    finalisation resets a Python handler to the default action, and a late second Ctrl-C
    there killed an aborted run by the signal (CI: status -2 instead of 130). An atexit
    callback registered before lowprec's start-up runs after lowprec's own; a SIGINT sent
    there must leave the command's status (0) and print nothing."""
    r = _run(
        "import atexit, os, signal, sys\n"
        "def last():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    for _ in range(10**6): pass\n"  # Python code for a handler to run in
        "    print('handler', signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
        "atexit.register(last)\n"
        "sys.argv = ['lowprec', 'recipes']\n"
        "import lowprec\n"
        "from lowprec.cli import main\n"
        "sys.exit(main())\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    assert "fp8-tensorwise" in r.stdout and "handler True" in r.stdout


def test_sigint_while_torch_is_being_imported_is_one_line() -> None:
    """The real command, interrupted while it loads torch's libraries (seen in
    /proc/PID/maps): the start-up guard is in place, so one line and 130.

    (A SIGINT before the package's first line, inside Python's own ``site`` start-up,
    is Python's to report; it is not tested here.)"""
    p = subprocess.Popen(
        [sys.executable, "-m", "lowprec", "recipes"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    maps = Path(f"/proc/{p.pid}/maps")
    if not maps.exists():
        p.kill()
        pytest.skip("no /proc: cannot see when torch loads")
    deadline = time.monotonic() + 240
    while "libtorch" not in maps.read_text():
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    assert err == "lowprec: interrupted while starting; nothing was written\n"


def test_a_cleanup_error_while_an_abort_unwinds_is_still_an_abort() -> None:
    """A second Ctrl-C raises KeyboardInterrupt inside a forward; a TorchFunctionMode whose
    exit then fails ("trying to pop from empty mode stack") must not turn the abort into
    an error exit: the failure's context holds the KeyboardInterrupt."""
    from lowprec.cli.main import _during_abort

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("trying to pop from empty mode stack") from None
    except RuntimeError as e:
        assert _during_abort(e)
    assert not _during_abort(RuntimeError("plain"))


def test_a_ctrl_c_between_the_command_and_the_shutdown_guard_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second of a double Ctrl-C can land after the command's own handlers returned its
    exit code and before the shutdown guard is installed (seen in CI: a traceback at the
    guard's first line). In a command process it ends the command with 130 quietly and the
    guard is still installed; a SystemExit keeps unwinding with the guard installed; in a
    library call the KeyboardInterrupt propagates."""
    import importlib

    import lowprec._startup as s

    cli_main = importlib.import_module("lowprec.cli.main")  # the module (lowprec.cli.main
    # is also the function's name in lowprec.cli)

    installed: list[bool] = []
    pending = [1]  # KeyboardInterrupts to raise at the guard's entry

    def guard() -> None:
        if pending and pending.pop():
            raise KeyboardInterrupt
        installed.append(True)

    monkeypatch.setattr(s, "guard_shutdown", guard)
    monkeypatch.setattr(s, "_is_cli", lambda: True)
    monkeypatch.setattr(cli_main, "_main", lambda argv: 0)
    assert cli_main.main([]) == 0 and installed == [True]  # the command's own status

    def late(argv: object) -> int:
        raise KeyboardInterrupt  # after the command's handlers

    installed.clear()
    pending[:] = [1]
    monkeypatch.setattr(cli_main, "_main", late)
    assert cli_main.main([]) == 130 and installed == [True]

    def usage(argv: object) -> int:
        raise SystemExit(2)

    installed.clear()
    monkeypatch.setattr(cli_main, "_main", usage)
    with pytest.raises(SystemExit):
        cli_main.main([])
    assert installed == [True]

    monkeypatch.setattr(s, "_is_cli", lambda: False)
    monkeypatch.setattr(cli_main, "_main", late)
    with pytest.raises(KeyboardInterrupt):
        cli_main.main([])


def test_sigterm_after_the_package_import_of_a_cli_process_is_one_line() -> None:
    """SIGTERM while the command starts is SIGINT's case: one line, 128 + 15 (it died
    silently by the signal)."""
    r = _run(
        "import sys; sys.argv = ['lowprec']\n"
        "import os, signal, time, lowprec\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n"
    )
    assert r.returncode == 143, r.stderr
    assert r.stderr == "lowprec: interrupted while starting; nothing was written\n"


def test_sigterm_during_the_shutdown_after_the_command_is_quiet() -> None:
    """A SIGTERM that lands in the shutdown after the command is SIGINT's case there: no
    output, the command's own output flushed, 128 + 15."""
    r = _run(
        "import sys; sys.argv = ['lowprec', 'recipes']\n"
        "import atexit, os, signal, lowprec\n"
        "def late():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    for _ in range(10**7): pass\n"
        "atexit.register(late)\n"
        "from lowprec.cli import main\n"
        "sys.exit(main())\n"
    )
    assert r.returncode == 143, r.stderr
    assert r.stderr == "", r.stderr
    assert "fp8-tensorwise" in r.stdout


def test_sigterm_in_the_last_teardown_keeps_the_command_status() -> None:
    """After lowprec's atexit callbacks a SIGTERM is ignored, as SIGINT is: the finished
    command's status (0) stands."""
    r = _run(
        "import atexit, os, signal, sys\n"
        "def last():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    for _ in range(10**6): pass\n"
        "    print('handler', signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)\n"
        "atexit.register(last)\n"
        "sys.argv = ['lowprec', 'recipes']\n"
        "import lowprec\n"
        "from lowprec.cli import main\n"
        "sys.exit(main())\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    assert "fp8-tensorwise" in r.stdout and "handler True" in r.stdout


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_inside_a_command_without_run_directories_says_interrupted(
    sig: signal.Signals, code: int
) -> None:
    """A Ctrl-C (or SIGTERM) inside ``lowprec recipes`` (no run directory, no checkpoint)
    is one true line, ``interrupted (SIGINT)``, not train's "aborted; run directories
    keep their last checkpoint"; SIGTERM there died silently by the signal."""
    r = _run(
        "import sys; sys.argv = ['lowprec', 'recipes']\n"
        "import os, signal, time, lowprec\n"
        "import lowprec.cli.jobs as j\n"
        "def hit(args):\n"
        f"    os.kill(os.getpid(), {int(sig)}); time.sleep(30); return 0\n"
        "j._run_recipes = hit\n"
        "from lowprec.cli import main\n"
        "sys.exit(main())\n"
    )
    assert r.returncode == code, r.stderr
    assert r.stderr == f"lowprec recipes: interrupted ({sig.name})\n", r.stderr


def test_sigterm_while_starting_is_one_line_in_a_background_job_too() -> None:
    """A background job of a non-interactive shell inherits SIGINT ignored; SIGTERM still
    has its default action there, and a SIGTERM while starting is the same one line."""
    r = _run(
        "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "import sys; sys.argv = ['lowprec']\n"
        "import os, time, lowprec\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n"
    )
    assert r.returncode == 143, r.stderr
    assert r.stderr == "lowprec: interrupted while starting; nothing was written\n"

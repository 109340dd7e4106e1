"""``azulite``'s entry point: click's own usage errors (unknown option, missing argument, a value of the wrong
type, an unknown command) come out in the house's shape, ``error:`` then a ``fix:`` line, exit 2; help and
success still exit 0, and a command's own exit code still comes through."""

from __future__ import annotations

import pytest

from tests.cli.inprocess import exit_code as run


@pytest.mark.parametrize("args, command, says", [
    (("job", "submit", "--bogus"), "azulite job submit", "No such option: --bogus"),
    (("job", "submit"), "azulite job submit", "Missing argument"),
    (("job", "list", "-n", "x"), "azulite job list", "'--limit'"),
    (("doctor", "--gpus", "-1"), "azulite doctor", "'--gpus'"),
    (("nonsense",), "azulite", "No such command 'nonsense'"),
])
def test_usage_error_has_a_fix_line_naming_the_help(capsys, args, command, says):
    assert run(*args) == 2
    err = capsys.readouterr().err
    assert f"error: {command}: " in err and says in err
    assert f"fix: run `{command} --help`" in err
    assert "Traceback" not in err and "╭" not in err  # not typer's panel


def test_help_and_success_exit_0_and_an_azulite_error_keeps_its_code(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AZULITE_HOME", str(tmp_path / "home"))
    assert run("job", "submit", "--help") == 0
    assert "--wait" in capsys.readouterr().out
    assert run("job", "list") == 0
    assert run("job", "show", "nope-1") == 2
    assert "error:" in capsys.readouterr().err


def test_a_flag_shows_no_value_to_pass_in_help(capsys, monkeypatch):
    """typer 0.2x printed ``--wait <bool>``: a user typed ``--wait true`` and was refused."""
    monkeypatch.setenv("COLUMNS", "160")
    assert run("job", "submit", "--help") == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("│ --")}
    assert "<bool>" not in lines["--wait"] and "<bool>" not in lines["--json"]
    assert "<str>" in lines["--backend"]  # an option that takes a value still shows its type


def test_a_commands_own_exit_code_comes_through(capsys, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("command: python train.py\nresources: {instance_type: Standard_NC24rs_v3, instance_count: 2}\n")
    # no candidate fits a $1 budget: plan raises typer.Exit(1)
    assert run("plan", spec, "--hours", "50", "--budget", "1", "--runs", "2", "--json") == 1
    assert '"pick": null' in capsys.readouterr().out


def test_every_option_of_every_command_has_a_help_line():
    import typer.main

    from azulite.cli import app

    missing = []

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, (*path, name))
        missing.extend(f"{' '.join(path)} {p.opts[0]}" for p in getattr(cmd, "params", ())
                       if p.param_type_name == "option" and p.opts[0] != "--help" and not getattr(p, "help", None))

    walk(typer.main.get_command(app), ("azulite",))
    assert missing == []  # serve's --*-address and keys' --json had none


def test_the_command_line_loads_only_what_a_command_uses():
    """`azulite --help`, `job list`, `job wait` start in a fraction of a second: the job-spec models, the price
    catalog, numpy's samplers, the metrics and storage libraries and torch load inside the commands that use
    them, not with the command line (they took ~1 s of every `azulite` call). Checked in a fresh interpreter."""
    import subprocess
    import sys

    heavy = ("torch", "numpy", "prometheus_client", "fsspec", "yaml", "azulite.spec.job", "azulite.catalog",
             "azulite.launch.sampling", "azulite.observe.jobs", "azulite.train.storage", "azulite.bench.jobs",
             "azulite.launch.local.supervisor", "azulite.launch.local.strategy")
    # the local backend too: `job wait`, `cancel`, `preempt` and `logs` read its store, nothing more
    code = ("import sys, azulite.cli, azulite.launch.local.backend; "
            "print(' '.join(m for m in sys.argv[1:] if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code, *heavy], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == []

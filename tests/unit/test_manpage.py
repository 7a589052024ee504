"""ops/replicator.1 is what coordinator/manpage.py renders from the CLI's parser now, names every command, and is
roff that groff reads without a warning."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from replicator.coordinator import manpage
from replicator.coordinator.cli import ADMIN_ENV, build_parser

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "ops" / "replicator.1"


def test_the_committed_page_is_what_the_parser_renders_now() -> None:
    assert PAGE.read_text(encoding="utf-8") == manpage.render(), (
        f"ops/replicator.1 is out of date with the CLI's parser: regenerate it with `{manpage.REGENERATE}`"
    )


def test_the_page_does_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_ENV, "http://10.9.9.9:9926,http://10.9.9.8:9926")
    monkeypatch.setenv("COLUMNS", "41")
    page = manpage.render()
    assert "10.9.9.9" not in page
    assert page == PAGE.read_text(encoding="utf-8")


def test_the_module_prints_the_page() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "replicator.coordinator.manpage"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout == manpage.render()


def test_every_command_and_option_appears() -> None:
    parser = build_parser()
    page = PAGE.read_text(encoding="utf-8")
    leaves = manpage.leaf_commands(parser)
    assert {"run", "status", "certs ca", "certs resign", "node list", "node remove", "completion"} <= set(leaves)
    for name, sub, _ in manpage.commands(parser):
        assert f'.SS "replicator {manpage.escape(name)}"' in page, name
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            for option in action.option_strings:
                assert f"\\fB{manpage.escape(option)}\\fR" in page, f"{name} {option}"


def test_the_sections_of_a_manual_page() -> None:
    page = PAGE.read_text(encoding="utf-8")
    sections = [line.removeprefix(".SH ") for line in page.splitlines() if line.startswith(".SH ")]
    for section in ["NAME", "SYNOPSIS", "DESCRIPTION", "EXIT STATUS", "ENVIRONMENT", "FILES", "SEE ALSO"]:
        assert section in sections
    assert page.splitlines()[2].startswith(".TH REPLICATOR 1 ")
    for code in ("0", "1", "2", "3", "141"):
        assert f".TP\n\\fB{code}\\fR\n" in page
    for variable in ("REPLICATOR_ADMIN", "REPLICATOR_ADMIN_TOKEN", "REPLICATOR_<SECTION>_<KEY>"):
        assert f"\\fB{manpage.escape(variable)}\\fR" in page


def test_text_is_escaped_for_roff() -> None:
    assert manpage.escape("a\\b") == "a\\eb"
    assert manpage.escape("--json") == "\\-\\-json"
    assert manpage.escape(".starts\n'quoted\nplain") == "\\&.starts\n\\&'quoted\nplain"
    assert manpage.prose(".  a   `--x`  b") == "\\&. a \\fB\\-\\-x\\fR b"
    # No line of the page is a request or macro the generator did not write on purpose.
    requests = {line.split()[0] for line in PAGE.read_text(encoding="utf-8").splitlines() if line[:1] in ".'"}
    assert requests <= {'.\\"', ".TH", ".nh", ".ad", ".SH", ".SS", ".HP", ".PP", ".TP", ".RS", ".RE", ".nf", ".fi"}


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_groff_reads_the_page_without_a_warning() -> None:
    result = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z", str(PAGE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""

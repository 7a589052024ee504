"""The manual page `replicator(1)`, rendered from the command line's parser (`coordinator.cli.build_parser`), so that
it says what `--help` says and cannot drift from it: `ops/replicator.1` is its output, committed, installed under
share/man/man1 by the wheel, and checked against a fresh rendering by tests/unit/test_manpage.py.

    python -m replicator.coordinator.manpage > ops/replicator.1      (or: make man)

The roff is written here rather than by a dependency: one subsection per command and subcommand (its synopsis, its
description, its options, its example), then EXIT STATUS, ENVIRONMENT, FILES and SEE ALSO. The page carries no
version and no date, so that it renders the same from any tree and on any day.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from replicator.coordinator import cli
from replicator.coordinator.admin_client import ADMIN_TOKEN_ENV

REGENERATE = "python -m replicator.coordinator.manpage > ops/replicator.1  (or: make man)"
EXIT_FAILED = 1
EXIT_BOOT = 3
_CODE = re.compile(r"`([^`\n]+)`")


def escape(text: str) -> str:
    """Text as roff reads it literally: backslashes and hyphens escaped (`\\-` is the minus an option is typed
    with), and a line that would start with a control character (`.` or `'`) made an ordinary text line."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n"))


def prose(text: str) -> str:
    """Escaped running text, with `code` spans set in bold; a line of its own, however long (roff fills it)."""
    text = " ".join(text.split())
    parts = _CODE.split(text)
    out = "".join(escape(part) if i % 2 == 0 else f"\\fB{escape(part)}\\fR" for i, part in enumerate(parts))
    return "\\&" + out if out.startswith((".", "'")) else out


def _quote(text: str) -> str:
    """A macro argument in double quotes (a double quote inside it as `\\(dq`)."""
    return '"' + escape(text).replace('"', "\\(dq") + '"'


def _bold(text: str) -> str:
    return f"\\fB{escape(text)}\\fR"


def _italic(text: str) -> str:
    return f"\\fI{escape(text)}\\fR"


@contextmanager
def _clean_environment() -> Iterator[None]:
    """The parser as built without $REPLICATOR_ADMIN, whose URLs would otherwise be the defaults of --admin."""
    saved = os.environ.pop(cli.ADMIN_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[cli.ADMIN_ENV] = saved


def commands(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """(full command, its parser, its one-line help) for every command and subcommand, depth first in the order of
    `--help`; aliases are not repeated."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                name = f"{path} {choice.dest}".strip()
                sub = action.choices[choice.dest]
                yield name, sub, choice.help or ""
                yield from commands(sub, name)


def leaf_commands(parser: argparse.ArgumentParser) -> list[str]:
    """The commands that run something (those without subcommands), e.g. `status`, `certs ca`, `node list`."""
    return [name for name, sub, _ in commands(parser) if not _subcommands(sub)]


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options a command documents: not --help (said once, under OPTIONS), nor one hidden from --help."""
    return [
        action
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
    ]


def _metavar(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    if action.option_strings:
        return formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return formatter._format_args(action, formatter._get_default_metavar_for_positional(action))


def _invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """`\\-c, \\-\\-config CONFIG` in bold and italics: each option string once, then what it takes (if anything)."""
    if not action.option_strings:
        return _italic(_metavar(parser, action))
    names = ", ".join(_bold(option) for option in action.option_strings)
    if action.nargs == 0:
        return names
    return f"{names} {_italic(_metavar(parser, action))}"


def _synopsis_item(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.option_strings:
        return _italic(_metavar(parser, action))
    option = _bold(
        action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
    )
    # `\\ ` (an unbreakable space) keeps an option with its value, and its `...`, on one line of the synopsis.
    return option if action.nargs == 0 else f"{option}\\ {_italic(_metavar(parser, action))}"


def _synopsis(name: str, parser: argparse.ArgumentParser) -> list[str]:
    """The command, its options (optional ones in brackets, the alternatives of a group joined by `|`), then its
    positional arguments, as a paragraph that hangs after the command name."""
    groups = {id(action): group for group in parser._mutually_exclusive_groups for action in group._group_actions}
    items: list[str] = []
    seen: set[int] = set()
    actions = _shown(parser)
    for action in [a for a in actions if a.option_strings] + [a for a in actions if not a.option_strings]:
        if id(action) in seen:
            continue
        group = groups.get(id(action))
        if group is not None:
            members = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
            seen.update(id(a) for a in members)
            text = " | ".join(_synopsis_item(parser, a) for a in members)
            items.append(f"({text})" if group.required else f"[{text}]")
            continue
        seen.add(id(action))
        text = _synopsis_item(parser, action)
        if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
            text += "\\ ..."
        items.append(text if action.required or not action.option_strings else f"[{text}]")
    sub = _subcommands(parser)
    if sub is not None:
        items.append(_italic(sub.metavar or "COMMAND") + " ...")
    return [".HP", " ".join([_bold(name), *items])]


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An option's help as --help prints it: `%(default)s` expanded, the default appended where the CLI shows it."""
    return parser._get_formatter()._expand_help(action) if action.help else ""


def _examples(parser: argparse.ArgumentParser) -> list[str]:
    """The example lines of a command's epilog (its other paragraphs, the exit codes and the environment, have
    sections of their own)."""
    lines: list[str] = []
    for block in (parser.epilog or "").split("\n\n"):
        head, _, rest = block.partition("\n")
        if head in ("example:", "examples:"):
            lines.extend(line[2:] if line.startswith("  ") else line for line in rest.split("\n"))
    return lines


def _example_block(lines: list[str]) -> list[str]:
    if not lines:
        return []
    return [
        ".PP",
        "Example:" if len(lines) == 1 else "Examples:",
        ".PP",
        ".RS 4",
        ".nf",
        *map(escape, lines),
        ".fi",
        ".RE",
    ]


def _options(parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for action in _shown(parser):
        out += [".TP", _invocation(parser, action), prose(_help(parser, action))]
    return out


def _command_section(name: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    out = [f".SS {_quote(name)}"]
    out += _synopsis(name, parser)
    out += [".PP", prose(parser.description or summary)]
    sub = _subcommands(parser)
    if sub is not None:
        out += [".PP", prose(f"{sub.metavar or 'COMMAND'} is one of:")]
        for choice in sub._choices_actions:
            out += [".TP", _bold(choice.dest), prose(choice.help or "")]
    out += _options(parser)
    out += _example_block(_examples(parser))
    return out


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The page, as roff (man section 1)."""
    if parser is None:
        with _clean_environment():
            parser = cli.build_parser()
    top = _subcommands(parser)
    assert top is not None, "the replicator parser has commands"
    out = [
        '.\\" Generated from the parser of coordinator/cli.py by coordinator/manpage.py: do not edit. Regenerate with',
        f'.\\" {REGENERATE}',
        '.TH REPLICATOR 1 "" "replicator" "User Commands"',
        ".nh",
        ".ad l",
        ".SH NAME",
        f"replicator \\- {escape(parser.description or '').rstrip('.').lower()}",
        ".SH SYNOPSIS",
        *_synopsis("replicator", parser),
        ".SH DESCRIPTION",
        prose(
            f"{parser.description} `replicator` runs a replication node (`replicator run`) and is the tool to set "
            "one up (`certs`, `init`), to look at a running cluster through a node's admin port (`status`, "
            "`verify`, `diff`, `node list`) and to act on it (`node add`, `node remove`, `delete-database`, "
            "`repair-blobs`, `backup`, `restore`, `clone`)."
        ),
        ".PP",
        prose(
            "`replicator COMMAND --help` prints a command's options with their defaults, as this page does. Every "
            "command takes `--json`, which prints what it found as JSON on stdout; a failure that printed nothing "
            'else prints `{"ok": false, "command", "exit_code", "error"}` there.'
        ),
        ".SH OPTIONS",
    ]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        out += [".TP", _invocation(parser, action), prose(_help(parser, action))]
    out += [".SH COMMANDS"]
    for choice in top._choices_actions:
        out += [".TP", _bold(choice.dest), prose(choice.help or "")]
    for name, sub, summary in commands(parser):
        out += _command_section(f"replicator {name}", sub, summary)
    out += [".SH EXAMPLES", ".nf", *map(escape, _examples(parser)), ".fi"]
    out += _exit_status() + _environment() + _files() + _see_also()
    return "\n".join(out) + "\n"


def _exit_status() -> list[str]:
    codes = [
        (0, "The command did what it was asked (`status --check`: every worker ready, every pair connected)."),
        (
            EXIT_FAILED,
            "It failed: a node that cannot be reached or refused the request, a check that found a problem, "
            "records that differ (`verify`, `diff`), a damaged backup file.",
        ),
        (
            cli.EXIT_USAGE,
            "A usage or configuration error: an unknown option, a config file that does not load (the message names "
            "the file, the key and what is wrong), an admin or node URL that cannot be the one meant (the message "
            "says the URL meant), a refused removal.",
        ),
        (
            EXIT_BOOT,
            "A boot error (`run`, `clone`): a port in use, an unreadable certificate or one that names another node, "
            "a private key others can read, a data directory that is not writable, a damaged database file.",
        ),
        (
            cli.EXIT_PIPE,
            "The reader of stdout went away (`replicator status --json | head -1`): 128 + SIGPIPE, as a shell "
            "reports for `cat` or `grep`; the command stops quietly, without a traceback.",
        ),
    ]
    out = [".SH EXIT STATUS"]
    for code, text in codes:
        out += [".TP", _bold(str(code)), prose(text)]
    return out


def _environment() -> list[str]:
    variables = [
        (
            cli.ADMIN_ENV,
            "The default of every `--admin` option: one admin URL, or a comma-separated list of them (`verify` "
            "takes them all, `diff` the first two, the other commands the first). A mistake in it is reported as "
            "the variable's value.",
        ),
        (
            ADMIN_TOKEN_ENV,
            "The admin token every command that calls an admin port sends; else `listen.admin_token` of the "
            "file given with `--config` (`delete-database --token` wins over both).",
        ),
        (
            "REPLICATOR_<SECTION>_<KEY>",
            "Overrides a key of the config file wherever one is loaded (`run`, `check-config`, `--config` of the "
            "other commands), e.g. `REPLICATOR_NODE_WORKERS=4` or `REPLICATOR_LISTEN_ADMIN_TOKEN`; lists as JSON "
            "or comma-separated. A `REPLICATOR_*` variable that names no key is an error.",
        ),
        (
            "NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID",
            "Set by systemd for `run` under `Type=notify`: the node reports `READY=1`, `STATUS=`, `RELOADING=1` "
            "and `EXTEND_TIMEOUT_USEC=` there, and pings the watchdog.",
        ),
        (
            "JOURNAL_STREAM",
            "Set by systemd when stderr is the journal: log lines then carry their priority prefix.",
        ),
    ]
    return _tagged("ENVIRONMENT", variables, _bold)


def _files() -> list[str]:
    files = [
        ("/etc/replicator/NAME.toml", "A node's config file (`init` writes it; `run --config` reads it)."),
        ("/var/lib/replicator/NAME", "A node's data directory (`node.data_dir`), one database file per database."),
        (
            "/etc/default/replicator, /etc/default/replicator-NAME",
            "Environment overrides read by the systemd units `replicator.service` and `replicator@NAME.service`.",
        ),
        (
            "<prefix>/share/replicator/",
            "The operator's kit the wheel installs: the systemd units and sysusers file, Prometheus scrape config "
            "and alerts, the Grafana dashboard, `RUNBOOK.md`, a container image definition and a Kubernetes example.",
        ),
    ]
    return _tagged("FILES", files, _italic)


def _tagged(section: str, entries: list[tuple[str, str]], face: Callable[[str], str]) -> list[str]:
    """A section of tagged paragraphs: each entry's names (comma-separated) in `face`, then its text."""
    out = [f".SH {section}"]
    for name, text in entries:
        out += [".TP", ", ".join(face(part) for part in name.split(", ")), prose(text)]
    return out


def _see_also() -> list[str]:
    return [
        ".SH SEE ALSO",
        r"\fBsystemctl\fR(1), \fBsystemd.service\fR(5), \fBsystemd\-sysusers\fR(8), \fBjq\fR(1)",
        ".PP",
        prose("The README and `share/replicator/RUNBOOK.md` (the operator's runbook) of the project."),
    ]


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())

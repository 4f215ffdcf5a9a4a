"""Every command README.md shows parses as shown (`--help`-level, nothing is run).

The commands are the lines of README.md's shell code blocks (a block tagged `text` is output,
not commands) that start with `scalebench`, `make`, or one of the Rust binaries (bare or as
target/release/NAME). `[optional parts]` are checked as if given, and of `a|b` alternatives
the first. scalebench commands go through its own parsers (`cli.parse`); a Rust binary's flags
must each appear in `BINARY [SUBCOMMAND] --help`; a make target must be a rule of the Makefile.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from scalebench import cli

ROOT = Path(__file__).resolve().parents[1]
RELEASE_DIR = ROOT / "target" / "release"
RUST_BINARIES = ("densevm", "zipfperf", "pagesim")
FENCE = re.compile(r"^```(\w*)\s*$")


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(info string, lines) of every fenced code block."""
    blocks: list[tuple[str, list[str]]] = []
    info, lines = None, []
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and info is None:
            info, lines = m.group(1), []
        elif line.startswith("```") and info is not None:
            blocks.append((info, lines))
            info = None
        elif info is not None:
            lines.append(line)
    return blocks


def logical_lines(lines: list[str]) -> list[str]:
    """Lines joined across a trailing backslash, with `# comments` dropped."""
    out, pending = [], ""
    for line in lines:
        line = re.sub(r"(^|\s)#\s.*$", "", line).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return [x.strip() for x in out if x.strip()]


def as_given(command: str) -> list[str]:
    """The words of a documented command, its optional parts given and of `a|b` the first."""
    command = re.sub(r"\[([^\[\]]*)\]", r"\1", command)
    words = shlex.split(command)
    return [w.split("|")[0] if "|" in w and not w.startswith("-") else w for w in words]


def readme_commands(text: str) -> list[list[str]]:
    """Every command of the README's shell code blocks, as words, the program first (a
    target/release/ path reduced to the binary's name)."""
    commands = []
    for info, lines in code_blocks(text):
        if info == "text":
            continue
        for line in logical_lines(lines):
            words = as_given(line)
            program = words[0].removeprefix("target/release/")
            if program in ("scalebench", "make", *RUST_BINARIES):
                commands.append([program, *words[1:]])
    return commands


README_TEXT = (ROOT / "README.md").read_text()
COMMANDS = readme_commands(README_TEXT)


def by_program(*programs: str) -> list[list[str]]:
    return [c for c in COMMANDS if c[0] in programs]


def ids(commands: list[list[str]]) -> list[str]:
    return [" ".join(c)[:60] for c in commands]


def test_the_readme_has_commands_of_every_kind():
    programs = {c[0] for c in COMMANDS}
    assert {"scalebench", "make", *RUST_BINARIES} <= programs, programs


@pytest.mark.parametrize("command", by_program("scalebench"), ids=ids(by_program("scalebench")))
def test_scalebench_command_parses(command, capsys):
    try:
        cli.parse(command[1:])
    except SystemExit as e:
        err = capsys.readouterr().err
        if "dbtrace is unavailable" in err:
            pytest.skip(err.strip())
        pytest.fail(f"`{' '.join(command)}` does not parse (exit {e.code}): {err.strip()}")


def help_text(binary: Path, subcommand: str | None) -> str:
    argv = [str(binary), *([subcommand] if subcommand else []), "--help"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, f"{' '.join(argv)} exits {proc.returncode}: {proc.stderr}"
    return proc.stdout


def flags_of(words: list[str]) -> set[str]:
    return {w.split("=")[0] for w in words if w.startswith("--")}


@pytest.mark.parametrize("command", by_program(*RUST_BINARIES), ids=ids(by_program(*RUST_BINARIES)))
def test_rust_binary_command_names_real_flags(command):
    binary = RELEASE_DIR / command[0]
    if not binary.exists():
        pytest.skip(f"{binary} is not built (make build)")
    subcommand = command[1] if len(command) > 1 and not command[1].startswith("-") else None
    text = help_text(binary, subcommand)
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text))
    unknown = flags_of(command[1:]) - known
    assert not unknown, f"`{' '.join(command)}`: {sorted(unknown)} not in its --help"


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {
        target
        for m in re.finditer(r"^([A-Za-z0-9_.\-/ ]+?)\s*::?(?!=)", text, re.M)
        for target in m.group(1).split()
    }


@pytest.mark.parametrize("command", by_program("make"), ids=ids(by_program("make")))
def test_make_target_exists(command):
    targets = [w for w in command[1:] if not w.startswith("-") and "=" not in w]
    assert targets, command
    missing = set(targets) - makefile_targets()
    assert not missing, f"`{' '.join(command)}`: the Makefile has no target {sorted(missing)}"


# The checks themselves: a wrong flag or subcommand must fail them.


def test_a_wrong_scalebench_flag_or_subcommand_does_not_parse(capsys):
    for words in (["model", "--no-such-flag"], ["policy", "no-such-action"]):
        with pytest.raises(SystemExit) as e:
            cli.parse(words)
        assert e.value.code == 2, words
    assert "error" in capsys.readouterr().err


def test_a_flag_missing_from_help_is_caught():
    binary = RELEASE_DIR / "zipfperf"
    if not binary.exists():
        pytest.skip(f"{binary} is not built (make build)")
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", help_text(binary, None)))
    assert "--targets" in known and "--no-such-flag" not in known


def test_extraction_reads_blocks_options_and_continuations():
    text = "\n".join(
        [
            "```",
            "scalebench --vms 4 [--policy demand|wsswap] # a comment",
            "target/release/densevm serve \\",
            "    --vms 2",
            "make run     # builds",
            "```",
            "```text",
            "scalebench ok: 4000 VMs",
            "```",
        ]
    )
    assert readme_commands(text) == [
        ["scalebench", "--vms", "4", "--policy", "demand"],
        ["densevm", "serve", "--vms", "2"],
        ["make", "run"],
    ]
    assert "run" in makefile_targets() and "test" in makefile_targets()

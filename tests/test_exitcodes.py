"""exitcodes.py is the one home of exit codes: the shell launchers spell the numbers out (bash
cannot import Python), so their EXIT_* variables are parsed here and checked against it, and
no launcher exits with a bare number other than 0. Also the errno classes of exitcodes.py.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

import exitcodes

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = [
    REPO / "scripts" / "slurm" / "train.sbatch",
    REPO / "scripts" / "launch_multinode.sh",
    REPO / "scripts" / "train_single_node.sh",
]
ASSIGNMENT = re.compile(r"^(EXIT_[A-Z_]+)=(\S+)$", re.MULTILINE)
# `exit 2`, `exit 75;`, `exit 3 ]`: a literal status other than 0 (a variable or $? is fine).
LITERAL_EXIT = re.compile(r"\bexit\s+([1-9][0-9]*)\b")


def code_lines(path: Path) -> str:
    """The script without its comments (a comment may well say 'exit 75')."""
    return "\n".join(
        line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        for line in path.read_text().splitlines()
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_exit_codes_are_the_modules(script: Path) -> None:
    assigned = dict(ASSIGNMENT.findall(script.read_text()))
    assert assigned, f"{script.name} defines no EXIT_* variable"
    for name, value in assigned.items():
        assert hasattr(exitcodes, name), f"{script.name}: {name} is not in exitcodes.py"
        assert int(value) == getattr(exitcodes, name), f"{script.name}: {name}={value}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_exit_through_the_variables(script: Path) -> None:
    literal = LITERAL_EXIT.findall(code_lines(script))
    assert not literal, f"{script.name} exits with literal codes {literal}: use EXIT_* variables"


def test_the_codes_are_distinct_and_final_means_final() -> None:
    codes = {name: value for name, value in vars(exitcodes).items() if name.startswith("EXIT_")}
    assert len(set(codes.values())) == len(codes), codes
    # 69 and 74 are sysexits.h's EX_UNAVAILABLE and EX_IOERR; retryable, as 1 and 4 are.
    for retryable in (
        "EXIT_FAILED",
        "EXIT_STALLED",
        "EXIT_RENDEZVOUS",
        "EXIT_IO",
        "EXIT_PREEMPTED",
    ):
        assert not exitcodes.is_final(codes[retryable]), retryable
    assert exitcodes.FAIL_JOB_EXITS == (2, 3, 76)  # what train.sbatch and the manifests stop on


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.EIO, exitcodes.EXIT_IO),
        (errno.ESTALE, exitcodes.EXIT_IO),
        (errno.ETIMEDOUT, exitcodes.EXIT_IO),
        (errno.ENOSPC, exitcodes.EXIT_BAD_INPUT),
        (errno.EDQUOT, exitcodes.EXIT_BAD_INPUT),
        (errno.ENOENT, exitcodes.EXIT_BAD_INPUT),
        (errno.EACCES, exitcodes.EXIT_BAD_INPUT),
    ],
)
def test_os_errors_are_classed_by_errno(code: int, expected: int) -> None:
    err = OSError(code, f"cannot write /runs/x/step_5.pt: {errno.errorcode[code]}")
    assert exitcodes.exit_for_os_error(err) == expected


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_is_named_with_what_to_do(code: int) -> None:
    text = exitcodes.describe_os_error(OSError(code, "cannot write /runs/x/step_5.pt"))
    assert errno.errorcode[code] in text and "/runs/x/step_5.pt" in text
    assert "Retrying cannot help until" in text and "resumes" in text

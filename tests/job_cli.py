"""What the tests of the example jobs' command lines share: reading `--help`, and the shape of a usage error."""

from __future__ import annotations

import re


def help_entries(text: str) -> dict[str, str]:
    """`{flag: its help text, whitespace collapsed}` from a job's `--help` output; a flag with aliases
    (`-h, --help`, `--scan-layers, --no-scan-layers`) under its first spelling."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, *help_text = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            current = entries[invocation.split(",")[0].split()[0]] = help_text
        elif line.startswith("   ") and current is not None:
            current.append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


def assert_usage_error(result, prog: str, message: str) -> str:
    """Exit status 2, and on stderr the short usage line and one `PROG: error: ...` line holding `message`, nothing
    else; returns the error line."""
    assert result.returncode == 2, result.stderr[-3000:]
    usage, error = result.stderr.strip().splitlines()
    assert usage.startswith(f"usage: {prog} [options]") and usage.endswith("(--help lists them)"), usage
    assert error.startswith(f"{prog}: error: ") and message in error, error
    return error

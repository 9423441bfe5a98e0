"""The `hfquant` console script (`[project.scripts]` in pyproject.toml): `hfquant.commands.cli`, with the package
root run only once a command is about to run.

Python runs a package's `__init__.py` before importing anything inside it, and `hfquant/__init__.py` imports torch
and transformers to register with them, as `import hfquant` promises library users: 2-3 s on a quiet machine, far
more on a busy one, before `hfquant --help` could print a word. This module sits outside the package to avoid that:
it puts the `hfquant` package in `sys.modules` without running its root, parses the command line with
`hfquant.commands.cli` (whose parser imports only the standard library and `hfquant.commands`), and runs the root,
into the same module object, just before the command: `--help`, `--version` and argument errors answer without
torch or transformers, and a command runs with everything `import hfquant` sets up. `python -m
hfquant.commands.cli` runs the same parser and commands after a plain `import hfquant`.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default `sys.argv[1:]`) and run the command; returns its exit status. For a process of its own
    (the console script): a parsing error or `--help` exits before the package root has run, leaving the `hfquant`
    package in `sys.modules` without its public names."""
    spec = None if "hfquant" in sys.modules else importlib.util.find_spec("hfquant")
    if spec is not None:
        sys.modules["hfquant"] = importlib.util.module_from_spec(spec)
    from hfquant.commands import cli

    args = cli.parse_args(argv)
    if spec is not None:
        spec.loader.exec_module(sys.modules["hfquant"])
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())

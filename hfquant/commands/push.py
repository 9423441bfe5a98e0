"""`hfquant push PATH REPO_ID`: a checkpoint folder to the Hub in one commit, with its card (`hfquant.publishing.hub`)."""

from __future__ import annotations

import argparse

from hfquant.commands.options import add_common_options, apply_progress_option
from hfquant.core.text import terminal_safe

__all__ = ["HELP", "add_parser", "run"]

HELP = "upload a checkpoint folder to the Hugging Face Hub in one commit"
"""The line of the `hfquant --help` listing."""


def add_parser(sub) -> argparse.ArgumentParser:
    """The `push` subcommand's parser, added to the subparsers `sub` and returned."""
    p = sub.add_parser(
        "push",
        help=HELP,
        description="Create REPO_ID if needed and commit every file of PATH to it in a single commit, with the "
        "model card rendered for REPO_ID (a README.md that hfquant did not write is uploaded unchanged). Uses the "
        "token of `hf auth login` or HF_TOKEN, and HF_ENDPOINT when set.",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint folder (from hfquant convert or save_pretrained)")
    p.add_argument("repo_id", metavar="REPO_ID", help="model repo, org/name")
    p.add_argument(
        "--private",
        action="store_true",
        default=None,
        help="create the repo private (an existing repo keeps its visibility)",
    )
    p.add_argument(
        "--revision", default=None, metavar="BRANCH", help="branch to commit to, created if missing (default main)"
    )
    p.add_argument(
        "--commit-message",
        default=None,
        metavar="MSG",
        help="commit title (default: Upload NAME quantized with hfquant)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up when the Hub does not answer a connection, read or write within SECONDS (default: "
        "$HFQUANT_HUB_TIMEOUT or 60)",
    )
    add_common_options(p)
    return p


def run(args: argparse.Namespace) -> int:
    from hfquant.publishing.hub import push_folder

    apply_progress_option(args)
    info = push_folder(
        args.path,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        timeout=args.timeout,
    )
    print(terminal_safe(f"pushed {args.path} to {args.repo_id}: {info.commit_url}"))
    return 0

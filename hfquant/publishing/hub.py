"""Publishing quantized checkpoints on the Hugging Face Hub, in one commit, with hfquant's model card.

`push_folder(path, repo_id)` creates the repo if needed (`HfApi.create_repo`), and the branch for `revision`, then
commits every file of `path` with a single `HfApi.create_commit`. The README.md it sends is the hfquant card rendered
for `repo_id` (`hfquant.publishing.cards`) unless the folder holds a hand-written README.md, which is sent as it is.

`attach_model_card(model)` makes `model.push_to_hub(...)` of a model quantized on load (or reloaded) save the model and
push it the same way, so the Hub gets hfquant's card instead of transformers' generic one.

Hub errors come out as `HubError` with a message that says what to do (log in, check the name, retry later). Every
request waits at most `timeout` seconds for the connection and for each read or write (`HFQUANT_HUB_TIMEOUT`, default
`DEFAULT_HUB_TIMEOUT`): huggingface_hub's own client has no timeout, so an endpoint that never answers would hang the
push forever. An answer that is not JSON (a proxy's or captive portal's page) is a `HubError` too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RevisionNotFoundError
from huggingface_hub.utils import HFValidationError, get_session, validate_repo_id

from hfquant.checkpoint.files import stays_inside
from hfquant.checkpoint.source import base_model_of
from hfquant.core.binding import bind, is_bound
from hfquant.publishing.cards import asked_settings, build_card, is_hfquant_card, read_base_model

__all__ = [
    "HubError",
    "push_folder",
    "attach_model_card",
    "push_model_to_hub",
    "hub_timeout",
    "DEFAULT_HUB_TIMEOUT",
    "HUB_TIMEOUT_ENV",
]

logger = logging.getLogger(__name__)

HUB_TIMEOUT_ENV = "HFQUANT_HUB_TIMEOUT"
DEFAULT_HUB_TIMEOUT = 60.0
"""Seconds a push waits for a connection, and for each read or write of a request, before giving up (not a limit on a
whole upload: a large file keeps going while bytes move)."""


class HubError(RuntimeError):
    """The Hub refused or failed an operation; the message names the repo, the HTTP status and the fix."""


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network failures: the HTTP client's transport errors (httpx2 for huggingface_hub 2.x) and the OS's."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def hub_timeout(value: float | str | None = None) -> float:
    """The push timeout in seconds: `value`, else `$HFQUANT_HUB_TIMEOUT`, else `DEFAULT_HUB_TIMEOUT`.

    Raises:
        ValueError: not a positive finite number of seconds, naming where it came from.
    """
    source = "timeout"
    if value is None:
        value, source = os.environ.get(HUB_TIMEOUT_ENV), HUB_TIMEOUT_ENV
        if value is None or value == "":
            return DEFAULT_HUB_TIMEOUT
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{source}={value!r} is not a number of seconds > 0; pass e.g. 120")
    return seconds


@contextlib.contextmanager
def _session_timeout(seconds: float):
    """huggingface_hub's shared HTTP client with `seconds` as its timeout for the duration of the block (requests that
    name their own timeout keep it); the previous timeout is restored after."""
    session = get_session()
    previous = session.timeout
    session.timeout = seconds
    try:
        yield
    finally:
        session.timeout = previous


def _is_timeout(error: BaseException) -> bool:
    return isinstance(error, TimeoutError) or any(
        cls.__name__.endswith("TimeoutException") for cls in type(error).__mro__
    )


def _explain(error: Exception, repo_id: str, action: str, endpoint: str, timeout: float = DEFAULT_HUB_TIMEOUT) -> str:
    """A message for a failed Hub call: what failed, the status, and what to do."""

    if _is_timeout(error):
        return (
            f"cannot {action}: the Hub at {endpoint} did not answer within {timeout:g} s; check the network or "
            f"HF_ENDPOINT, or wait longer with --timeout SECONDS (or {HUB_TIMEOUT_ENV}=SECONDS)"
        )
    if isinstance(error, json.JSONDecodeError):
        return (
            f"cannot {action}: the Hub at {endpoint} answered something that is not JSON ({error}); check that "
            "HF_ENDPOINT is a Hugging Face Hub (a proxy or a captive portal may have answered instead)"
        )
    if isinstance(error, OfflineModeIsEnabled):
        return f"cannot {action}: huggingface_hub is in offline mode (HF_HUB_OFFLINE=1); unset it to push"
    if not isinstance(error, HfHubHTTPError):
        return (
            f"cannot {action}: the Hub at {endpoint} could not be reached ({error}); check the network or HF_ENDPOINT"
        )
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    detail = getattr(error, "server_message", None) or ""
    detail = f" (server said: {detail.strip()})" if detail.strip() else ""
    if status == 401:
        fix = "log in with `hf auth login` or set HF_TOKEN to a token with write access"
        return f"cannot {action}: the Hub rejected the credentials (401 Unauthorized){detail}; {fix}"
    if status == 403:
        return (
            f"cannot {action}: your token may not write to {repo_id} (403 Forbidden){detail}; use a token with "
            "write access to that user or organization"
        )
    if isinstance(error, RevisionNotFoundError):
        return f"cannot {action}: {repo_id} has no such revision (404){detail}; pass an existing branch or create it"
    if status == 404:
        return (
            f"cannot {action}: {repo_id} was not found (404 Not Found){detail}; check the repo id "
            "(org/name) and that your token can see it"
        )
    if status is not None and status >= 500:
        return (
            f"cannot {action}: the Hub failed with {status} (server error){detail}; nothing was committed, try "
            "again later"
        )
    return f"cannot {action}: the Hub answered {status}{detail}"


def _operations(folder: Path, readme: bytes | None) -> list:
    """One `CommitOperationAdd` per file of `folder` (hidden files and folders left out), README.md from `readme`."""

    operations = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if not stays_inside(folder, path):
            logger.warning(
                "not uploading %s: it is a link to %s, outside %s (links that leave it are never followed)",
                relative,
                path.resolve(),
                folder,
            )
            continue
        name = relative.as_posix()
        if name == "README.md" and readme is not None:
            continue
        operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)))
    if readme is not None:
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=readme))
    return operations


def _readme(
    folder: Path, repo_id: str, base_model: str | None, command: str | None, tags: list[str] | None
) -> bytes | None:
    """The card rendered for `repo_id` with the extra `tags`, or None when `folder` holds a hand-written README.md
    (uploaded unchanged)."""
    readme_path = folder / "README.md"
    if readme_path.exists() and not is_hfquant_card(readme_path):
        logger.info("%s is not an hfquant card: uploading it unchanged", readme_path)
        return None
    card = build_card(folder, repo_id=repo_id, base_model=base_model, command=command)
    for tag in tags or []:
        if tag not in card.data.tags:
            card.data.tags.append(tag)
    return str(card).encode("utf-8")


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    create_pr: bool = False,
    token: str | bool | None = None,
    base_model: str | None = None,
    command: str | None = None,
    tags: list[str] | None = None,
    endpoint: str | None = None,
    timeout: float | None = None,
):
    """Upload every file of the checkpoint `folder` to the model repo `repo_id` in one commit.

    Args:
        folder: a quantized checkpoint folder (from `hfquant convert` or `save_pretrained`).
        repo_id: "org/name" (or "name" in your own namespace); created if it does not exist.
        private: make a newly created repo private (ignored when the repo exists).
        revision: branch to commit to (created from main when missing); default main.
        commit_message, commit_description, create_pr: as `HfApi.create_commit`.
        token: Hub token; default: the logged-in token or HF_TOKEN.
        base_model, command, tags: for the card rendered for `repo_id` (see `hfquant.publishing.cards.build_card`); extra tags
            are added to its metadata.
        endpoint: Hub URL; default HF_ENDPOINT or https://huggingface.co.
        timeout: seconds to wait for a connection and for each read or write (`hub_timeout`); default
            `$HFQUANT_HUB_TIMEOUT` or `DEFAULT_HUB_TIMEOUT`.

    Returns:
        The `huggingface_hub.CommitInfo` of the commit.

    Raises:
        FileNotFoundError: `folder` is not a folder.
        ValueError: `repo_id` is not a valid repo id, or `timeout` is not a positive number.
        HubError: the Hub refused or failed (401, 403, 404, 5xx, unreachable, no answer within the timeout, an answer
            that is not JSON), with the fix in the message.
    """

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; PATH must be the checkpoint folder to upload")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"REPO_ID {repo_id!r} is not a Hub repo id: {error}") from None
    timeout = hub_timeout(timeout)
    operations = _operations(folder, _readme(folder, repo_id, base_model, command, tags))
    api = HfApi(endpoint=endpoint, token=token)
    failures = (HfHubHTTPError, OfflineModeIsEnabled, json.JSONDecodeError) + _transport_errors()
    action = f"create the repo {repo_id}"
    try:
        with _session_timeout(timeout):
            repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
            repo_id = repo_url.repo_id
            if revision is not None and revision != "main" and not revision.startswith("refs/pr/"):
                action = f"create the branch {revision} of {repo_id}"
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            action = f"commit {len(operations)} files to {repo_id}"
            info = api.create_commit(
                repo_id,
                operations,
                commit_message=commit_message or f"Upload {folder.name} quantized with hfquant",
                commit_description=commit_description,
                revision=revision,
                create_pr=create_pr,
            )
    except failures as error:
        raise HubError(_explain(error, repo_id, action, api.endpoint, timeout)) from error
    except RuntimeError as error:  # huggingface_hub wraps a failed LFS upload: "Error while uploading 'x' to the Hub."
        if not isinstance(error.__cause__, failures):
            raise
        raise HubError(f"{error} {_explain(error.__cause__, repo_id, action, api.endpoint, timeout)}") from error
    logger.info("pushed %d files to %s: %s", len(operations), repo_id, info.commit_url)
    return info


# -- push_to_hub of a model quantized on load --------------------------------------------------------------------


def attach_model_card(model) -> None:
    """Make `model.push_to_hub` push with hfquant's card (`push_model_to_hub`); idempotent, this instance only."""
    if is_bound(getattr(model, "push_to_hub", None), push_model_to_hub):
        return
    model.push_to_hub = bind(push_model_to_hub, model)


def _loaded_from(model) -> tuple[str | None, str | None]:
    """(base model repo id, path or id the model was loaded from) of a model quantized on load or reloaded."""

    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None) or None
    if not source:
        return None, None
    folder = Path(source).expanduser()
    if folder.is_dir():
        readme = folder / "README.md"
        if is_hfquant_card(readme):  # a reloaded hfquant checkpoint: its card names the float model
            return read_base_model(readme).get("base_model"), source
        return base_model_of(source, folder), source
    try:
        validate_repo_id(source)
    except HFValidationError:
        return None, source
    return source, source


def push_model_to_hub(
    model,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | None = None,
    **unused: Any,
):
    """`model.push_to_hub` for hfquant models: `save_pretrained` into a temporary folder, then `push_folder`.

    Takes transformers' `push_to_hub` arguments; the commit holds the saved files and hfquant's card.
    """
    if getattr(model, "hf_quantizer", None) is None:  # dequantize()d: a plain float model, transformers' own push
        return type(model).push_to_hub(
            model,
            repo_id,
            commit_message=commit_message,
            commit_description=commit_description,
            private=private,
            token=token,
            revision=revision,
            create_pr=create_pr,
            max_shard_size=max_shard_size,
            tags=tags or [],
            **unused,
        )
    if unused:
        logger.warning("push_to_hub ignores %s", sorted(unused))
    base_model, source = _loaded_from(model)
    config = model.config.quantization_config
    settings = asked_settings(config.to_dict(), recorded=True)  # not the entries recording each layer's format
    arguments = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    command = (
        "import hfquant\nfrom transformers import AutoModelForCausalLM\n\n"
        f"model = AutoModelForCausalLM.from_pretrained({(base_model or source or 'SRC')!r}, "
        f"quantization_config=hfquant.HfQuantConfig({arguments}))\nmodel.push_to_hub({repo_id!r})"
    )
    with tempfile.TemporaryDirectory(prefix="hfquant-push-") as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        return push_folder(
            tmp,
            repo_id,
            private=private,
            revision=revision,
            commit_message=commit_message or "Upload model",
            commit_description=commit_description,
            create_pr=create_pr,
            token=token,
            base_model=base_model,
            command=command,
            tags=tags,
        )

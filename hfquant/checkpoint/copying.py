"""The small files of a checkpoint folder that travel with its weights (tokenizer, generation config, chat template),
copied from a source folder into a new one by `convert`, `export_checkpoint` and `import_checkpoint`."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from hfquant.checkpoint.checksums import SUMS_NAME
from hfquant.checkpoint.files import CONFIG_NAME, EVAL_FILE, INDEX_NAME, WEIGHT_SUFFIXES, stays_inside

__all__ = ["SKIPPED_FILES", "NOT_EXPORTED", "MAX_COPIED_FILE_BYTES", "copy_small_files"]

logger = logging.getLogger(__name__)

SKIPPED_FILES = frozenset({CONFIG_NAME, "README.md", INDEX_NAME, "pytorch_model.bin.index.json"})
"""Files of SRC that convert rewrites (config.json, the index, the card) instead of copying."""
NOT_EXPORTED = frozenset({CONFIG_NAME, INDEX_NAME, "README.md", SUMS_NAME, EVAL_FILE})
"""Files of an hfquant SRC that export and import do not copy: rewritten (config.json, the index), or describing SRC
only (hfquant's model card, checksums and evaluation results)."""
MAX_COPIED_FILE_BYTES = 200 * 2**20
"""Larger non-weight files are not copied (logged): tokenizers and configs are far smaller."""


def copy_small_files(src: Path, dst: Path, skipped: frozenset[str] | set[str] = SKIPPED_FILES) -> list[str]:
    """Copy SRC's top-level non-weight files (tokenizer, generation config, chat template, ...) except hidden ones and
    `skipped`, never through a link leaving SRC nor above `MAX_COPIED_FILE_BYTES` (both logged); returns their names."""
    copied = []
    for path in sorted(src.iterdir()):
        name = path.name
        if name.startswith(".") or name in skipped or name.endswith(WEIGHT_SUFFIXES):
            continue
        if not stays_inside(src, path):
            logger.warning(
                "not copying %s: it is a link to %s, outside SRC (links that leave it are never followed)",
                path,
                path.resolve(),
            )
            continue
        if path.is_dir():
            logger.info("not copying folder %s (convert copies the top-level files only)", path)
            continue
        if path.stat().st_size > MAX_COPIED_FILE_BYTES:
            logger.warning(
                "not copying %s: %d bytes is more than a tokenizer or config file", path, path.stat().st_size
            )
            continue
        shutil.copyfile(path, dst / name)
        copied.append(name)
    return copied

"""The one folder fedapp caches into: $FEDAPP_CACHE, else ~/.cache/fedapp. Built priors live in its
priors/ (fedapp.models.prior.tiny.cache), trained evaluation readers in its readers/ (fedapp.readers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    return Path(os.environ.get("FEDAPP_CACHE", "~/.cache/fedapp")).expanduser()

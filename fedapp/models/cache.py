"""The one folder fedapp caches into: $FEDAPP_CACHE, else ~/.cache/fedapp. Built priors live in its
priors/ (fedapp.models.prior.tiny.cache), trained evaluation readers in its readers/ (fedapp.readers)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def cache_home() -> Path:
    return Path(os.environ.get("FEDAPP_CACHE", "~/.cache/fedapp")).expanduser()


def facts_digest(facts: dict[str, Any], length: int = 12) -> str:
    """The first `length` hex digits of the sha256 of `facts` as sorted JSON: a cache entry's name, the same
    for the same facts in any order and on any machine."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:length]

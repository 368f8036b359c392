"""Model ids to local folders: an existing path is used as is, anything else is a Hub model id.

A model id is looked up in the local Hugging Face cache first (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else huggingface_hub's default); only when it is not there, and `HF_HUB_OFFLINE`
is not set, is it downloaded. Only the files a checkpoint needs are fetched.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from qat4.errors import Qat4Error

ALLOW_PATTERNS = ["*.json", "*.jinja", "*.safetensors", "*.gguf"]
_TRUE = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, not when huggingface_hub was imported."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def hub_cache_dir() -> str | None:
    """The Hub cache folder as the environment names it now (None: huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve(path_or_id: str | Path) -> Path:
    """A local checkpoint path for a path or a Hub model id (`org/name`)."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    model_id = str(path_or_id)
    try:
        validate_repo_id(model_id)
    except HFValidationError:
        raise Qat4Error(f"{model_id} does not exist") from None
    missing = f"there is no folder or file {model_id}, and"
    try:
        return _snapshot(model_id, local_only=True)
    except LocalEntryNotFoundError:
        if hub_offline():
            raise Qat4Error(f"{missing} no model {model_id} is in the local Hugging Face cache "
                            "(HF_HUB_OFFLINE is set, so the Hub was not asked)") from None
    try:
        return _snapshot(model_id, local_only=False)
    except RepositoryNotFoundError:
        raise Qat4Error(f"{missing} no model {model_id} is in the local Hugging Face cache or on the Hub "
                        "(or it needs a token that is not set)") from None
    except OSError as exc:
        raise Qat4Error(f"{missing} no model {model_id} is in the local Hugging Face cache; "
                        f"the Hub is unreachable ({type(exc).__name__})") from None


def _snapshot(model_id: str, local_only: bool) -> Path:
    folder = snapshot_download(
        model_id, allow_patterns=ALLOW_PATTERNS, cache_dir=hub_cache_dir(), local_files_only=local_only
    )
    return Path(folder)

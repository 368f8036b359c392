"""Where the evaluation data sets are: `--data DIR`, else $QAT4_DATA, else ~/.cache/qat4/data.

The folder holds one sub-folder per set, as published: gsm8k/test.jsonl (openai/grade-school-math),
bfcl/BFCL_v4_<category>.json with bfcl/possible_answer/ (the bfcl-eval package's data folder) and
wikitext-2/wiki.test.raw. qat4 ships none of them. GSM8K's test split is fetched from the Hugging
Face Hub (openai/gsm8k) into the folder the first time it is missing, unless HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from qat4.checkpoint.hub import hub_cache_dir, hub_offline
from qat4.errors import Qat4Error

DATA_ENV = "QAT4_DATA"
DEFAULT_DATA_DIR = Path("~/.cache/qat4/data")
GSM8K_REPO = "openai/gsm8k"
GSM8K_PARQUET = "main/test-00000-of-00001.parquet"


def data_dir(given: str | None) -> Path:
    """--data as given, else $QAT4_DATA, else the default folder."""
    return Path(given or os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR).expanduser()


def required(path: Path, what: str) -> Path:
    """`path` when it is a file; Qat4Error saying where `what` was looked for otherwise."""
    if not path.is_file():
        raise Qat4Error(f"{what} is not at {path}; pass --data DIR for a folder that has it, or set {DATA_ENV}")
    return path


def gsm8k_file(root: Path) -> Path:
    """root/gsm8k/test.jsonl, fetched from the Hub first when it is not there."""
    path = root / "gsm8k" / "test.jsonl"
    if path.is_file():
        return path
    if hub_offline():
        raise Qat4Error(f"the GSM8K test split is not at {path} and HF_HUB_OFFLINE is set, so it was not fetched; "
                        f"pass --data DIR for a folder that has gsm8k/test.jsonl")
    from huggingface_hub import hf_hub_download

    try:
        parquet = hf_hub_download(GSM8K_REPO, GSM8K_PARQUET, repo_type="dataset", cache_dir=hub_cache_dir())
    except OSError as exc:
        raise Qat4Error(f"the GSM8K test split is not at {path} and could not be fetched from the Hub "
                        f"({type(exc).__name__}); pass --data DIR for a folder that has gsm8k/test.jsonl") from None
    rows = _parquet_rows(parquet)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rows))
    partial.replace(path)
    return path


def _parquet_rows(path: str) -> list[dict]:
    try:
        import pyarrow.parquet
    except ImportError:
        raise Qat4Error("reading the Hub's GSM8K file needs pyarrow: pip install 'qat4[eval]'") from None
    return pyarrow.parquet.read_table(path, columns=["question", "answer"]).to_pylist()

"""Checkpoint readers and writers; every format reads into one PackedModel."""

FORMATS = ("ct", "ct-emb4", "qat-bf16", "gguf")
REPACK_TARGETS = ("ct", "ct-emb4", "gguf")  # formats `qat4 repack` writes

"""The Gemma 4 tokenizer: a byte-fallback BPE over the 262,144-token Gemma vocabulary.

Two sources give the same tokenizer:

- a Hugging Face `tokenizer.json` (what checkpoints ship), and
- the `tokenizer.ggml.*` metadata of a GGUF file (token list, merges, token types, special ids,
  chat template), from which `build_tokenizer_json` writes that `tokenizer.json`.

The Gemma vocabulary spells a space as '▁' (U+2581), has no dummy prefix and no split on
whitespace: the whole text, spaces replaced by '▁', is one BPE word, and bytes without a token of
their own become `<0xNN>` tokens. Control tokens (`<bos>`, `<turn|>`, ...) are special and dropped
by `decode(..., skip_special=True)`; user-defined ones (`<|tool_call>`, `<|"|>`, `<|channel>`, ...)
are never dropped, because the reply parser reads them.

Encoding splits the text at its added tokens (`<|turn>`, `<turn|>`, ...), as the BPE does anyway,
and keeps the ids of all but the shortest pieces in a small cache: a chat sends its whole history
again every turn, and the BPE of one 8,000-word message takes about 20 ms, longer than reading the
turn's new tokens on a GPU; a message of a few sentences takes 0.1-0.2 ms, so ten turns of them
cost as much again (on the 2-core build host). A piece's ids do not depend on its neighbours (the
BPE never merges across an added token), so the cached ids are the ones a whole encode gives.

GGUF metadata is read with qat4's own GGUF reader (the `gguf` package's GGUFReader takes about a
minute for this vocabulary); both sources are cached in-process per file, since building the
tokenizer or loading the 11 MB `tokenizer.json` takes seconds.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, processors

from qat4.errors import Qat4Error

BOS = "<bos>"
EOS = "<eos>"
SPACE = "\u2581"
TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_UNKNOWN = 2
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4
_SPECIAL_TYPES = (_GGUF_UNKNOWN, _GGUF_CONTROL)
_ADDED_TYPES = (_GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_FileKey = tuple[str, int, int]
CACHED_PIECE_CHARS = 64  # pieces at least this long are kept by the encode cache (shorter ones take µs to encode)
CACHE_CHARS = 4 << 20  # characters of pieces the encode cache keeps, least recently used out first


class _Metadata(Protocol):
    """GGUF metadata by key: `GGUFReader.fields`, qat4's GGUFFile, or a dict of plain values."""

    def get(self, key: str, default: Any = None) -> Any:
        ...


class Tokenizer:
    """Text <-> token ids for Gemma 4, plus the chat template that came with it."""

    def __init__(self, hf: tokenizers.Tokenizer, chat_template: str | None = None, *,
                 bos_id: int | None = None, eos_id: int | None = None):
        """Wrap a HF `tokenizers.Tokenizer`; `bos_id`/`eos_id` default to the ids of `<bos>`/`<eos>`."""
        self._hf = hf
        self.chat_template = chat_template
        self.bos_id = self.token_to_id(BOS) if bos_id is None else bos_id
        self.eos_id = self.token_to_id(EOS) if eos_id is None else eos_id
        self._pieces = _PieceCache.of(hf)

    @classmethod
    def from_file(cls, tokenizer_json_path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load a HF `tokenizer.json` file."""
        return cls(_load_json_file(_file_key(tokenizer_json_path)), chat_template)

    @classmethod
    def from_gguf_metadata(cls, fields: _Metadata, chat_template: str | None = None) -> Tokenizer:
        """Build from GGUF metadata: `GGUFReader.fields`, qat4's GGUFFile, or a dict of plain values by key.

        `chat_template` overrides the metadata's `tokenizer.chat_template`.
        """
        return _GgufTokenizer.from_metadata(fields).wrap(chat_template)

    @classmethod
    def from_gguf(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Build from the tokenizer metadata of a GGUF file (parsed once per file and process)."""
        return _read_gguf(_file_key(path)).wrap(chat_template)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def id_limit(self) -> int:
        """One past the largest id it gives (its vocabulary size, unless its ids have gaps)."""
        return max(self._hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|turn>`, ...) map to their ids."""
        ids = self._pieces.encode(text) if self._pieces is not None else self._hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; control tokens are kept as text unless `skip_special`."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def pieces(self) -> list[str]:
        """Every token's vocabulary entry by id (`▁` for a space, `<0xNN>` for a byte, added tokens as written)."""
        return [self._hf.id_to_token(i) or "" for i in range(self.vocab_size)]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (:func:`piece_bytes` of its vocabulary entry)."""
        return piece_bytes(self._hf.id_to_token(token_id) or "")

    def added_tokens(self) -> dict[int, str]:
        """The added tokens (control tokens and the chat template's markers) by id."""
        return {i: t.content for i, t in self._hf.get_added_tokens_decoder().items()}

    def token_to_id(self, token: str) -> int:
        """Id of one vocabulary entry; raises Qat4Error when `token` is not in the vocabulary."""
        token_id = self._hf.token_to_id(token)
        if token_id is None:
            raise Qat4Error(f"token {token!r} is not in the tokenizer's vocabulary")
        return token_id


def piece_bytes(piece: str) -> bytes:
    """The bytes a vocabulary entry stands for: a byte token's (`<0xNN>`) one byte, else its text
    in UTF-8 with `▁` as a space (an added token's as written)."""
    byte = _BYTE_TOKEN.fullmatch(piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace(SPACE, " ").encode()


class _PieceCache:
    """Encode text piece by piece between its added tokens, the ids of long pieces kept (module
    docstring). Only for tokenizers whose added tokens all start with '<' and match the raw text
    as it is (no normalisation, stripping or word bounds), which is how Gemma's are."""

    def __init__(self, hf: tokenizers.Tokenizer, added: dict[str, int]):
        self._hf, self._added = hf, added
        # the longest added token at the leftmost place, as one scan in C (a Python loop over every
        # '<' and every token length took 7 ms for 2,000 of them)
        self._pattern = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True))) or "(?!)")
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, hf: tokenizers.Tokenizer) -> "_PieceCache | None":
        tokens = hf.get_added_tokens_decoder()
        if not all(t.content.startswith("<") and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
                   for t in tokens.values()):
            return None
        return cls(hf, {t.content: i for i, t in tokens.items()})

    def encode(self, text: str) -> list[int]:
        ids, start = [], 0
        for match in self._pattern.finditer(text):
            ids += self._piece(text[start : match.start()])
            ids.append(self._added[match.group()])
            start = match.end()
        return ids + self._piece(text[start:])

    def _piece(self, piece: str) -> list[int]:
        if not piece:
            return []
        if len(piece) < CACHED_PIECE_CHARS:
            return self._hf.encode(piece, add_special_tokens=False).ids
        with self._lock:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
                return list(ids)
        ids = self._hf.encode(piece, add_special_tokens=False).ids
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = ids
                self._chars += len(piece)
                while self._chars > CACHE_CHARS and len(self._ids) > 1:
                    old, _ = self._ids.popitem(last=False)
                    self._chars -= len(old)
        return list(ids)


@dataclass(frozen=True)
class _GgufTokenizer:
    """What GGUF metadata gives: the HF tokenizer, special ids and the embedded chat template."""

    hf: tokenizers.Tokenizer
    bos_id: int
    eos_id: int
    chat_template: str | None

    @classmethod
    def from_metadata(cls, fields: _Metadata) -> _GgufTokenizer:
        """Read the `tokenizer.*` keys of `fields` (GGUFReader's ReaderField or plain values)."""
        def value(key: str, default: Any = None) -> Any:
            field = fields.get(f"tokenizer.{key}")
            if field is None:
                return default
            return field.contents() if hasattr(field, "contents") else field

        tokens, merges, types = (value(f"ggml.{k}") for k in ("tokens", "merges", "token_type"))
        if not tokens or not merges or types is None:
            raise Qat4Error("the GGUF metadata lacks tokenizer.ggml.tokens, merges or token_type; "
                            "only BPE vocabularies such as Gemma 4's can be loaded")
        hf = _build_bpe(list(tokens), list(merges), list(types), value("ggml.unknown_token_id"))
        bos_id = _special_id(hf, value("ggml.bos_token_id"), BOS)
        if value("ggml.add_bos_token", True):
            hf.post_processor = _bos_processor(tokens[bos_id], bos_id)
        return cls(hf, bos_id, _special_id(hf, value("ggml.eos_token_id"), EOS), value("chat_template"))

    def wrap(self, chat_template: str | None) -> Tokenizer:
        """A Tokenizer over this vocabulary; `chat_template` replaces the embedded one when given."""
        template = self.chat_template if chat_template is None else chat_template
        return Tokenizer(self.hf, template, bos_id=self.bos_id, eos_id=self.eos_id)


def _build_bpe(tokens: list[str], merges: list[str], types: list[int], unk_id: int | None) -> tokenizers.Tokenizer:
    """The Gemma BPE: '▁' for spaces, byte fallback, no pre-tokenizer, specials as added tokens."""
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise Qat4Error("the GGUF token list tokenizer.ggml.tokens has duplicate entries")
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    unk = tokens[unk_id] if unk_id is not None else None
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", SPACE)
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.add_tokens([AddedToken(tokens[i], special=t in _SPECIAL_TYPES, normalized=False)
                   for i, t in enumerate(types) if t in _ADDED_TYPES])
    return hf


def _special_id(hf: tokenizers.Tokenizer, metadata_id: int | None, name: str) -> int:
    """The id the metadata gives for a special token, else the id of its usual name."""
    if metadata_id is not None:
        return int(metadata_id)
    token_id = hf.token_to_id(name)
    if token_id is None:
        raise Qat4Error(f"the GGUF metadata gives no id for {name} and its vocabulary has no such token")
    return token_id


def _bos_processor(bos: str, bos_id: int) -> processors.TemplateProcessing:
    """Prepends `<bos>` when HF clients encode with special tokens, as the GGUF's add_bos_token asks."""
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                         special_tokens=[(bos, bos_id)])


def _file_key(path: str | Path) -> _FileKey:
    """Resolved path, modification time and size: a cache key that changes when the file does."""
    resolved = Path(path).resolve()
    try:
        stat = resolved.stat()
    except OSError:
        raise Qat4Error(f"tokenizer file {path} does not exist or cannot be read") from None
    return str(resolved), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=4)
def _load_json_file(key: _FileKey) -> tokenizers.Tokenizer:
    """Parse one `tokenizer.json` file."""
    try:
        return tokenizers.Tokenizer.from_file(key[0])
    except Exception as exc:  # tokenizers raises plain Exception for malformed files
        raise Qat4Error(f"{key[0]} is not a valid tokenizer.json: {exc}") from None


@functools.lru_cache(maxsize=2)
def _read_gguf(key: _FileKey) -> _GgufTokenizer:
    """Read the metadata of one GGUF file and build its tokenizer."""
    try:
        from qat4.checkpoint.gguf.container import GGUFFile
    except ImportError:  # the reader takes its type codes from the gguf package
        raise Qat4Error(f"reading the tokenizer of {key[0]} needs the 'gguf' package (pip install gguf)") from None
    return _GgufTokenizer.from_metadata(GGUFFile(key[0]))


def build_tokenizer_json(gguf_path: str | Path) -> str:
    """The HF `tokenizer.json` text equivalent to the tokenizer in a GGUF file's metadata."""
    return _read_gguf(_file_key(gguf_path)).hf.to_str()


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder: its `tokenizer.json`, else its only `.gguf` file.

    The chat template comes from `chat_template.jinja`, else `tokenizer_config.json`'s
    `chat_template`, else (GGUF) the template embedded in the metadata.
    """
    folder = Path(folder)
    template = _folder_chat_template(folder)
    if (folder / TOKENIZER_FILE).is_file():
        return Tokenizer.from_file(folder / TOKENIZER_FILE, template)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return Tokenizer.from_gguf(ggufs[0], template)
    raise Qat4Error(f"{folder} holds no {TOKENIZER_FILE} and no single .gguf file to load a tokenizer from")


def find_tokenizer(source: str | Path) -> Tokenizer | None:
    """The tokenizer stored with a checkpoint (folder or .gguf file), or None when it has none."""
    source = Path(source)
    try:
        return Tokenizer.from_gguf(source) if source.is_file() else load_tokenizer(source)
    except Qat4Error:
        return None


def _folder_chat_template(folder: Path) -> str | None:
    """The chat template stored in a checkpoint folder, or None when it has none."""
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    config_path = folder / TOKENIZER_CONFIG_FILE
    if not config_path.is_file():
        return None
    try:
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, AttributeError):
        raise Qat4Error(f"{config_path} is not a JSON object") from None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template

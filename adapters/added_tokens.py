"""The added tokens an adapter folder ships (``added_tokens.json``, ``tokenizer.json``,
``tokenizer_config.json``'s ``added_tokens_decoder``), checked against the served base at upload
and served: an adapter's requests are tokenized and detokenized with a copy of the base's
tokenizer that holds the adapter's own tokens (``loramux.engine.adapter_tokenizers``).

The adapter's *own* tokens are those the base's tokenizer does not have. Added to a copy of
the base's tokenizer in id order they land on ``len(base tokenizer)``, the next id, and so
on; an adapter whose files give them other ids (a gap, ids beyond the base's vocabulary, ids
the base gives other tokens, a base token moved) is refused naming the token and the ids, as
is one with more than :data:`MAX_ADDED_TOKENS` own tokens or a token longer than
:data:`MAX_TOKEN_CHARS` characters. The registry stores the own tokens in the adapter's
config under :data:`STORED_KEY`, which the engine reads back from ``adapter_config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loramux.adapters.errors import AdapterValidationError

__all__ = ["MAX_ADDED_TOKENS", "MAX_TOKEN_CHARS", "STORED_KEY", "AddedTokenSpec",
           "base_token_ids", "check_added_tokens", "own_tokens", "tokenizer_with", "with_adapter_tokens"]

MAX_ADDED_TOKENS = 4096
"""The most tokens of its own an adapter may add to the base's tokenizer."""
MAX_TOKEN_CHARS = 256
"""The longest added token, in characters."""
MAX_STORED_BYTES = 512 * 1024
"""The most bytes the adapter's own tokens may take in its stored config (which the engine
reads under ``adapters.spec.MAX_CONFIG_BYTES``)."""
MAX_LISTED = 1 << 17
"""The most added tokens one file may list (the base's own included)."""
MAX_FILE_BYTES = 64 * 2**20
STORED_KEY = "loramux_added_tokens"
"""``adapter_config.json`` key of the adapter's own tokens as the registry stores them."""
TOKEN_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json")
"""Where a folder's added tokens are read, the file whose flags win first."""


@dataclass(frozen=True)
class AddedTokenSpec:
    """One added token and its ``tokenizers.AddedToken`` flags."""

    content: str
    id: int
    special: bool = False
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False
    normalized: bool | None = None
    """None: the tokenizers default (``not special``)."""

    def to_dict(self) -> dict[str, Any]:
        """The stored form: content, id and the flags that are set."""
        return {k: v for k, v in asdict(self).items() if v not in (False, None)}


def _refuse(field_name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(f"{field_name}: {message}", field=field_name)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _refuse(path.name, "invalid JSON") from None


def _token(name: str, content: Any, i: Any, flags: Mapping | None = None) -> AddedTokenSpec | None:
    if not isinstance(content, str) or isinstance(i, bool) or not isinstance(i, int):
        return None
    if not content or len(content) > MAX_TOKEN_CHARS:
        raise _refuse(name, f"added token {content[:40]!r}… (id {i}) is empty or longer than "
                      f"{MAX_TOKEN_CHARS} characters" if content else f"added token id {i} is empty")
    if i < 0:
        raise _refuse(name, f"added token {content!r} has a negative id {i}")
    f = flags if isinstance(flags, Mapping) else {}
    norm = f.get("normalized")
    return AddedTokenSpec(content, i, *(bool(f.get(k, False)) for k in
                                        ("special", "lstrip", "rstrip", "single_word")),
                          norm if isinstance(norm, bool) else None)


def _listed(name: str, data: Any) -> list[AddedTokenSpec]:
    """The added tokens one file lists."""
    if name == "added_tokens.json":
        items = [(c, i, None) for c, i in data.items()] if isinstance(data, dict) else []
    elif name == "tokenizer_config.json":
        decoder = data.get("added_tokens_decoder") if isinstance(data, dict) else None
        items = [(t.get("content"), int(i), t) for i, t in decoder.items()
                 if isinstance(t, dict) and str(i).isdigit()] if isinstance(decoder, dict) else []
    elif name == STORED_KEY:
        items = [(t.get("content"), t.get("id"), t) for t in data if isinstance(t, dict)] \
            if isinstance(data, list) else []
    else:
        listed = data.get("added_tokens") if isinstance(data, dict) else None
        items = [(t.get("content"), t.get("id"), t) for t in listed
                 if isinstance(t, dict)] if isinstance(listed, list) else []
    if len(items) > MAX_LISTED:
        raise _refuse(name, f"lists {len(items)} added tokens, above the {MAX_LISTED} read")
    return [t for t in (_token(name, *it) for it in items) if t is not None]


def _added_tokens(folder) -> dict[str, list[AddedTokenSpec]]:
    """Per file, the added tokens a tokenizer folder ships; the stored form (the config's
    :data:`STORED_KEY`) alone when the folder has it."""
    folder = Path(folder)
    config = folder / "adapter_config.json"
    if config.is_file() and config.stat().st_size <= MAX_FILE_BYTES:  # else refused as a config
        stored = _read_json(config)
        if isinstance(stored, dict) and STORED_KEY in stored:
            return {"adapter_config.json": _listed(STORED_KEY, stored[STORED_KEY])}
    out: dict[str, list[AddedTokenSpec]] = {}
    for name in TOKEN_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            raise _refuse(name, f"{path.stat().st_size} bytes, above the limit of {MAX_FILE_BYTES} "
                          f"for a tokenizer file")
        out[name] = _listed(name, _read_json(path))
    return out


def base_token_ids(folder) -> dict[str, int] | None:
    """The served base's token -> id (its ``tokenizer.json``'s vocabulary and added tokens);
    None when ``folder`` holds none."""
    path = Path(folder) / "tokenizer.json" if folder else None
    if path is None or not path.is_file():
        return None
    data = _read_json(path)
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
    if isinstance(vocab, list):  # Unigram: [piece, score] in id order
        ids = {p[0]: i for i, p in enumerate(vocab) if isinstance(p, list) and p}
    else:
        ids = dict(vocab) if isinstance(vocab, dict) else {}
    ids.update({t.content: t.id for t in _listed("tokenizer.json", data)})
    return ids


def _check_against_base(name: str, t: AddedTokenSpec, base: Mapping[str, int],
                        taken: Mapping[int, str], vocab_size: int | None) -> bool:
    """Refuse ``t`` if the base's tokenizer or vocabulary disagree; True when it is the base's."""
    if isinstance(vocab_size, int) and t.id >= vocab_size:
        raise _refuse(name, f"added token {t.content!r} (id {t.id}) is beyond the base model's "
                      f"vocabulary of {vocab_size}")
    if t.content in base:
        if base[t.content] != t.id:
            raise _refuse(name, f"added token {t.content!r} has id {t.id} where the base model's "
                          f"tokenizer has {base[t.content]}")
        return True
    if t.id in taken:
        raise _refuse(name, f"added token {t.content!r} has id {t.id}, another token of the base "
                      f"model's tokenizer ({taken[t.id]!r})")
    return False


def own_tokens(folder, base_ids: Mapping[str, int] | None,
               vocab_size: int | None) -> tuple[list[AddedTokenSpec], str]:
    """The adapter's own added tokens in id order (those ``base_ids`` lacks; every file
    merged, the first of :data:`TOKEN_FILES` giving the flags), and the file they came from;
    refused (:class:`AdapterValidationError` naming the token, its ids and the file) unless a
    copy of the base's tokenizer gives each its id. Without ``base_ids`` only the ids' range,
    their agreement between files and the limits are checked."""
    base = base_ids or {}
    taken = {i: c for c, i in base.items()} if base else {}
    tokens: dict[str, AddedTokenSpec] = {}
    where: dict[str, str] = {}
    for name, items in _added_tokens(folder).items():
        for t in items:
            if _check_against_base(name, t, base, taken, vocab_size):
                continue
            seen = tokens.get(t.content)
            if seen is not None and seen.id != t.id:
                raise _refuse(name, f"added token {t.content!r} has id {t.id} here and {seen.id} "
                              f"in {where[t.content]}")
            if seen is None:
                tokens[t.content], where[t.content] = t, name
    own = sorted(tokens.values(), key=lambda t: t.id)
    if len(own) > MAX_ADDED_TOKENS:
        raise _refuse(where[own[0].content], f"{len(own)} added tokens of the adapter's own, above "
                      f"the limit of {MAX_ADDED_TOKENS}")
    first = max(base.values()) + 1 if base else None
    for k, t in enumerate(own):
        if k and own[k - 1].id == t.id:
            raise _refuse(where[t.content], f"added tokens {own[k - 1].content!r} and {t.content!r} "
                          f"both have id {t.id}")
        if first is not None and t.id != first + k:
            raise _refuse(where[t.content], f"added token {t.content!r} has id {t.id}, but added "
                          f"to the base model's tokenizer ({first} tokens) after the adapter's "
                          f"{k} lower ones it gets id {first + k}: an adapter's new tokens must "
                          f"follow the base's ids without gaps")
    return own, (where[own[0].content] if own else "")


def check_added_tokens(folder, vocab_size: int | None,
                       base_folder: str | None = None) -> list[AddedTokenSpec]:
    """Refuse an adapter that ships added tokens (``added_tokens.json``, ``tokenizer.json``'s
    ``added_tokens``, ``tokenizer_config.json``'s ``added_tokens_decoder``) with ids beyond the
    base's vocabulary, or (where the served base's tokenizer is in ``base_folder``) ids a copy
    of the base's tokenizer would not give them (:func:`own_tokens`). Returns the adapter's
    own tokens, to be stored under :data:`STORED_KEY` (refused past :data:`MAX_STORED_BYTES`)."""
    tokens, name = own_tokens(folder, base_token_ids(base_folder), vocab_size)
    size = len(json.dumps([t.to_dict() for t in tokens], indent=2))
    if size > MAX_STORED_BYTES:
        raise _refuse(name, f"the adapter's {len(tokens)} added tokens take {size} bytes stored, "
                      f"above the limit of {MAX_STORED_BYTES}")
    return tokens


def tokenizer_with(base: Any, tokens: list[AddedTokenSpec]) -> Any:
    """A copy of the transformers tokenizer ``base`` with ``tokens`` added in id order
    (special ones as special); :class:`AdapterValidationError` naming the token unless each
    lands on its id."""
    import copy

    from tokenizers import AddedToken

    tok = copy.deepcopy(base)
    tok.add_tokens([AddedToken(t.content, special=t.special, lstrip=t.lstrip, rstrip=t.rstrip,
                               single_word=t.single_word,
                               normalized=(not t.special) if t.normalized is None else t.normalized)
                    for t in tokens])
    for t in tokens:
        got = tok.convert_tokens_to_ids(t.content)
        if got != t.id:
            raise _refuse("added_tokens", f"added token {t.content!r} has id {t.id} in the adapter's "
                          f"files but lands on id {got} in the base model's tokenizer")
    return tok


def with_adapter_tokens(base: Any, folder) -> Any:
    """``base`` (a transformers tokenizer), or a copy of it holding the own added tokens the
    adapter in ``folder`` ships (its export's tokenizer)."""
    tokens = own_tokens(folder, dict(base.get_vocab()), None)[0]
    return tokenizer_with(base, tokens) if tokens else base

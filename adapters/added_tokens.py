"""The added tokens an adapter folder ships (``added_tokens.json``, ``tokenizer.json``,
``tokenizer_config.json``'s ``added_tokens_decoder``), checked against the served base at upload:
the engine serves every adapter's prompts and text with the base's tokenizer, so tokens beyond
its vocabulary, or on ids it gives other tokens, are refused naming the file (never accepted and
ignored). Serving an adapter's own tokenizer is not done yet."""

from __future__ import annotations

from loramux.adapters.errors import AdapterValidationError

__all__ = ["check_added_tokens"]


def _refuse(field_name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(f"{field_name}: {message}", field=field_name)


def _read_json(path):
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _refuse(path.name, "invalid JSON") from None


def _added_tokens(folder) -> dict[str, list[tuple[str, int]]]:
    """Per file, the ``(content, id)`` pairs of the added tokens a tokenizer folder ships."""
    from pathlib import Path

    out: dict[str, list[tuple[str, int]]] = {}
    for name in ("added_tokens.json", "tokenizer.json", "tokenizer_config.json"):
        path = Path(folder) / name
        if not path.is_file() or path.stat().st_size > 64 * 2**20:
            continue
        data = _read_json(path)
        if name == "added_tokens.json":
            items = list(data.items()) if isinstance(data, dict) else []
        elif name == "tokenizer_config.json":
            decoder = data.get("added_tokens_decoder") if isinstance(data, dict) else None
            items = [(t.get("content"), int(i)) for i, t in (decoder or {}).items()
                     if isinstance(t, dict) and str(i).isdigit()] if isinstance(decoder, dict) else []
        else:
            items = [(t.get("content"), t.get("id")) for t in data.get("added_tokens") or []
                     if isinstance(t, dict)] if isinstance(data, dict) else []
        out[name] = [(c, i) for c, i in items if isinstance(c, str) and isinstance(i, int)]
    return out


def _base_token_ids(folder) -> dict[str, int] | None:
    """The served base's token -> id (its ``tokenizer.json``'s vocabulary and added tokens);
    None when ``folder`` holds none."""
    from pathlib import Path

    path = Path(folder) / "tokenizer.json" if folder else None
    if path is None or not path.is_file():
        return None
    data = _read_json(path)
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
    ids = dict(vocab) if isinstance(vocab, dict) else {}
    ids.update({c: i for c, i in _added_tokens(folder).get("tokenizer.json", [])})
    return ids


def check_added_tokens(folder, vocab_size: int | None, base_folder: str | None = None) -> None:
    """Refuse an adapter that ships added tokens (``added_tokens.json``, ``tokenizer.json``'s
    ``added_tokens``, ``tokenizer_config.json``'s ``added_tokens_decoder``) with ids beyond the base's vocabulary, or (where the served base's
    tokenizer is in ``base_folder``) ids the base gives to other tokens: the engine serves
    prompts and text with the base's tokenizer, so such tokens would be silently wrong."""
    base = taken = None
    for name, items in _added_tokens(folder).items():
        for content, i in items:
            if isinstance(vocab_size, int) and i >= vocab_size:
                raise _refuse(name, f"added token {content!r} (id {i}) is beyond the base model's vocabulary "
                              f"of {vocab_size}; adapters with their own tokenizer tokens are not served yet")
            if base is None:
                base = _base_token_ids(base_folder) or {}
                taken = set(base.values())
            if base and base.get(content, i) != i:
                raise _refuse(name, f"added token {content!r} has id {i} where the base model's tokenizer "
                              f"has {base[content]}; adapters with their own tokenizer tokens are not "
                              f"served yet")
            if base and content not in base and i in taken:
                raise _refuse(name, f"added token {content!r} has id {i}, another token of the base "
                              f"model's tokenizer; adapters with their own tokenizer tokens are not "
                              f"served yet")

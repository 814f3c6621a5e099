"""The vocabulary-sized parts of a PEFT LoRA adapter: LoRA on ``embed_tokens`` and ``lm_head``,
and trainable tokens (``trainable_token_indices``).

* ``embed_tokens`` LoRA (PEFT's ``lora.Embedding``): ``lora_embedding_A`` [r, vocab] gathered by
  token id, then ``lora_embedding_B`` [hidden, r]: ``E[t] + s · A[:, t] @ B.T``.
* ``lm_head`` LoRA (PEFT's ``lora.Linear``): ``lora_A.weight`` [r, hidden],
  ``lora_B.weight`` [vocab, r] on the final hidden state. With ``ensure_weight_tying`` on a base
  that ties its embeddings PEFT saves both; served as saved.
* Trainable tokens (PEFT's ``TrainableTokensLayer``): ``token_adapter.trainable_tokens_delta``
  [n, hidden] holds the *rows themselves* for the listed ids (not deltas), for ``embed_tokens``
  and, where the base ties its embeddings (or the adapter lists ``lm_head``), the logits.

PEFT also saves full copies of the embedding and of ``lm_head`` (``*.base_layer.weight``,
``save_embedding_layers``) and ``modules_to_save`` copies of them: reduced to the rows that differ
from the served base (``adapters/full_copies.py``); :func:`load_vocab` never reads them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from loramux.adapters.added_tokens import check_added_tokens
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.full_copies import copy_rows
from loramux.adapters.safetensors_io import FLOAT_DTYPES, TensorInfo, load_tensors

__all__ = [
    "VOCAB_KEY_RE",
    "VOCAB_MODULES",
    "check_added_tokens",
    "check_vocab_combination",
    "check_vocab_layout",
    "collect_vocab",
    "load_vocab",
    "parse_trainable_tokens",
    "peft_vocab_tensors",
    "split_vocab_targets",
    "validate_vocab",
]

VOCAB_MODULES = ("embed_tokens", "lm_head")
MAX_TRAINABLE_TOKENS = 4096
_TARGET_RE = re.compile(r"^(?:model\.(?:language_model\.)?|language_model\.model\.)?(embed_tokens|lm_head)$")
VOCAB_KEY_RE = re.compile(
    r"^base_model\.model\.(?P<prefix>(?:model\.)?(?:language_model\.)?)(?P<module>embed_tokens|lm_head)\."
    r"(?P<part>lora_embedding_A|lora_embedding_B|lora_A\.weight|lora_B\.weight"
    r"|token_adapter\.trainable_tokens_delta|base_layer\.weight|weight)$"
)
_PART = {"lora_embedding_A": "A", "lora_embedding_B": "B", "lora_A.weight": "A", "lora_B.weight": "B",
         "token_adapter.trainable_tokens_delta": "T", "base_layer.weight": "W",
         "weight": "S"}
_LORA_PART = {"embed_tokens": "lora_embedding_{}", "lm_head": "lora_{}.weight"}


def _refuse(field_name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(f"{field_name}: {message}", field=field_name)


def split_vocab_targets(value: Any) -> tuple[Any, tuple[str, ...]]:
    """``target_modules`` without its ``embed_tokens`` / ``lm_head`` entries, and those
    modules (in :data:`VOCAB_MODULES` order). A string value (``all-linear``) has none."""
    if not isinstance(value, list | tuple):
        return value, ()
    rest, vocab = [], set()
    for entry in value:
        m = _TARGET_RE.match(entry) if isinstance(entry, str) else None
        if m:
            vocab.add(m[1])
        else:
            rest.append(entry)
    return rest, tuple(v for v in VOCAB_MODULES if v in vocab)


def parse_trainable_tokens(value: Any, vocab_size: int | None,
                           lora_modules: tuple[str, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``trainable_token_indices`` (a list of ids: ``embed_tokens``'s; or ``{module: ids}``) as
    ``((module, ids), ...)``; ids unique, non-negative and (with ``vocab_size``) in the vocabulary."""
    f = "trainable_token_indices"
    if value is None or value == [] or value == {}:
        return ()
    entries = {"embed_tokens": value} if isinstance(value, list) else value
    if not isinstance(entries, dict):
        raise _refuse(f, f"expected a list of token ids or {{module: ids}}, got {value!r:.80}")
    out: dict[str, tuple[int, ...]] = {}
    for name, ids in entries.items():
        m = _TARGET_RE.match(name) if isinstance(name, str) else None
        if m is None:
            raise _refuse(f, f"{name!r}: expected 'embed_tokens' or 'lm_head'")
        module = m[1]
        if module in lora_modules:
            raise _refuse(f, f"{module} has both trainable tokens and a LoRA; PEFT allows one of them")
        if not isinstance(ids, list) or not ids:
            raise _refuse(f, f"{module}: expected a non-empty list of token ids, got {ids!r:.80}")
        if len(ids) > MAX_TRAINABLE_TOKENS:
            raise _refuse(f, f"{module}: {len(ids)} tokens, above the limit of {MAX_TRAINABLE_TOKENS}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise _refuse(f, f"{module}: token ids must be non-negative integers, got {t!r:.40}")
            if vocab_size is not None and t >= vocab_size:
                raise _refuse(f, f"token id {t} is outside the base model's vocabulary of {vocab_size}")
        if len(set(ids)) != len(ids):
            raise _refuse(f, f"{module}: token ids repeat; PEFT's rows would be undefined")
        out[module] = tuple(ids)
    return tuple((m, out[m]) for m in VOCAB_MODULES if m in out)


def check_vocab_combination(config: Mapping[str, Any], vocab_modules: tuple[str, ...],
                            tokens: tuple) -> None:
    """Refuse vocabulary parts with what PEFT has no variant of (aLoRA; DoRA on them)."""
    if not (vocab_modules or tokens):
        return
    field = "target_modules" if vocab_modules else "trainable_token_indices"
    if config.get("alora_invocation_tokens"):
        raise _refuse(field, "an activated LoRA (alora_invocation_tokens) covers linear layers only; "
                      "embedding, lm_head and trainable tokens are not supported with it")
    if vocab_modules and config.get("use_dora"):
        raise _refuse("use_dora", "DoRA on embed_tokens / lm_head is not supported")


def collect_vocab(infos: Mapping[str, TensorInfo]) -> dict[tuple[str, str], TensorInfo]:
    """The vocabulary parts in a safetensors header: ``(module, part)`` -> its entry, part
    ``A``/``B`` (LoRA), ``T`` (trainable tokens' rows) or ``W`` (a full copy of the base's)."""
    found: dict[tuple[str, str], TensorInfo] = {}
    for key, info in infos.items():
        m = VOCAB_KEY_RE.match(key)
        if m is None:
            continue
        module, part = m["module"], m["part"]
        wrong_lora = part.startswith("lora_") and part.startswith("lora_embedding") != (module == "embed_tokens")
        if (module == "lm_head") != (m["prefix"] == "") or wrong_lora:
            raise AdapterValidationError(f"{key}: unexpected tensor for {module}", field=key)
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterValidationError(
                f"{key}: dtype {info.dtype}; expected a float dtype ({', '.join(FLOAT_DTYPES)})", field=key)
        found[(module, _PART[part])] = info
    return found


def check_vocab_layout(found: Mapping[tuple[str, str], TensorInfo], spec, vocab: int | None,
                       hidden: int | None, tied: bool | None = None) -> None:
    """Every part the spec names present, none other, shapes ``[r, vocab]``/``[hidden, r]``
    (embedding LoRA), ``[r, hidden]``/``[vocab, r]`` (lm_head LoRA), ``[n, hidden]`` (tokens),
    ``[vocab, hidden]`` (base copies); ``vocab``/``hidden`` None: not checked. With
    ``ensure_weight_tying`` on an embedding LoRA PEFT also saves the tied ``lm_head``'s LoRA on a
    base that ties them (``tied``; None: unknown, taken when present)."""
    r = spec.r
    expected: dict[tuple[str, str], tuple] = {}
    modules = list(spec.vocab_modules)
    if (spec.ensure_weight_tying and "embed_tokens" in modules and "lm_head" not in modules
            and (tied or (tied is None and ("lm_head", "A") in found))):
        modules.append("lm_head")
    for module in modules:
        emb = module == "embed_tokens"
        expected[(module, "A")] = (r, vocab if emb else hidden)
        expected[(module, "B")] = (hidden, r) if emb else (vocab, r)
    tokens = dict(spec.trainable_tokens)
    for module, ids in tokens.items():
        expected[(module, "T")] = (len(ids), hidden)
    for key, info in found.items():
        module, part = key
        if part == "W" or (part == "S" and any(module.endswith(e) or e.endswith(module)
                                                   for e in spec.modules_to_save)):
            want = (vocab, hidden)
        elif key in expected:
            want = expected[key]
        else:
            why = {"T": "trainable tokens", "S": "modules_to_save"}.get(part, "a LoRA") + f" on {module}"
            raise AdapterValidationError(f"{info.name}: unexpected tensor: adapter_config.json declares no "
                                         f"{why}", field=info.name)
        shape = tuple(info.shape)
        if len(shape) != 2 or any(w is not None and s != w for s, w in zip(shape, want, strict=True)):
            raise AdapterValidationError(f"{info.name}: shape {list(shape)}; expected "
                                         f"{[w if w is not None else '?' for w in want]}", field=info.name)
    for key in expected:
        if key not in found:
            what = ("token_adapter.trainable_tokens_delta" if key[1] == "T"
                    else (_LORA_PART[key[0]].format(key[1])))
            name = f"{key[0]}.{what}"
            raise AdapterValidationError(f"{name}: missing (adapter_config.json declares it)", field=name)


def _finite(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise AdapterValidationError(f"{name}: contains NaN or infinite values (in {dtype}); "
                                         f"expected finite weights", field=name)


def load_vocab(weights_path, found: Mapping[tuple[str, str], TensorInfo], spec,
               dtype: torch.dtype) -> tuple[dict, dict]:
    """``(vocab_lora, vocab_tokens)`` as :class:`~loramux.adapters.weights.LoraWeights` holds them:
    ``{module: (A, B)}`` in PEFT's orientation, ``{module: (ids int64 [n], rows [n, hidden])}``.
    Full base copies are not read. Refuses non-finite values."""
    names = {k: i.name for k, i in found.items() if k[1] not in ("W", "S")}
    tensors = load_tensors(weights_path, list(names.values()), dtype=dtype)
    _finite(tensors, dtype)
    lora = {m: (tensors[names[(m, "A")]], tensors[names[(m, "B")]]) for m in VOCAB_MODULES
            if (m, "A") in names}
    tokens = {m: (torch.tensor(ids, dtype=torch.int64), tensors[names[(m, "T")]])
              for m, ids in spec.trainable_tokens}
    return lora, tokens


def peft_vocab_tensors(weights, prefix: str) -> dict[str, torch.Tensor]:
    """The vocabulary parts of ``weights`` under PEFT's names (``save_adapter``)."""
    out: dict[str, torch.Tensor] = {}

    def key(module: str, part: str) -> str:
        return f"base_model.model.{'' if module == 'lm_head' else prefix}{module}.{part}"

    for module, (a, b) in weights.vocab_lora.items():
        out[key(module, _LORA_PART[module].format("A"))] = a.contiguous()
        out[key(module, _LORA_PART[module].format("B"))] = b.contiguous()
    for module, (_, rows) in weights.vocab_tokens.items():
        out[key(module, "token_adapter.trainable_tokens_delta")] = rows.contiguous()
    return out


def read_vocab(weights_path, header: Mapping[str, TensorInfo], spec, dtype: torch.dtype,
               base_config: Any = None) -> tuple[dict, dict, dict]:
    """Collect, check (against ``base_config``'s vocabulary and hidden size when given) and load
    the vocabulary parts: ``(vocab_lora, vocab_tokens, found)`` (``found``: the header entries,
    the full base copies among them)."""
    vocab = hidden = tied = None
    if base_config is not None:
        from loramux.adapters.arch import text_config

        cfg = text_config(base_config)
        vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size")
        tied = bool(cfg.get("tie_word_embeddings"))
        for _, ids in spec.trainable_tokens:
            bad = [t for t in ids if isinstance(vocab, int) and t >= vocab]
            if bad:
                raise _refuse("trainable_token_indices",
                              f"token id {bad[0]} is outside the base model's vocabulary of {vocab}")
    found = collect_vocab(header)
    check_vocab_layout(found, spec, vocab, hidden, tied)
    lora, tokens = load_vocab(weights_path, found, spec, dtype)
    return lora, tokens, found


def validate_vocab(folder, header: Mapping[str, TensorInfo], spec, dtype: torch.dtype, base_config: Any,
                   warnings: list[str], base_folder: str,
                   base_tensor: Callable[[str], torch.Tensor | None] | None = None,
                   max_copy_bytes: int | None = None) -> tuple[dict, dict, dict, tuple[str, ...]]:
    """The upload's checks of the vocabulary parts (``validate_adapter``): shaped for the base,
    ids in its vocabulary, finite; PEFT's full copies of the embedding layers reduced to the rows
    that differ from the served base's (``base_tensor(module)``, by default read from
    ``base_folder``, the base's local folder; at most ``max_copy_bytes`` kept; a note in
    ``warnings`` for each copy); the added tokens the adapter ships (:func:`check_added_tokens`).
    Returns ``(vocab_lora, vocab_tokens, vocab_rows, kept copies' tensor names)``."""
    from pathlib import Path

    from loramux.adapters.arch import text_config

    weights_path = Path(folder) / "adapter_model.safetensors"
    lora, tokens, found = read_vocab(weights_path, header, spec, dtype, base_config)
    if base_tensor is None:
        base_tensor = local_base_tensor(base_folder)
    rows, notes, kept = copy_rows(weights_path, found, base_tensor, dtype=dtype, max_bytes=max_copy_bytes)
    check_rows_and_tokens(rows, tokens)
    warnings += notes
    check_added_tokens(folder, text_config(base_config).get("vocab_size"), base_folder)
    return lora, tokens, rows, kept


def check_rows_and_tokens(rows: Mapping[str, Any], tokens: Mapping[str, Any]) -> None:
    """Refuse copied rows of a module that also has trainable tokens: PEFT has no order for
    the two."""
    both = sorted(set(rows) & set(tokens))
    if both:
        raise _refuse("trainable_token_indices", f"{both[0]} has trainable tokens and a full copy "
                      f"(modules_to_save / save_embedding_layers) that differs from the base; "
                      f"expected one of them")


def local_base_tensor(folder: str | None) -> Callable[[str], torch.Tensor | None] | None:
    """A reader of the served base's ``embed_tokens`` / ``lm_head`` weight from its local
    safetensors folder (``lm_head`` falls back to the embedding where the checkpoint ties
    them); None when ``folder`` is not a local model folder."""
    from pathlib import Path

    if not folder or not Path(folder).is_dir() or not list(Path(folder).glob("*.safetensors")):
        return None

    def read(module: str) -> torch.Tensor | None:
        from safetensors import safe_open

        found: dict[str, torch.Tensor] = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if "vision" in key:
                        continue
                    for m in VOCAB_MODULES:
                        if key.endswith(f"{m}.weight") and m not in found:
                            found[m] = st.get_tensor(key).to(torch.float32)
        return found.get(module, found.get("embed_tokens") if module == "lm_head" else None)

    return read


def strip_base_copies(weights_path, dest_dir, keep: tuple[str, ...] = ()) -> Any:
    """``weights_path`` rewritten under ``dest_dir`` without PEFT's full copies of the base's
    embedding layers (``*.base_layer.weight``) equal to the base's (stored once: the base's):
    all but ``keep``, the names of those that differ. ``weights_path`` itself when none goes."""
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(weights_path), "pt") as st:
        keys = list(st.keys())  # noqa: SIM118 (safe_open has no __iter__)
        drop = [k for k in keys if (m := VOCAB_KEY_RE.match(k)) and m["part"] == "base_layer.weight"
                and k not in keep]
        if not drop:
            return weights_path
        tensors = {k: st.get_tensor(k) for k in keys if k not in drop}
        metadata = st.metadata()
    out = Path(dest_dir) / Path(weights_path).name
    save_file(tensors, str(out), metadata=metadata or {"format": "pt"})
    return out

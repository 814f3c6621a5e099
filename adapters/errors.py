"""The one exception type of the adapter domain."""

from __future__ import annotations


class AdapterValidationError(ValueError):
    """An adapter was refused. The message names the field or tensor and what was expected.

    ``field`` is the offending config field (``"r"``, ``"target_modules"``), tensor name,
    file name (``"adapter_model.safetensors"``) or archive member, or ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

CONVERT_HINT = (
    "loramux accepts safetensors only and never unpickles uploads. To convert, load the file "
    "with torch in a trusted environment and save it with safetensors "
    "(safetensors.torch.save_file(torch.load(path, weights_only=True), "
    "'adapter_model.safetensors')) or reload the adapter with PEFT and call "
    "model.save_pretrained(out_dir, safe_serialization=True)."
)


def pickle_refusal(name: str) -> AdapterValidationError:
    """The refusal for a pickle-based file (``.bin``, ``.pt``, ``.pth``, ``.pkl`` or pickle bytes)."""
    return AdapterValidationError(
        f"{name}: pickle-based files are refused. {CONVERT_HINT}", field=name
    )

"""Where the policy runs: ``TEMPER_DEVICE`` resolved to a torch device and a dtype.

``TEMPER_DEVICE`` is ``auto`` (the default: the first CUDA device when torch sees one, else the CPU),
``cpu``, ``cuda`` or ``cuda:N``. On a CUDA device that supports it the engines sample in bfloat16 and the
trainer runs its forward passes under bfloat16 autocast (the weights and the optimizer stay float32);
elsewhere everything is float32. ``TEMPER_DTYPE`` (``auto`` | ``float32`` | ``bfloat16``) overrides the
dtype choice.

A device that is asked for but absent is an error that says what this machine has, never a silent fall
back to the CPU.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_SPEC = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


class DeviceUnavailable(RuntimeError):
    """``TEMPER_DEVICE`` names a device this machine does not have (or is not a device name)."""


@dataclass(frozen=True)
class Placement:
    device: str
    """A torch device string: ``cpu`` or ``cuda:N``."""
    dtype: str
    """``float32`` or ``bfloat16``: what the engines sample in and the trainer autocasts to."""
    name: str
    """What a person reads: ``cpu`` or the GPU's name."""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def describe(self) -> str:
        return f"{self.device} ({self.name}) {self.dtype}" if self.is_cuda else f"cpu {self.dtype}"


def resolve(spec: str | None = None, dtype: str | None = None) -> Placement:
    """The placement for ``spec`` (default: ``$TEMPER_DEVICE`` or ``auto``)."""
    import torch

    spec = (spec or os.environ.get("TEMPER_DEVICE") or "auto").strip().lower()
    if not _SPEC.match(spec):
        raise DeviceUnavailable(f"TEMPER_DEVICE={spec!r} is not a device: use auto, cpu, cuda or cuda:N")
    cuda = torch.cuda.is_available()
    if spec == "auto":
        spec = "cuda:0" if cuda else "cpu"
    elif spec.startswith("cuda"):
        if not cuda:
            raise DeviceUnavailable(
                f"TEMPER_DEVICE={spec} but torch {torch.__version__} sees no CUDA device "
                f"(built with CUDA {torch.version.cuda or 'none'}); install the GPU set (requirements-gpu.txt) "
                "on a machine with a GPU, or use TEMPER_DEVICE=cpu")
        index = int(spec.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"TEMPER_DEVICE={spec} but this machine has {torch.cuda.device_count()} "
                                    "CUDA device(s)")
        spec = f"cuda:{index}"
    wanted = (dtype or os.environ.get("TEMPER_DTYPE") or "auto").strip().lower()
    if wanted not in ("auto", "float32", "bfloat16"):
        raise DeviceUnavailable(f"TEMPER_DTYPE={wanted!r}: use auto, float32 or bfloat16")
    if spec == "cpu":
        return Placement("cpu", "float32" if wanted == "auto" else wanted, "cpu")
    index = int(spec.partition(":")[2])
    bf16 = torch.cuda.is_bf16_supported()
    if wanted == "bfloat16" and not bf16:
        raise DeviceUnavailable(f"TEMPER_DTYPE=bfloat16 but {torch.cuda.get_device_name(index)} does not support it")
    chosen = wanted if wanted != "auto" else ("bfloat16" if bf16 else "float32")
    return Placement(spec, chosen, torch.cuda.get_device_name(index))


def torch_dtype(placement: Placement) -> object:
    import torch

    return torch.bfloat16 if placement.dtype == "bfloat16" else torch.float32

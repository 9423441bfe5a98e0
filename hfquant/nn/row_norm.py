"""One-row RMSNorm for eager decoding: the RMSNorms of known transformers classes compute a single bfloat16 row with
hfquant's C kernel (`torch.ops.hfquant_cpu.rms_norm_row`, `csrc/norm_cpu.c`) instead of their seven small torch ops.

Why: in an eager decode step of a small model the norms are a large share of the time (61 calls per SmolLM2-135M
step, about 13 us each, against 2 us for the kernel: docs/performance.md, issue #32), and their arithmetic is
cheap: what costs is one dispatch per torch op.

Which modules: only the classes of `ROW_RMS_NORM_CLASSES`, whose forward is exactly
`weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(x.dtype)` (LlamaRMSNorm and the families copying
it); GemmaRMSNorm (`1 + weight`), Olmo2's (the product before the cast) and others compute otherwise and keep their
forward. The class of each module is swapped in place for a subclass (as `torch.nn.utils.parametrize` does): its
weight stays the same parameter, so the state dict, `save_pretrained` and hooks see no change, and
`restore_rms_norms` swaps it back.

When the kernel runs: one row (x.numel() == hidden size, the decode step of batch 1), x and weight contiguous
bfloat16 on CPU, and no gradient to record; prefill, batches, other dtypes, training and compiled graphs (inductor
fuses the norm with its neighbours there) run the class's own forward. The outputs are that forward's bit for bit
(the kernel sums the squares in ATen's order); `use_row_rms_norms` checks this on random rows with each module's own
weight before installing the kernel, and leaves the module alone where it differs (another torch summing otherwise).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hfquant.ops import torch_ops

__all__ = ["ROW_RMS_NORM_CLASSES", "RowRMSNorm", "use_row_rms_norms", "restore_rms_norms", "agrees_with_forward"]

ROW_RMS_NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "MinistralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
        "Phi3RMSNorm",
        "GraniteRMSNorm",
        "GraniteMoeRMSNorm",
        "SmolLM3RMSNorm",
        "Lfm2RMSNorm",
    }
)
"""transformers classes (5.24) whose forward is LlamaRMSNorm's, read in their source: `variance_epsilon` and a
1-D `weight`, the result `weight * hidden_states.to(input_dtype)`."""

_CHECK_ROWS = 8
"""Random rows each module's kernel output is compared on, bit for bit, before it is installed."""


class RowRMSNorm:
    """Mixin placed before a norm's own class: one bfloat16 row runs `hfquant_cpu.rms_norm_row`, anything else the
    class's forward. Made into a subclass per norm class by `_row_class`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self._parameters.get("weight")  # not `self.weight`: nn.Module.__getattr__, about a microsecond
        if weight is None:
            weight = self.weight
        if (
            not torch.compiler.is_compiling()
            and hidden_states.dtype == torch.bfloat16
            and hidden_states.numel() == weight.shape[0]
            and not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
            and hidden_states.is_contiguous()
            and hidden_states.device.type == "cpu"
        ):
            return _RMS_NORM_ROW(hidden_states, weight, self.variance_epsilon)
        return super().forward(hidden_states)

    def __reduce_ex__(self, protocol: int):
        """Pickled (`torch.save(model)`, `copy.deepcopy`, multiprocessing) as `_rebuild` of the norm's own transformers
        class: the subclass is made at run time and has no importable name."""
        _, _, *rest = super().__reduce_ex__(protocol)
        return (_rebuild, (type(self).__bases__[1],), *rest)

    def __setstate__(self, state):
        """A copy takes the kernel again where the operators load and agree with its class's forward (as
        `use_row_rms_norms` checks), else it is its class's own: a pickle may be loaded in another process."""
        super().__setstate__(state)
        norm_class = type(self).__bases__[1]
        self.__class__ = norm_class
        if _operators() and _eligible(self) and agrees_with_forward(self):
            self.__class__ = _row_class(norm_class)


def _rebuild(norm_class: type) -> nn.Module:
    """The empty module a pickled `RowRMSNorm` is rebuilt into; its state (`__setstate__`) decides its class."""
    return object.__new__(_row_class(norm_class))


_RMS_NORM_ROW = None
"""`torch.ops.hfquant_cpu.rms_norm_row.default`, set by `_operators` (looked up once: the attribute chain costs
about a microsecond a call)."""


def _operators() -> bool:
    """Whether hfquant's operators are loaded (`torch_ops.loaded()`), `_RMS_NORM_ROW` set when they are."""
    global _RMS_NORM_ROW
    if not torch_ops.loaded():
        return False
    _RMS_NORM_ROW = torch.ops.hfquant_cpu.rms_norm_row.default
    return True


@functools.cache
def _row_class(norm_class: type) -> type:
    """The subclass of `norm_class` with `RowRMSNorm`'s forward, one per class (cached, so `type()` is stable)."""
    return type(norm_class.__name__, (RowRMSNorm, norm_class), {"__module__": norm_class.__module__})


def _eligible(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ in ROW_RMS_NORM_CLASSES
        and not isinstance(module, RowRMSNorm)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def agrees_with_forward(module: nn.Module, rows: int = _CHECK_ROWS, seed: int = 0) -> bool:
    """Whether the kernel gives `module`'s own forward bit for bit on `rows` random bfloat16 rows (normal values
    scaled over six orders of magnitude), with the module's weight and epsilon. Needs the operators loaded."""
    generator = torch.Generator().manual_seed(seed)
    size = module.weight.shape[0]
    with torch.no_grad():
        for _ in range(rows):
            scale = 10.0 ** (torch.rand((), generator=generator).item() * 6 - 3)
            x = (torch.randn((1, 1, size), generator=generator) * scale).to(torch.bfloat16)
            expected = type(module).forward(module, x)
            got = torch.ops.hfquant_cpu.rms_norm_row(x, module.weight, module.variance_epsilon)
            if expected.dtype != got.dtype or not torch.equal(expected.view(torch.int16), got.view(torch.int16)):
                return False
    return True


def use_row_rms_norms(model: nn.Module) -> int:
    """Give every norm of `model` of a `ROW_RMS_NORM_CLASSES` class, with a bfloat16 CPU weight, the one-row kernel
    (class swap in place: see the module docstring), where the kernel agrees with its forward (`agrees_with_forward`).
    Nothing happens where hfquant's operators are unavailable (`torch_ops.loaded()`). Returns the number of norms
    changed."""
    candidates = [module for module in model.modules() if _eligible(module)]
    if not candidates or not _operators():
        return 0
    changed = 0
    for module in candidates:
        if agrees_with_forward(module):
            module.__class__ = _row_class(type(module))
            changed += 1
    return changed


def restore_rms_norms(model: nn.Module) -> int:
    """Inverse of `use_row_rms_norms`: every norm of `model` given the kernel gets its own class back. Returns the
    count."""
    changed = 0
    for module in model.modules():
        if isinstance(module, RowRMSNorm):
            module.__class__ = type(module).__bases__[1]
            changed += 1
    return changed

"""What quantize-on-load did, tensor by tensor: `LoadReport`, written by the weight op as the float tensors stream in
(`HfQuantQuantize.convert`) and read once loading is over (`HfQuantQuantizer._process_model_after_weight_loading`).

transformers turns an exception raised inside a conversion op into a generic RuntimeError that no longer names the
tensor, so the op records a failure here instead and the report raises it by name when the weights are in:

    report.failed["model.layers.0.mlp.down_proj.weight"] = "holds NaN ..."   # by the op
    report.raise_failures()   # ValueError naming that tensor and the fix
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hfquant.checkpoint.streaming import PageReleaser
from hfquant.core.huge_pages import Spares
from hfquant.integration.quantize_weights import GroupRows

__all__ = ["LoadReport"]


@dataclass
class LoadReport:
    """The record of one load.

    Attributes:
        pages: releases the checkpoint's pages as the tensors are consumed (sized by the checkpoint's files).
        quantized_keys: model keys of the float tensors quantized on load (`x.weight`, `experts.gate_up_proj`).
        failed: checkpoint key -> why quantizing it failed (a `ValueError`'s message: NaN/Inf weights, ...).
        out_of_memory: checkpoint keys whose quantization raised `MemoryError`, in load order.
        rows: the `GroupRows` the weight op writes decode groups' codes into (quantizing on load on the CPU), or None
            (each weight a tensor of its own); cleared once the kernels are prepared.
        spares: the `huge_pages.Spares` that make the quantized weights' maps resident ahead of their use (quantizing
            on load on the CPU), or None; closed once the weights are in.
    """

    pages: PageReleaser = field(default_factory=PageReleaser)
    quantized_keys: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    out_of_memory: list[str] = field(default_factory=list)
    rows: GroupRows | None = None
    spares: Spares | None = None

    def raise_failures(self) -> None:
        """Raise what the weight op recorded, out of memory first.

        Raises:
            MemoryError: a tensor's quantization ran out of memory (naming the first one, the count and the fixes).
            ValueError: a tensor could not be quantized (naming the first one, its reason, every failed key and the
                `modules_to_not_convert` entry that keeps its module in float).
        """
        if self.out_of_memory:
            raise MemoryError(
                f"out of memory while quantizing {self.out_of_memory[0]} ({len(self.out_of_memory)} tensor(s)): free "
                "memory, place part of the model elsewhere (device_map='auto' with max_memory=...), or quantize file to "
                "file with `hfquant convert`, which holds one tensor at a time, and load its output"
            )
        if self.failed:
            key, message = next(iter(self.failed.items()))
            module = key.rsplit(".", 1)[0]
            raise ValueError(
                f"hfquant could not quantize {key}: {message} ({len(self.failed)} tensor(s) failed: "
                f"{sorted(self.failed)}). Fix those weights in the checkpoint, or keep the module in float "
                f"with HfQuantConfig(modules_to_not_convert=[{module!r}])."
            )

    def raise_missing(self, expected: Iterable[str]) -> None:
        """Refuse a load that never quantized some of the `expected` model keys (`checks.weights_to_quantize`): their
        buffers still hold the uninitialized memory they were allocated with.

        Raises:
            ValueError: naming the first missing key, how many more, and the fixes.
        """
        never = sorted(set(expected) - self.quantized_keys)
        if never:
            more = f" and {len(never) - 1} more ({never})" if len(never) > 1 else ""
            raise ValueError(
                f"the checkpoint has no tensor for {never[0]}{more}, so hfquant had nothing to quantize into that "
                "layer (it would compute with uninitialized memory): use the complete float checkpoint, or keep "
                f"the module in float with HfQuantConfig(modules_to_not_convert=[{never[0].rpartition('.')[0]!r}])"
            )

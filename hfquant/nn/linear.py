"""`QuantLinear`: a weight-only quantized replacement for `nn.Linear` and transformers' GPT-2 `Conv1D`."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hfquant.core import blocks, packing, rtn, sinq
from hfquant.core.blocks import iq4
from hfquant.core.blocks.importance import stored_scale_importance
from hfquant.core.folding import Transform
from hfquant.core.format import Method, StoredFormat, require_format
from hfquant.nn import row_attention
from hfquant.ops import block_layout, gemv, kernels, native
from hfquant.ops.autograd import quantized_matmul_trainable
from hfquant.ops.gemv import RowKernel
from hfquant.ops.kernels import DecodeActivations, Kernel, KernelPlan, LayerTensors
from hfquant.ops.plan import plan_kernel

__all__ = ["KeepsStoredScales", "StoredWeight", "QuantLinear", "quantize_to_buffers"]

# Rows quantized per step: the float32 copy of one step stays under this many bytes.
_CHUNK_BYTES = 4 * 2**20


class KeepsStoredScales(nn.Module):
    """Base of hfquant's quantized modules: `module.to(dtype)` / `.half()` cast every float tensor, but the stored
    scales (persistent buffers named `*scale`) keep `rtn.SCALE_DTYPE`: their dtype is part of the stored format, which
    a save must write and a reload expects (kernels convert them to the activation dtype themselves)."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, tensor in self._buffers.items():
            if (
                tensor is not None
                and name.endswith("scale")
                and name not in self._non_persistent_buffers_set
                and tensor.is_floating_point()
                and tensor.dtype != rtn.SCALE_DTYPE
            ):
                self._buffers[name] = tensor.to(rtn.SCALE_DTYPE)
        return self


class StoredWeight(KeepsStoredScales):
    """Base of hfquant's quantized modules: a `format` (`StoredFormat`) and its stored tensors as registered buffers
    ("weight", "weight_scale" and, when asymmetric, "weight_zero_point"; `weight_zero_point` is None otherwise).

    Args:
        fmt: the stored format.
        rows: leading dimensions of the weight, (out_features,) for a layer or (num_embeddings,) for a table.
        in_features: the dimension the groups run along.
        device: where the (uninitialized) buffers are allocated.
    """

    def __init__(self, fmt: StoredFormat, rows: tuple[int, ...], in_features: int, device: torch.device | str | None):
        super().__init__()
        self.format = fmt
        self.weight_shape = (*rows, in_features)  # the float weight's shape: the codes are packed or padded
        for name, tensor in fmt.empty(rows, in_features, device).items():
            self.register_buffer(name, tensor)
        if fmt.symmetric:
            self.weight_zero_point = None

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def group_size(self) -> int:
        return self.format.group_size

    @property
    def symmetric(self) -> bool:
        return self.format.symmetric

    @property
    def quantized_parameters(self) -> int:
        """Weights the stored codes stand for (the float weight's element count; the codes are a buffer, not a
        parameter, so `named_parameters()` does not see them)."""
        return math.prod(self.weight_shape)


class QuantLinear(StoredWeight):
    """y = x @ dequantize(weight).T + bias, computed as the layer's kernel plan says (`plan`, a `KernelPlan` from
    `hfquant.ops.plan.plan_kernel`, made by `prepare_kernel`).

    Stored tensors (registered buffers; these are exactly what `state_dict()` and the files hold, see docs/format.md):
        weight, weight_scale[, weight_zero_point]: the tensors of `fmt` for a weight (out_features, in_features),
            as `StoredFormat.tensor_specs((out_features,), in_features)` names them (dtypes, shapes, nibble order).
        bias: (out_features,) float parameter, when the replaced layer had one.

    After `prepare_kernel()` the `weight` buffer may hold a kernel layout instead (for the CPU int4 kernel, the
    same bytes reordered); `state_dict()` always gives back the stored layout, bit for bit.

    `decode_activations` ("float" or "int8", `HfQuantConfig.decode_activations`; the quantizer sets it) chooses
    the W4A8 GEMV for single bfloat16 rows of a CPU int4 layer; setting it plans the layer again. `kernel` is the
    plan's `Kernel`.

    Args:
        in_features, out_features: as in `nn.Linear` (for a `Conv1D`, in_features = nx, out_features = nf).
        fmt: the stored format (bits, group size, symmetry); its group size must divide in_features (use
            `rtn.effective_group_size`). Read back as `format`, and `bits`, `group_size`, `symmetric`.
        bias: whether the layer has a bias.
        dtype: dtype of the bias and of the kernel-side scale tensors (the activation dtype).
        device: where the buffers are allocated ("meta" while transformers builds the model).
    Raises:
        ValueError: group_size does not divide in_features, or 4 bits with an odd in_features.
        TypeError: `fmt` is not a `StoredFormat`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: StoredFormat,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        require_format(fmt)
        if in_features % fmt.group_size:
            raise ValueError(f"group_size={fmt.group_size} does not divide in_features={in_features}")
        if fmt.bits == 4 and in_features % 2:
            raise ValueError(f"4-bit layers need an even in_features, got {in_features}")
        super().__init__(fmt, (out_features,), in_features, device)
        self.in_features = in_features
        self.out_features = out_features
        self._row = None  # the plan's eager one-row GEMV, bound (`_bind_row`)
        self._decode_group = None  # the `fused.DecodeGroup` this layer belongs to (`fused.link_decode_groups`)
        self._fused = None  # that group while it computes its members' rows together
        self._fused_index = 0  # this layer's place in it
        self.register_buffer("scale_zero", None, persistent=False)
        self.plan = self._unprepared_plan(DecodeActivations.FLOAT)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.compute_dtype = dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, fmt: StoredFormat) -> QuantLinear:
        """Quantize a float weight (out_features, in_features) into a new layer (kernel not yet prepared)."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, fmt, bias is not None, weight.dtype, "meta")
        for name, tensor in quantize_to_buffers(weight, fmt).items():
            setattr(layer, name, tensor)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    def extra_repr(self) -> str:
        if self.format.block is not None:
            return (
                f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.block}, "
                f"bias={self.bias is not None}, kernel={self.kernel}"
                + (f", method={self.format.method}" if self.format.method is not Method.RTN else "")
            )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, symmetric={self.symmetric}, bias={self.bias is not None}, "
            f"kernel={self.kernel}"
            + (f", method={self.format.method}" if self.format.method is not Method.RTN else "")
        )

    # -- the plan -----------------------------------------------------------------------------------------------

    @property
    def plan(self) -> KernelPlan:
        """The layer's `KernelPlan`. Setting it binds the plan's eager one-row GEMV once (`_bind_row`) and leaves
        any fused decode group (`hfquant.nn.fused`), which is formed again once every member is prepared."""
        return self._kernel_plan

    @plan.setter
    def plan(self, plan: KernelPlan) -> None:
        self._kernel_plan = plan
        self._bind_row()

    def _bind_row(self) -> None:
        """`_row`: the plan's eager GEMV of one bfloat16 row, bound (`gemv.row_function`), where the call needs
        nothing more than (x, weight, scale_zero) and no SINQ column scale: an int4 kernel with bfloat16 (scale, zero)
        pairs, or the block GEMV of a block format (`scale_zero` None); else None (`forward` takes the planned
        path)."""
        fused = self.__dict__.get("_fused")
        if fused is not None:
            fused.dissolve()
        scale_zero = self._buffers.get("scale_zero")
        self._row = self._row_for(self._kernel_plan, None if scale_zero is None else scale_zero.dtype)
        if self._row is not None and self._decode_group is not None:
            self._decode_group.build()

    def _row_for(self, plan: KernelPlan, scale_zero_dtype: torch.dtype | None):
        """The eager one-row GEMV `_bind_row` binds for `plan` with (scale, zero) pairs in `scale_zero_dtype` (None:
        the layer has none), or None."""
        if self._buffers.get("weight_col_scale") is not None:
            return None
        if plan.row is RowKernel.BLOCK_GEMV:
            return gemv.row_function(
                plan.row, plan.row_call, plan.group_size, plan.in_features, plan.block, plan.block_rows
            )
        if scale_zero_dtype == torch.bfloat16 and plan.kernel == Kernel.INT4PACK_MM_CPU:
            return gemv.row_function(plan.row, plan.row_call, plan.group_size)
        return None

    def planned_row(self, dtype: torch.dtype | None = None) -> tuple[KernelPlan, bool] | None:
        """What `prepare_kernel(dtype)` would give this layer now, the layer unchanged: (the `KernelPlan`, whether
        its one-row calls take a bound eager int4 GEMV), or None while the weight is on the meta device."""
        if self.weight.device.type == "meta":
            return None
        plan = self._plan(self.plan.activations, dtype or self._compute_dtype())
        sz_dtype = torch.bfloat16 if plan.kernel == Kernel.INT4PACK_MM_CUDA else (dtype or self._compute_dtype())
        return plan, self._row_for(plan, sz_dtype) is not None

    def __getstate__(self):
        # the bound GEMV is a closure and the group holds its siblings: neither is pickled (a copy binds its own)
        state = super().__getstate__().copy()
        state.update(_row=None, _fused=None, _decode_group=None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._bind_row()
        row_attention.register_attention()  # an unpickled model's config may name hfquant's one-row attention

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._bind_row()  # tensors moved or cast: a fused group's views are stale, the scale_zero dtype may differ
        return self

    @property
    def kernel(self) -> Kernel:
        """The matmul of the layer (`plan.kernel`; `Kernel.DEQUANT` until `prepare_kernel`)."""
        return self.plan.kernel

    @property
    def decode_activations(self) -> DecodeActivations:
        """ "float" or "int8" (a `DecodeActivations`, equal to its string)."""
        return self.plan.activations

    @decode_activations.setter
    def decode_activations(self, value: DecodeActivations | str) -> None:
        """Plan the prepared layer again for `value` ("float" or "int8"; ValueError otherwise). The same plan as
        before leaves the layer as it is (a fused decode group stays built: a load sets this on every layer)."""
        if self.plan.kernel == Kernel.DEQUANT:  # unprepared, or no one-row kernel to choose
            plan = dataclasses.replace(self.plan, activations=DecodeActivations(value))
        else:
            plan = self._plan(value)
        if plan != self.plan:
            self.plan = plan

    def _unprepared_plan(self, activations: DecodeActivations) -> KernelPlan:
        plan = kernels.plain_plan(Kernel.DEQUANT, self.format, self.in_features, self.out_features, "cpu")
        return dataclasses.replace(plan, activations=activations)

    def _plan(self, activations: DecodeActivations | str, dtype: torch.dtype | None = None) -> KernelPlan:
        """`plan_kernel` for this layer on its device and `dtype` (default: its compute dtype)."""
        return plan_kernel(
            self.format,
            self.in_features,
            self.out_features,
            self.weight.device,
            dtype or self._compute_dtype(),
            activations,
        )

    def _compute_dtype(self) -> torch.dtype:
        """The activation dtype the kernels are prepared for: `compute_dtype`, else the bias dtype, else bfloat16."""
        return self.compute_dtype or (self.bias.dtype if self.bias is not None else torch.bfloat16)

    # -- layouts ------------------------------------------------------------------------------------------------

    def _codes(self) -> torch.Tensor:
        """(N, K) unpacked codes, whatever layout `weight` is in (4 bits only)."""
        if self.kernel in kernels.INT4_KERNELS:
            return kernels.restore_codes(self.kernel, self.weight, self.out_features, self.in_features)
        return packing.unpack_int4(self.weight)

    def stored_weight(self) -> torch.Tensor:
        """The `weight` tensor in the stored (file) layout."""
        if self.kernel in kernels.INT4_KERNELS:
            return kernels.stored_int4(self.kernel, self.weight, self.out_features, self.in_features)
        plan = self.plan
        if plan.block_rows > 1:
            return block_layout.to_storage(self.weight, self.in_features, plan.block, plan.block_rows)
        return self.weight

    @torch.no_grad()
    def prepare_kernel(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> Kernel:
        """Plan the kernels for the current device (`plan_kernel`) and repack `weight` for the plan's kernel; returns
        the kernel.

        Idempotent: calling it again first restores the stored layout. `dtype` is the activation dtype the
        int4 scale/zero tensor is built in (default: the bias dtype, else bfloat16). `out`: a contiguous
        (out_features, in_features // 2) uint8 CPU tensor that a `Kernel.INT4PACK_MM_CPU` runtime weight is repacked
        straight into and that becomes `weight` (the layer's rows of its fused decode group's tensor,
        `hfquant.nn.fused.DecodeGroup.prepare`), or the stored `weight` itself: repacked in place (only for a weight
        nothing else reads, e.g. quantize-on-load's own; a block format's weight is interleaved in place then, where
        its plan takes the R8 layout, `hfquant.ops.block_layout`); unused for the other kernels. RuntimeError when it
        is not as above.
        """
        if self.weight.device.type == "meta":
            return self.kernel
        stored = self.stored_weight()
        activations = self.plan.activations
        self.plan = self._unprepared_plan(activations)
        self.scale_zero = None
        if dtype is not None:
            self.compute_dtype = dtype
        plan = self._plan(activations)
        kernel = plan.kernel
        if kernel in kernels.INT4_KERNELS:
            repack_into = out if kernel == Kernel.INT4PACK_MM_CPU else None
            self.weight = kernels.prepare_packed_int4(kernel, stored, self.in_features, out=repack_into)
            sz_dtype = torch.bfloat16 if kernel == Kernel.INT4PACK_MM_CUDA else self._compute_dtype()
            self.scale_zero = kernels.scale_zero_for_int4(self.weight_scale, self.weight_zero_point, sz_dtype)
        else:
            weight = kernels.prepare_weight(kernel, stored, self.in_features)
            in_place = out is not None and out.data_ptr() == weight.data_ptr()  # the load's own: nothing else reads it
            self.weight = block_layout.to_compute(weight, self.in_features, plan.block, plan.block_rows, in_place)
        self.plan = plan
        return kernel

    # -- state dict: always the stored layout ---------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight"
        if key in destination and (self.kernel != Kernel.DEQUANT or self.plan.block_rows > 1):
            destination[key] = self.stored_weight()
        weight = destination.get(key)
        if weight is not None and weight.untyped_storage().nbytes() > weight.numel() * weight.element_size():
            # a block format's rows of its fused decode group's tensor (`hfquant.nn.fused`): a save writes each
            # layer's own bytes, not views sharing one storage (safetensors refuses those, torch.save writes it all)
            destination[key] = weight.detach().clone()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Loading writes the stored layout into `weight`: forget any kernel layout first. A state dict holding none of
        # this layer's buffers (peft's `load_state_dict(adapter, strict=False)` visits every module) leaves the layer
        # and its prepared kernel as they are: dropping to the dequantize kernel there changed the model's numerics.
        if not any(prefix + name in state_dict for name in self._buffers):
            return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.kernel in kernels.INT4_KERNELS or self.plan.block_rows > 1:
            self.weight = self.stored_weight()
        self.plan = self._unprepared_plan(self.plan.activations)
        self.scale_zero = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- compute ------------------------------------------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (out_features, in_features) in `dtype` that this layer multiplies by."""
        if self.format.block is not None:
            weight = blocks.dequantize(self.format.block, self.stored_weight())
            col_scale = self._buffers.get("weight_col_scale")
            return (weight if col_scale is None else weight * col_scale.float()).to(dtype)
        codes = self._codes() if self.bits == 4 else self.weight
        col_scale = self._buffers.get("weight_col_scale")
        if col_scale is None:
            return rtn.dequantize_weight(
                codes, self.weight_scale, self.weight_zero_point, self.bits, self.symmetric, dtype
            )
        weight = rtn.dequantize_weight(
            codes, self.weight_scale, self.weight_zero_point, self.bits, self.symmetric, torch.float32
        )
        return (weight * col_scale.float()).to(dtype)

    @torch.no_grad()
    def dequantize_to_float(self, dtype: torch.dtype) -> nn.Module:
        """The float layer this one replaced, weights dequantized to `dtype`: `nn.Linear`, or GPT-2's `Conv1D`
        (weight stored (in_features, out_features)) when `transposed_source` is set."""
        weight = self.dequantize(dtype)
        if getattr(self, "transposed_source", False):
            layer = Conv1D(self.out_features, self.in_features).to(device=weight.device, dtype=dtype)
            layer.weight.copy_(weight.t())
            if self.bias is None:
                layer.bias = None
        else:
            layer = nn.Linear(
                self.in_features, self.out_features, bias=self.bias is not None, dtype=dtype, device=weight.device
            )
            layer.weight.copy_(weight)
        if self.bias is not None:
            layer.bias.copy_(self.bias)
        return layer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Eager decode (one contiguous bfloat16 row, no gradient): the plan's GEMV bound once (`_row`), or this
        # layer's rows of its fused group's one GEMV (`hfquant.nn.fused`); nothing else decided per call.
        if not torch.compiler.is_compiling():
            row = self._row
            if (
                row is not None
                and x.dtype is torch.bfloat16
                and x.numel() == self.in_features
                and not x.requires_grad
                and x.is_contiguous()
            ):
                fused = self._fused
                y = None if fused is None else fused.product(self._fused_index, x)
                if y is None:
                    buffers = self._buffers
                    y = row(x, buffers["weight"], buffers["scale_zero"])
                    dims = x.dim()
                    if dims != 2:
                        y = y.view(1, 1, self.out_features) if dims == 3 else y.view(*x.shape[:-1], self.out_features)
                bias = self._parameters.get("bias")
                if bias is not None:
                    y = y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))
                return y
        else:
            # A compiled graph: a block group's members share one operator call in the graph too (`fused`)
            fused = self._fused
            if (
                fused is not None
                and fused.in_graphs
                and x.dtype is torch.bfloat16
                and x.numel() == self.in_features
                and not x.requires_grad
            ):
                y = fused.graph_product(self._fused_index, x)
                if y is not None:
                    bias = self._parameters.get("bias")
                    if bias is not None:
                        y = y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))
                    return y
        return self._planned_forward(x)

    def _planned_forward(self, x: torch.Tensor) -> torch.Tensor:
        # Tensors straight from the module's dicts: nn.Module.__getattr__ falls back to a slow lookup per buffer, a
        # sizeable share of a small layer's decode call (docs/performance.md); accelerate's hooks swap tensors in
        # these same dicts.
        buffers = self._buffers
        # SINQ: w = dequantize(q) * c, so x @ w.T = (x * c) @ dequantize(q).T
        col_scale = buffers.get("weight_col_scale")
        if col_scale is not None:
            x = x * col_scale.to(x.dtype)
        # The int4 kernels take the (scale, zero) pairs of `scale_zero`; only the others and the backward read the
        # zero points. A tensor handed on is one torch.compile guards at every call (7 guards per layer), used or not.
        scale_zero = buffers.get("scale_zero")
        zero_point = None
        if scale_zero is None or (x.requires_grad and torch.is_grad_enabled()):
            zero_point = buffers.get("weight_zero_point")
        tensors = LayerTensors(buffers["weight"], buffers.get("weight_scale"), zero_point, scale_zero)
        y = quantized_matmul_trainable(self._kernel_plan, tensors, x)  # the inference kernel unless x requires grad
        bias = self._parameters.get("bias")
        if bias is not None:
            y = y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))  # (a no-op .to() costs more than the test)
        return y


def quantize_to_buffers(
    weight: torch.Tensor,
    fmt: StoredFormat,
    clipping: str = "minmax",
    fold: Transform | None = None,
    threads: int | None = None,
    weight_out: torch.Tensor | None = None,
    iq4_search: str = iq4.SEARCHES[0],
) -> dict[str, torch.Tensor]:
    """Float weight (N, K) -> its stored tensors in `fmt`: {"weight", "weight_scale"[, "weight_zero_point"]
    [, "weight_col_scale"]} as `fmt.tensor_specs((N,), K)` names them (the buffers of a `QuantLinear`).

    RTN works on row chunks so that the transient memory (float32 copy and unpacked codes) stays under about
    `_CHUNK_BYTES` whatever the size of the weight; on the CPU, where hfquant's native library loads, min/max RTN of a
    chunk runs in one C pass (`hfquant.ops.native.rtn_quantize`, the same bytes as the torch ops), of the whole
    weight at once when it is bfloat16 or float32 (no copy to bound: one call, not one per 4 MiB); `Method.SINQ` first
    computes the column scale c on a bfloat16 copy of the whole weight (`hfquant.core.sinq`) and quantizes w / c.
    `clipping` picks each group's range (`rtn.quantize_weight`: "minmax", or "mse" searched); it is not part of the
    stored format. `fold` (from `fold_column_scales`) rescales the weight's rows and columns first, chunk by chunk like
    the rest (in the C pass itself where it runs): the quantized weight is `hfquant.core.folding.apply(weight, fold)`'s.
    `threads`: the C RTN's OpenMP threads (None: torch's count); the bytes do not depend on it. `weight_out`: a
    contiguous tensor of the stored weight's dtype and shape on `weight`'s device to write the codes into (returned as
    "weight"; e.g. a layer's rows of its decode group's tensor, `quantize_weights.GroupRows`), None for a new one.
    `iq4_search`: the IQ4_NL / IQ4_XS blocks' search (`HfQuantConfig.iq4_search`, `iq4.SEARCHES`) where the native
    library runs them; without it the torch codec's ("exhaustive").

    Raises:
        ValueError: the weight holds NaN or Inf values.
        RuntimeError: `weight_out` is not as above.
    """
    require_format(fmt)
    n, k = weight.shape
    buffers = _stored_buffers(fmt, n, k, weight.device, weight_out)
    row_scale = None if fold is None or fold.row_scale is None else fold.row_scale.to(weight.device)
    col_scale = None if fold is None or fold.col_scale is None else fold.col_scale.to(weight.device)
    if fmt.method is Method.SINQ:
        if col_scale is not None or row_scale is not None:  # the fold's scales would need SINQ's folded too
            raise ValueError("a folded layer is stored with method 'rtn', not 'sinq'")
        # torch's steps, not `hfquant.ops.balance`'s C ones: a stored scale keeps the bytes it had (the C balancing
        # moved MiniLM's cosine from 0.9773 to 0.9770, docs/performance.md); the folds use the C balancing
        col_scale = sinq.column_scale(weight, fmt.group_size).to(weight.device)
        buffers["weight_col_scale"].copy_(col_scale)
    stored = buffers["weight"]
    if fmt.block is not None:
        stored_scale = fmt.method is Method.SINQ
        importance = None if fold is None else fold.importance
        _quantize_blocks(weight, fmt.block, stored, row_scale, col_scale, stored_scale, iq4_search, importance)
        return buffers
    _quantize_rtn(weight, fmt, buffers, clipping, row_scale, col_scale, threads)
    return buffers


def _quantize_rtn(weight, fmt: StoredFormat, buffers: dict, clipping: str, row_scale, col_scale, threads) -> None:
    """`quantize_to_buffers`' RTN of the "int" format into `buffers`: in C where it runs, else by torch's ops on row
    chunks of about `_CHUNK_BYTES`."""
    n, k = weight.shape
    stored = buffers["weight"]
    # the C quantizer gives the same bytes as rtn.quantize_weight + pack_int4 in one pass (tests/test_native_rtn.py)
    in_c = clipping == "minmax" and weight.device.type == "cpu" and native.built_library() is not None
    step = max(1, _CHUNK_BYTES // (4 * k))
    if in_c and weight.dtype in (torch.bfloat16, torch.float32):
        step = n  # the C pass reads the weight as it is and writes the outputs in place: no transient memory to bound
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        chunk = weight[rows]
        if in_c:
            if not chunk.is_floating_point():
                raise ValueError(f"expected a float weight, got {weight.dtype}")
            if chunk.dtype not in (torch.bfloat16, torch.float32):
                chunk = chunk.float()  # exact, as rtn.quantize_weight's own float32 copy
            zero_point = buffers.get("weight_zero_point")
            # written straight into the layer's rows (contiguous): no chunk-sized temporaries, no copy; a fold's
            # factors are applied in the same pass, in the float32 operations of the torch lines below
            native.rtn_quantize(
                chunk,
                fmt.bits,
                fmt.group_size,
                fmt.symmetric,
                out=(stored[rows], buffers["weight_scale"][rows], None if zero_point is None else zero_point[rows]),
                row_scale=None if row_scale is None else row_scale[rows].float(),
                col_scale=None if col_scale is None else col_scale.float(),
                threads=threads,
            )
            continue
        if row_scale is not None:
            chunk = chunk.float() * row_scale[rows, None]
        if col_scale is not None:
            chunk = chunk.float() / col_scale
        q = rtn.quantize_weight(chunk, fmt.bits, fmt.group_size, fmt.symmetric, clipping)
        stored[rows] = packing.pack_int4(q.q) if fmt.bits == 4 else q.q
        buffers["weight_scale"][rows] = q.scale
        if q.zero_point is not None:
            buffers["weight_zero_point"][rows] = q.zero_point


def _stored_buffers(
    fmt: StoredFormat, n: int, k: int, device: torch.device, weight_out: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """`fmt.empty((n,), k, device)`, with `weight_out` as "weight" when given (RuntimeError unless it is a contiguous
    tensor of that buffer's dtype and shape on `device`)."""
    if weight_out is None:
        return fmt.empty((n,), k, device)
    specs = fmt.tensor_specs((n,), k)
    dtype, shape = specs["weight"]
    if weight_out.dtype != dtype or tuple(weight_out.shape) != shape or not weight_out.is_contiguous():
        raise RuntimeError(
            f"quantize_to_buffers: weight_out must be a contiguous {dtype} tensor of shape {shape}, got "
            f"{weight_out.dtype} {tuple(weight_out.shape)}"
        )
    if weight_out.device != torch.device(device):
        raise RuntimeError(f"quantize_to_buffers: weight_out is on {weight_out.device}, the weight on {device}")
    return {
        name: weight_out if name == "weight" else torch.empty(shape, dtype=dtype, device=device)
        for name, (dtype, shape) in specs.items()
    }


def _iq4_in_one_pass(weight: torch.Tensor, block: str, stored: torch.Tensor, type_rule: bool, iq4_search: str) -> bool:
    """Whether `_quantize_blocks` quantizes the whole weight in one C pass (`native.iq4_quantize_fold`: the fold's
    scales applied by each search thread, no float32 chunks): an IQ4 type by a C search, a contiguous bfloat16 or
    float32 CPU weight and stored rows, and no importance computed from the rescaled weight (`type_rule`: a stored
    SINQ scale's type rule, which the chunked path computes per chunk; IQ4's is uniform, but the rule is the
    type's to give)."""
    return (
        block in ("iq4_nl", "iq4_xs")
        and str(iq4_search) in native.IQ4_SEARCHES  # not "exhaustive" (the torch codec's); a bad name: the ValueError
        and not type_rule
        and weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and weight.is_contiguous()
        and stored.is_contiguous()
        and native.built_library() is not None
    )


def _quantize_blocks(
    weight: torch.Tensor,
    block: str,
    stored: torch.Tensor,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    stored_scale: bool = False,
    iq4_search: str = iq4.SEARCHES[0],
    importance: torch.Tensor | None = None,
) -> None:
    """Quantize the float weight (N, K), rows times `row_scale` and columns divided by `col_scale` when given, into
    `stored` (N, row bytes) uint8 blocks of type `block` (`blocks.quantize`), a chunk of rows at a time; `stored_scale`
    (SINQ's `col_scale` kept beside the layer, not a fold's) searches with the type's importance for such layers
    (`blocks.importance.stored_scale_importance`); `iq4_search` is the C search's for IQ4 types (`iq4.SEARCHES`);
    `importance` (K,) float32 >= 0, each column's weight in the search of the rescaled weight (a fold's
    `Transform.importance`), replaces the type's rule when given. The C search takes OpenMP's default threads even
    while a fold worker folds beside the load (where the RTN takes one fewer, `quantizer._rtn_threads`): it is the
    load's longest stage and the worker, two blocks ahead, waits for it most of the time (measured on the 1.2B:
    the same CPU seconds, within noise, and the idle core used; docs/performance.md, issue #32, twelfth session).

    IQ4 layers by a C search skip the chunks (`_iq4_in_one_pass`): each search thread folds its own groups of blocks
    (`native.iq4_quantize_fold`), so the copy, the scales and the search of the weight are one parallel pass, the same
    bytes (docs/performance.md, issue #32, thirteenth session). Elsewhere each chunk is converted into one float32
    buffer reused for every chunk and rescaled in place (the same float32 operations as new tensors per step, without
    their allocations and page faults; with the C library in one pass, `native.fold_chunk`), checked for NaN / Inf once
    after the scales, and the C search writes its rows of `stored` directly (docs/performance.md, issue #32, twelfth
    session).

    Raises:
        ValueError: the weight is not float, or holds NaN or Inf values.
    """
    n, k = weight.shape
    if not weight.is_floating_point():
        raise ValueError(f"expected a float weight, got {weight.dtype}")
    if _iq4_in_one_pass(weight, block, stored, stored_scale and importance is None, iq4_search):
        row_f = None if row_scale is None else row_scale.float().contiguous()
        col_f = None if col_scale is None else col_scale.float().contiguous()
        search = native.IQ4_SEARCHES[str(iq4_search)]
        if not native.iq4_quantize_fold(block, weight, row_f, col_f, importance, search, stored):
            raise ValueError("cannot quantize a weight that contains NaN or Inf values")
        return
    step = max(1, _CHUNK_BYTES // (4 * k))
    in_c = block in native.BLOCK_QUANTIZE_TYPES and weight.device.type == "cpu" and native.built_library() is not None
    buffer = torch.empty((min(step, n), k), dtype=torch.float32, device=weight.device)
    in_one_pass = in_c and weight.dtype in (torch.bfloat16, torch.float32) and weight.is_contiguous()
    if in_one_pass:
        row_scale = None if row_scale is None else row_scale.float().contiguous()
        col_scale = None if col_scale is None else col_scale.float().contiguous()
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        chunk = buffer[: rows.stop - start]
        chunk_importance = importance  # None: the type's data-free default
        if in_one_pass:  # the copy, the scales and the check below in one C pass (`native.fold_chunk`)
            finite = native.fold_chunk(weight[rows], None if row_scale is None else row_scale[rows], col_scale, chunk)
        else:
            chunk.copy_(weight[rows])
            if row_scale is not None:
                chunk.mul_(row_scale[rows, None])
            if col_scale is not None:
                chunk.div_(col_scale)
            finite = rtn.value_range(chunk)[2]
        if not finite:  # NaN / Inf pass through the finite scales (or overflow from them)
            raise ValueError("cannot quantize a weight that contains NaN or Inf values")
        if stored_scale and importance is None:
            chunk_importance = stored_scale_importance(block, chunk)  # the type's rule for stored SINQ scales
        if in_c:  # the same search in C, split over threads (csrc/blocks_quant_cpu.c, csrc/iq4_search_cpu.c)
            target = stored[rows]
            out = target if target.is_contiguous() else None
            codes = native.block_quantize(block, chunk, chunk_importance, iq4_search, out=out, finite=True)
            if out is None:
                target.copy_(codes)
        else:
            stored[rows] = blocks.quantize(block, chunk, chunk_importance)

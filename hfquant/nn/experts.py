"""`QuantExperts`: int8 / int4 mixture-of-experts weights held as fused 3-D tensors (transformers 5 experts modules).

transformers 5 models such as Mixtral and Qwen2-MoE keep all experts of a layer in two 3-D parameters,
`gate_up_proj` (E, 2 * I, H) and `down_proj` (E, H, I), merged at load time from the per-expert checkpoint tensors.
`QuantExperts` stores each of them as E stacked `QuantLinear` weights (rows = output features, groups along the input
features) and runs the same routing loop as the float module, one expert at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from hfquant.core import packing, rtn
from hfquant.core.format import StoredFormat, require_format
from hfquant.nn.linear import KeepsStoredScales, quantize_to_buffers
from hfquant.ops import kernels
from hfquant.ops.autograd import quantized_matmul_trainable
from hfquant.ops.kernels import Kernel, LayerTensors

__all__ = ["QuantExperts", "experts_layout", "quantize_experts_tensor", "EXPERT_PROJECTIONS"]

EXPERT_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")
"""Names of the 3-D expert parameters `QuantExperts` quantizes."""


def experts_layout(module: nn.Module) -> tuple[dict[str, tuple[int, int, int]], str]:
    """{projection name: (E, N, K)} of a transformers experts module, and "" or why it cannot be quantized.

    Supported: 3-D `gate_up_proj` (or `up_proj`) and `down_proj` in the (experts, out, in) orientation, gate and up
    concatenated, no expert biases: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3 and the other families using
    `use_experts_implementation` with its defaults.
    """
    shapes = {}
    for name in EXPERT_PROJECTIONS:
        param = module._parameters.get(name)
        if param is not None and param.dim() == 3:
            shapes[name] = tuple(param.shape)
    if "down_proj" not in shapes or not ({"gate_up_proj", "up_proj"} & set(shapes)):
        return {}, "no 3-D gate_up_proj/up_proj and down_proj parameters"
    if getattr(module, "is_transposed", False):
        return shapes, "expert weights stored transposed (in, out)"
    if getattr(module, "has_bias", False) or any(
        module._parameters.get(f"{name}_bias") is not None for name in EXPERT_PROJECTIONS
    ):
        return shapes, "expert biases"
    if not getattr(module, "is_concatenated", True):
        return shapes, "gate and up interleaved"
    if not hasattr(module, "act_fn"):
        return shapes, "no act_fn"
    return shapes, ""


def quantize_experts_tensor(weight: torch.Tensor, fmt: StoredFormat) -> dict[str, torch.Tensor]:
    """Float (E, N, K) -> {"": codes, "_scale": scales[, "_zero_point": zero points]} in `fmt`, each with a leading E
    dim (`fmt.tensor_specs((E, N), K)`).

    Rows of all experts are quantized independently (groups run along K), so this is `quantize_to_buffers` on the
    (E * N, K) view, in the same bounded row chunks.
    """
    e, n, k = weight.shape
    buffers = quantize_to_buffers(weight.reshape(e * n, k), fmt)
    return {suffix: buffers[key].reshape(e, n, -1) for key, suffix in _BUFFER_SUFFIXES.items() if key in buffers}


_BUFFER_SUFFIXES = {"weight": "", "weight_scale": "_scale", "weight_zero_point": "_zero_point"}


class QuantExperts(KeepsStoredScales):
    """The experts of one MoE layer with int8 / int4 weights; same call as the float module it replaces.

    Stored tensors, for P in (`gate_up_proj` or `up_proj`, `down_proj`) of float shape (E, N, K): P, P_scale[,
    P_zero_point], the tensors `formats[P].tensor_specs((E, N), K)` names weight, weight_scale[, weight_zero_point]
    (e.g. at 4 bits: P (E, N, K // 2) uint8, P_scale (E, N, K // group_size) bfloat16).
    In the files each expert's slice is saved as that expert's own Linear (e.g. Mixtral `experts.3.w1.weight`,
    `.weight_scale`, `.weight_zero_point`): the model's conversion mapping splits the fused tensors on save and merges
    them on load, as it does for float checkpoints (docs/format.md).

    Matmul per expert: `_weight_int8pack_mm` for int8 symmetric per-channel where `kernels.select_kernel` allows it,
    else dequantize the expert's weight and `F.linear` (int4 kernels would need a repacked copy per expert).

    Args:
        source: the float experts module (on the meta device); kept, unregistered, for its gate function and
            attributes and to rebuild it in `dequantize_to_float`.
        shapes: {projection: (E, N, K)} from `experts_layout`.
        formats: {projection: its stored format}, one bit width and symmetry for all (the group size, dividing the
            projection's K, may differ). Read back as `formats`, and `bits`, `symmetric`, `group_sizes`.
        dtype: compute dtype.
    Raises:
        ValueError: `formats` does not cover `shapes`, or mixes bit widths or symmetries.
    """

    def __init__(
        self,
        source: nn.Module,
        shapes: dict[str, tuple[int, int, int]],
        formats: dict[str, StoredFormat],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = "meta",
    ):
        super().__init__()
        if set(formats) != set(shapes):
            raise ValueError(f"formats for {sorted(formats)} given, but the projections are {sorted(shapes)}")
        if len({(require_format(f).bits, f.symmetric) for f in formats.values()}) > 1:
            raise ValueError(f"the projections of one experts module share bits and symmetric; got {formats}")
        self.formats = dict(formats)
        self.shapes = dict(shapes)
        self.num_experts = next(iter(shapes.values()))[0]
        self.compute_dtype = dtype
        self.act_fn = source.act_fn
        self.has_gate = "gate_up_proj" in shapes
        object.__setattr__(self, "_source", source)  # not a submodule: no state_dict keys, no parameters
        for name, (e, n, k) in shapes.items():
            for key, tensor in formats[name].empty((e, n), k, device).items():  # NAME, NAME_scale[, NAME_zero_point]
                self.register_buffer(name + key.removeprefix("weight"), tensor)

    @property
    def bits(self) -> int:
        return next(iter(self.formats.values())).bits

    @property
    def symmetric(self) -> bool:
        return next(iter(self.formats.values())).symmetric

    @property
    def quantized_parameters(self) -> int:
        """Weights the stored codes stand for: sum of E * N * K over the projections."""
        return sum(e * n * k for e, n, k in self.shapes.values())

    @property
    def group_sizes(self) -> dict[str, int]:
        """{projection: group size}."""
        return {name: fmt.group_size for name, fmt in self.formats.items()}

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{name}={tuple(shape)}" for name, shape in self.shapes.items())
        return f"{shapes}, bits={self.bits}, group_sizes={self.group_sizes}, symmetric={self.symmetric}"

    def stored_names(self) -> list[str]:
        """Names of the stored tensors (the keys this module adds to a state dict)."""
        names = []
        for name in self.shapes:
            names += [name + key.removeprefix("weight") for key in self.formats[name].tensor_names()]
        return names

    # -- compute ---------------------------------------------------------------------------------------------------

    def _expert_tensors(self, name: str, expert: int):
        codes = getattr(self, name)[expert]
        scale = getattr(self, f"{name}_scale")[expert]
        zero_point = None if self.symmetric else getattr(self, f"{name}_zero_point")[expert]
        return codes, scale, zero_point

    def _project(self, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        _, n, k = self.shapes[name]
        fmt = self.formats[name]
        codes, scale, zero_point = self._expert_tensors(name, expert)
        kernel = kernels.select_kernel(fmt, in_features=k, out_features=n, device=codes.device)
        if kernel != Kernel.INT8PACK_MM:
            kernel = Kernel.DEQUANT
        plan = kernels.plain_plan(kernel, fmt, k, n, codes.device.type)  # cached: no one-row GEMVs for experts
        return quantized_matmul_trainable(plan, LayerTensors(codes, scale, zero_point), x)

    def dequantize(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float (E, N, K) tensor of projection `name` in `dtype`."""
        e, n, k = self.shapes[name]
        codes = getattr(self, name).reshape(e * n, -1)
        if self.bits == 4:
            codes = packing.unpack_int4(codes)
        scale = getattr(self, f"{name}_scale").reshape(e * n, -1)
        zero_point = None if self.symmetric else getattr(self, f"{name}_zero_point").reshape(e * n, -1)
        return rtn.dequantize_weight(codes, scale, zero_point, self.bits, self.symmetric, dtype).reshape(e, n, k)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        apply_gate = getattr(type(self._source), "_apply_gate", None)
        for expert in expert_hit[:, 0].tolist():
            if expert == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert])
            h = self._project(up_name, expert, hidden_states[token_idx])
            if self.has_gate:
                h = apply_gate(self._source, h) if apply_gate is not None else _gate(self.act_fn, h)
            else:
                h = self.act_fn(h)
            h = self._project("down_proj", expert, h)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final

    @torch.no_grad()
    def dequantize_to_float(self, dtype: torch.dtype) -> nn.Module:
        """The float experts module this one replaced, with the dequantized weights in `dtype`."""
        source = self._source
        device = next(iter(self.buffers())).device
        for name in self.shapes:
            setattr(source, name, nn.Parameter(self.dequantize(name, dtype).to(device), requires_grad=False))
        return source


def _gate(act_fn, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up

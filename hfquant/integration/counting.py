"""Parameter counts that include hfquant's quantized weights.

transformers' `PreTrainedModel.num_parameters()` and peft's `PeftModel.get_nb_trainable_parameters()` (behind
`print_trainable_parameters()`) sum `numel()` over `named_parameters()`. hfquant stores a quantized weight as buffers
(packed codes, scales, zero points), so those counts saw only the float parameters: an int4 SmolLM2-135M reported
28M of its 135M. Both methods have a special case for bitsandbytes' `Params4bit` only, and neither has a hook a
quantizer can fill, so hfquant sets them on the model instances it returns: the count adds each quantized module's
`quantized_parameters` (the float weight's element count) once, tied weights once.

    model.num_parameters()                       # the float model's count
    model.num_parameters(only_trainable=True)    # the quantized weights are frozen: not added
"""

from __future__ import annotations

from torch import nn

from hfquant.core.binding import bind

__all__ = ["quantized_weight_count", "count_quantized_weights", "count_quantized_weights_in_peft"]


def quantized_weight_count(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Weights held by hfquant's quantized modules of `model` (QuantLinear, QuantEmbedding, QuantExperts), each
    stored tensor counted once (a tied lm_head and embedding share theirs; a tied copy's tensors are non-persistent
    buffers, counted under the module holding them, also before loading shares them). `exclude_embeddings` leaves out
    quantized embedding tables, as `num_parameters(exclude_embeddings=True)` leaves out `nn.Embedding` weights."""
    from hfquant.nn.embedding import QuantEmbedding

    seen: set[int] = set()
    total = 0
    for module in model.modules():
        count = getattr(module, "quantized_parameters", None)
        if not isinstance(count, int) or "weight" in module._non_persistent_buffers_set:
            continue  # a tied copy (lm_head, tied embedding) reads its source's tensor: counted there, also on meta
        stored = next(iter(module.buffers(recurse=False)), None)
        key = id(stored) if stored is not None else id(module)
        if key in seen:
            continue
        seen.add(key)  # an excluded embedding's tied lm_head is excluded with it, as transformers' count does
        if not (exclude_embeddings and isinstance(module, QuantEmbedding)):
            total += count
    return total


def _num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """`PreTrainedModel.num_parameters`, plus the frozen quantized weights unless `only_trainable`."""
    count = type(self).num_parameters(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    return count if only_trainable else count + quantized_weight_count(self, exclude_embeddings)


def count_quantized_weights(model: nn.Module) -> None:
    """Make `model.num_parameters()` count hfquant's quantized weights (see the module docstring)."""
    model.num_parameters = bind(_num_parameters, model)


def _nb_trainable_parameters(self) -> tuple[int, int]:
    """peft's `(trainable, all)` counts, the frozen quantized weights added to `all`."""
    trainable, total = type(self).get_nb_trainable_parameters(self)
    return trainable, total + quantized_weight_count(self)


def count_quantized_weights_in_peft(peft_model: nn.Module) -> None:
    """Make a `PeftModel`'s `get_nb_trainable_parameters()` / `print_trainable_parameters()` count hfquant's
    quantized weights in "all params"."""
    peft_model.get_nb_trainable_parameters = bind(_nb_trainable_parameters, peft_model)

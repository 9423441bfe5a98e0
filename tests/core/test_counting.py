"""`num_parameters()` and peft's parameter counts include hfquant's quantized weights (stored as buffers), as they
would the float weights they replace (issue #17: an int4 SmolLM2-135M reported 28M of its 135M)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig
from hfquant.integration.counting import quantized_weight_count
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.linear import QuantLinear

CONFIGS = {
    "int8": dict(bits=8),
    "int4": dict(bits=4, group_size=32),
    "int4-embeddings": dict(bits=4, group_size=32, embedding_dtype="int8"),
}


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_num_parameters_counts_quantized_weights_like_the_float_model(float_checkpoint, arch, name):
    path = float_checkpoint(arch)
    reference = AutoModelForCausalLM.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=HfQuantConfig(**CONFIGS[name]))
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
    assert quantized and quantized_weight_count(model) > 0
    assert type(model).num_parameters(model) < reference.num_parameters()  # what transformers alone reports
    assert model.num_parameters() == reference.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == reference.num_parameters(exclude_embeddings=True)
    # frozen quantized weights are not trainable ones
    assert model.num_parameters(only_trainable=True) == type(model).num_parameters(model, only_trainable=True)


def test_peft_counts_equal_a_float_model_with_the_same_lora(float_checkpoint):
    peft = pytest.importorskip("peft")
    import hfquant.peft

    path = float_checkpoint("llama")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=HfQuantConfig(bits=4, group_size=32))
    peft_model = hfquant.peft.get_peft_model(model, config)
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert trainable > 0 and (trainable, total) == reference.get_nb_trainable_parameters()

"""hfquant: weight-only int8/int4 quantization for Hugging Face transformers, applied while checkpoints stream in.

`import hfquant` registers `quant_method="hfquant"` with transformers, so that
`AutoModelForCausalLM.from_pretrained(path, quantization_config=hfquant.HfQuantConfig(bits=4))` quantizes on load
and `from_pretrained(saved_path)` reloads a saved quantized checkpoint.
"""

from hfquant.config import FORMAT_VERSION, QUANT_METHOD, HfQuantConfig
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import QuantExperts
from hfquant.nn.linear import QuantLinear
from hfquant.integration.registration import register
from hfquant.integration.quantizer import HfQuantQuantizer

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "HfQuantConfig",
    "HfQuantQuantizer",
    "QuantEmbedding",
    "QuantExperts",
    "QuantLinear",
    "register",
]
__version__ = "0.1.0"

register()

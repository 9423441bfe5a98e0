"""hfquant: weight-only int8/int4 quantization for Hugging Face transformers, applied while checkpoints stream in.

`import hfquant` registers `quant_method="hfquant"` with transformers, so that
`AutoModelForCausalLM.from_pretrained(path, quantization_config=hfquant.HfQuantConfig(bits=4))` quantizes on load
and `from_pretrained(saved_path)` reloads a saved quantized checkpoint. It also makes `push_to_hub` of the models it
loads send hfquant's model card (`hfquant.publishing.hub.attach_model_card`).

The package is layered, imports pointing only downward (docs/architecture.md): `core` (math, stored format) ->
`ops` (kernels) -> `nn` (modules) -> `checkpoint` (files) -> `integration` (transformers hooks) -> the library users
call (`conversion`, `inspection`, `verification`, `evaluation`) -> `publishing` (cards, Hub) -> `commands` (the CLI).
"""

from hfquant.config import FORMAT_VERSION, QUANT_METHOD, HfQuantConfig
from hfquant.conversion.convert import convert
from hfquant.conversion.export import export_checkpoint
from hfquant.conversion.gguf_import import convert_gguf, from_gguf
from hfquant.conversion.importing import import_checkpoint
from hfquant.evaluation import evaluate
from hfquant.integration.generation import compile_decoding
from hfquant.integration.quantizer import HfQuantQuantizer, register
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import QuantExperts
from hfquant.nn.linear import QuantLinear
from hfquant.publishing.hub import attach_model_card
from hfquant.version import __version__

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "HfQuantConfig",
    "HfQuantQuantizer",
    "QuantEmbedding",
    "QuantExperts",
    "QuantLinear",
    "register",
    "compile_decoding",
    "convert",
    "export_checkpoint",
    "from_gguf",
    "convert_gguf",
    "import_checkpoint",
    "evaluate",
    "__version__",
]

register()
if attach_model_card not in HfQuantQuantizer.loaded_model_hooks:
    HfQuantQuantizer.loaded_model_hooks += (attach_model_card,)

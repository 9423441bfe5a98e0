"""What a benchmark run compares, shared by the benchmark's driver and workers, the paired rounds and the llama.cpp
rows: the methods and their `from_pretrained` arguments, the decode prompt, the sizes of a full and a quick run, and
the environment of a worker process. Imports nothing else from `benchmarks/`."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = [
    "METHODS",
    "BLOCK_FORMATS",
    "BLOCK_TWINS",
    "PIP_HINT",
    "DECODE_PROMPT",
    "FULL",
    "QUICK",
    "quantization_config",
    "load_kwargs",
    "use_compiled_decode",
    "worker_env",
]

# name -> (module a peer needs, or None; what it is)
METHODS: dict[str, tuple[str | None, str]] = {
    "bf16": (None, "no quantization"),
    "hfquant-int8": (None, "HfQuantConfig(bits=8): per-channel symmetric int8"),
    "hfquant-4bit": (
        None,
        "HfQuantConfig(bits=4): the 4-bit default (IQ4_XS blocks after the SINQ fold, BOS importance, int8 lm_head)",
    ),
    "hfquant-int4": (
        None,
        "HfQuantConfig(bits=4, group_size=128): the int format's 4-bit defaults (SINQ, asymmetric, data-free mixed "
        "precision, int8 lm_head; the 4-bit default before IQ4_XS)",
    ),
    "hfquant-int4-rtn": (
        None,
        "HfQuantConfig(bits=4, group_size=128, method='rtn', mixed_precision='none'): plain "
        "round-to-nearest, every layer int4",
    ),
    "hfquant-int4-sym": (
        None,
        "HfQuantConfig(bits=4, group_size=128, symmetric=True, method='rtn', "
        "mixed_precision='none'): the weights llama.cpp's Q4_0 holds exactly",
    ),
    "hfquant-int4-a8": (
        None,
        "hfquant-int4 with decode_activations='int8': W4A8 decode steps (int8 activations per "
        "block of 32, as llama.cpp's Q4 kernels)",
    ),
    "hfquant-int4-sym-a8": (
        None,
        "hfquant-int4-sym with decode_activations='int8': the weights and the activation rounding of llama.cpp's Q4_0",
    ),
    "hfquant-3.5bit": (None, "HfQuantConfig(bits=3.5): HQ3_R 3-bit blocks under a 3.5-bit budget (mixed precision)"),
    "hfquant-int4-lm8": (
        None,
        "hfquant-int4 with lm_head='int8': the output layer per-channel int8 (tied to the input embedding, both); "
        "the 4-bit int default's own lm_head since issue #32, so the same as hfquant-int4, kept for earlier figures",
    ),
    "torchao-int8": ("torchao", "TorchAoConfig(Int8WeightOnlyConfig())"),
    "torchao-int4": (
        "torchao",
        "TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=128)): Int4OpaqueTensor, "
        "_weight_int4pack_mm_for_cpu (torchao 0.18's CPU int4 layout)",
    ),
    "quanto-int8": ("optimum.quanto", "QuantoConfig(weights='int8')"),
    "quanto-int4": ("optimum.quanto", "QuantoConfig(weights='int4')"),
    "bnb-int8": ("bitsandbytes", "BitsAndBytesConfig(load_in_8bit=True)"),
    "bnb-nf4": ("bitsandbytes", "BitsAndBytesConfig(load_in_4bit=True, nf4, bf16 compute)"),
    "llamacpp-q8_0": (
        "llama.cpp",
        "llama-cpp-python on hfquant-int8's weights as GGUF Q8_0 (benchmarks/llama_cpp.py)",
    ),
    "llamacpp-q4_0": ("llama.cpp", "llama-cpp-python on hfquant-int4-sym's weights as GGUF Q4_0"),
    "llamacpp-q4_1": ("llama.cpp", "llama-cpp-python on hfquant-int4-rtn's weights as GGUF Q4_1"),
    "llamacpp-int4": ("llama.cpp", "llama-cpp-python on hfquant-int4's weights (Q4_1, its int8 layers Q8_0)"),
    "llamacpp-4bit": (
        "llama.cpp",
        "llama-cpp-python on hfquant-4bit's weights (IQ4_XS blocks copied, IQ4_NL where 256 does not divide a row, "
        "the int8 lm_head as Q8_0)",
    ),
}
BLOCK_FORMATS = (
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "iq4_nl",
    "iq4_xs",
    "hq3_0",
    "hq3_nl",
    "hq3_r",
)
"""The block formats with an `hfquant-<format>` method: `HfQuantConfig(format=<format>)` (its defaults: SINQ folded,
every layer in that format, the lm_head kept)."""
METHODS.update(
    {
        f"hfquant-{fmt}": (None, f"HfQuantConfig(format={fmt!r}): every Linear in GGUF's {fmt.upper()} blocks")
        for fmt in BLOCK_FORMATS
    }
)
METHODS["hfquant-iq4_xs-lm8"] = (
    None,
    "hfquant-iq4_xs with lm_head='int8': issue #32's candidate 4-bit default (IQ4_XS layers, per-channel int8 head)",
)
BLOCK_TWINS = {
    (f"llamacpp-{fmt}-blocks" if f"llamacpp-{fmt}" in METHODS else f"llamacpp-{fmt}"): f"hfquant-{fmt}"
    for fmt in BLOCK_FORMATS
    if not fmt.startswith("hq3")  # hfquant's own, no GGUF type
}
"""llama.cpp method -> the hfquant block method whose file it runs (exported blocks are copies); `-blocks` where the
plain name already runs the uniform int format's re-blocked twin (Q4_0, Q8_0)."""
METHODS.update(
    {
        name: ("llama.cpp", f"llama-cpp-python on {twin}'s blocks as they are in GGUF")
        for name, twin in BLOCK_TWINS.items()
    }
)
PIP_HINT = "pip install 'hfquant[bench]'"
DECODE_PROMPT = "The history of the Roman Empire begins"
FULL = {
    "prefill_tokens": 512,
    "prefill_repeats": 3,
    "decode_tokens": 64,
    "decode_repeats": 3,
    "ppl_tokens": None,
    "bandwidth_mib": 1024,
    "bandwidth_repeats": 5,
}
QUICK = {
    "prefill_tokens": 32,
    "prefill_repeats": 1,
    "decode_tokens": 8,
    "decode_repeats": 1,
    "ppl_tokens": 128,
    "bandwidth_mib": 64,
    "bandwidth_repeats": 2,
}


def _installed(module: str) -> bool:
    """Whether ``module`` (dotted names too, e.g. ``optimum.quanto``) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def quantization_config(method: str):
    """The ``quantization_config`` argument of ``from_pretrained`` for ``method`` (None for bf16).

    Raises:
        ValueError: unknown method.
        ImportError: the peer library is missing (message gives the pip command).
    """
    import torch

    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose from {', '.join(METHODS)}")
    requires = METHODS[method][0]
    if requires == "llama.cpp":
        raise ValueError(f"{method} runs in llama.cpp, not through from_pretrained (benchmarks/llama_cpp.py)")
    if requires is not None and not _installed(requires):
        raise ImportError(f"{method} needs {requires}, which is not installed: {PIP_HINT}")
    if method == "bf16":
        return None
    if method.startswith("hfquant-") and method.endswith("-lm8"):
        config = quantization_config(method.removesuffix("-lm8"))
        config.lm_head = "int8"
        return config
    if method.startswith("hfquant-") and method.endswith("-a8"):
        config = quantization_config(method.removesuffix("-a8"))
        config.decode_activations = "int8"
        return config
    if method.startswith("hfquant-"):
        import hfquant

        if method.removeprefix("hfquant-") in BLOCK_FORMATS:
            return hfquant.HfQuantConfig(format=method.removeprefix("hfquant-"))
        if method == "hfquant-int8":
            return hfquant.HfQuantConfig(bits=8)
        if method == "hfquant-4bit":
            return hfquant.HfQuantConfig(bits=4)
        if method == "hfquant-3.5bit":
            return hfquant.HfQuantConfig(bits=3.5)
        if method == "hfquant-int4-rtn":
            return hfquant.HfQuantConfig(bits=4, group_size=128, method="rtn", mixed_precision="none")
        if method == "hfquant-int4-sym":
            return hfquant.HfQuantConfig(bits=4, group_size=128, symmetric=True, method="rtn", mixed_precision="none")
        return hfquant.HfQuantConfig(bits=4, group_size=128)
    if method.startswith("torchao-"):
        from transformers import TorchAoConfig

        if method == "torchao-int8":
            from torchao.quantization import Int8WeightOnlyConfig

            return TorchAoConfig(Int8WeightOnlyConfig())
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=128))
    if method.startswith("quanto-"):
        from transformers import QuantoConfig

        return QuantoConfig(weights=method.removeprefix("quanto-"))
    from transformers import BitsAndBytesConfig

    if method == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


def load_kwargs(method: str, variant: str) -> dict:
    """The keyword arguments of the worker's `from_pretrained` for `method` and `variant` ("eager" or "compile"):
    bfloat16 on the CPU, the method's quantization config, and eager attention for "compile" (see the module
    docstring)."""
    import torch

    kwargs = {"dtype": torch.bfloat16, "device_map": "cpu"}
    if variant == "compile":
        kwargs["attn_implementation"] = "eager"
    config = quantization_config(method)
    if config is not None:
        kwargs["quantization_config"] = config
    return kwargs


def use_compiled_decode(model) -> None:
    """Set up the README's fast path on `model`: `hfquant.compile_decoding` (a static cache and
    `CompileConfig(fullgraph=True)` in its generation config, with transformers' switch for compiling on CPU, and eager
    attention), so that `generate` runs the decode steps through the compiled forward."""
    from hfquant import compile_decoding

    compile_decoding(model)


def worker_env(root: Path | None = None) -> dict:
    """The environment of an hfquant worker process: this one's, with a source tree first on PYTHONPATH (the child
    imports benchmarks/ from there, it is never installed, and hfquant from there too): `root`, by default this
    repository's."""
    tree = str(root if root is not None else Path(__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))

"""Small, deterministic quality and speed measurements for causal LMs on CPU.

* :func:`reference_text` - a fixed English text shipped with CPython itself
  (no download needed).
* :func:`perplexity` - sliding-window causal-LM perplexity.
* :func:`decode_perplexity` - perplexity scored one token at a time through the KV cache (decode steps).
* :func:`decode_tokens_per_second` - greedy batch-1 decode throughput, prefill excluded.
* :func:`generate_answer` - greedy answer to a prompt, through the chat template when present.
* :func:`evaluate` - perplexity and decode speed of a checkpoint (and of a float baseline), loaded one at a time:
  what ``hfquant eval`` measures and records for the model card.

Every function runs the model under :func:`torch.inference_mode` and leaves the
model in the train/eval mode it found it in.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import time
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from hfquant.checkpoint.source import resolve_source
from hfquant.core.dtypes import dtype_name
from hfquant.core.format import format_name
from hfquant.nn.float_linear import FloatLinear, plain_linear
from hfquant.ops import machine
from hfquant.ops.vml_dispatch import resolve_vml_dispatch

logger = logging.get_logger(__name__)

__all__ = [
    "reference_text",
    "perplexity",
    "decode_perplexity",
    "decode_tokens_per_second",
    "generate_answer",
    "evaluate",
    "DEFAULT_REFERENCE_CHARS",
    "DEFAULT_PROMPT",
]

DEFAULT_REFERENCE_CHARS = 24_000
"""Characters of `reference_text()` by default, and the slice `evaluate` (`hfquant eval`) scores unless told
otherwise: about 5.6k tokens with the SmolLM2 tokenizer, 11 windows of 512 tokens (the whole corpus is about 465k
characters, some 200 windows per model)."""
_REFERENCE_SEPARATOR = "\n\n"
DEFAULT_PROMPT = "The Python language reference describes"
"""Prompt of the decode-speed measurement of `evaluate` (`hfquant eval`)."""


def reference_text(n_chars: int = DEFAULT_REFERENCE_CHARS, offset: int = 0) -> str:
    """A fixed slice of English prose from CPython's own documentation.

    The text is built from :data:`pydoc_data.topics.topics` (the Python
    language reference topics used by ``help()``): the topic texts are joined in
    sorted-key order with blank lines, and ``[offset:offset + n_chars]`` is
    returned.  It needs no download and is identical on every run and machine
    with the same CPython minor version (the topics change between Python
    releases, so compare perplexities only within one interpreter version).

    Args:
        n_chars: number of characters (Unicode code points) to return; must be > 0.
        offset: start character in the joined text; must be >= 0.

    Returns:
        A ``str`` of exactly ``n_chars`` characters.

    Raises:
        ValueError: ``n_chars <= 0``, ``offset < 0``, or the requested slice runs
            past the end of the corpus (about 465k characters on Python 3.11).
        ImportError: the interpreter was built without ``pydoc_data``.
    """
    if n_chars <= 0:
        raise ValueError(f"n_chars must be positive, got {n_chars}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    corpus = _reference_corpus()
    if offset + n_chars > len(corpus):
        raise ValueError(
            f"Requested characters [{offset}, {offset + n_chars}) but the reference corpus has only {len(corpus)}"
        )
    return corpus[offset : offset + n_chars]


def _reference_corpus() -> str:
    """The whole text `reference_text` slices: the pydoc topics joined in sorted-key order with blank lines."""
    return _REFERENCE_SEPARATOR.join(topics[key] for key in sorted(topics))


def _bar(total: int, desc: str, unit: str, progress: bool | None):
    """A tqdm bar on stderr; `progress` None follows transformers' switch
    (`transformers.utils.logging.disable_progress_bar`), False or True forces it off or on."""
    enabled = logging.is_progress_bar_enabled() if progress is None else progress
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """Eval mode, and the model's plain `nn.Linear` layers as `FloatLinear` for the duration (restored after): where
    the CPU has no bfloat16 GEMM (`machine.gemm_dtype`), a bfloat16 model's whole-window products then run in float32
    and are rounded back to bfloat16, the same values up to summation order, instead of PyTorch's scalar bfloat16
    loop (about 20x slower on an AVX2 CPU; a bf16 baseline's perplexity otherwise takes tens of minutes). Only
    `float_linear.plain_linear` layers change (not another library's quantized ones, e.g. torchao's). MKL's VML kernels
    are chosen first (`resolve_vml_dispatch`): a model loaded without hfquant's quantizer (a bf16 baseline) then scores
    the same in every process."""
    resolve_vml_dispatch()
    was_training = model.training
    model.eval()
    plain = [
        module
        for module in model.modules()
        if plain_linear(module)
        and machine.gemm_dtype(module.weight.dtype, module.weight.device) != module.weight.dtype
    ]
    for module in plain:
        module.__class__ = FloatLinear
    try:
        yield
    finally:
        for module in plain:
            module.__class__ = torch.nn.Linear
        model.train(was_training)


def _model_device(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _encode(tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids of ``text`` as a 1-D int64 tensor (tokenizer's default special tokens)."""
    enc = tokenizer(text, return_tensors="pt")
    return enc["input_ids"][0].to(torch.long)


def _windows(seq_len: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, first, end) of each window of `perplexity`: it reads tokens [begin, end) and scores [first, end), each
    scored token with at least one token of context and none scored twice."""
    windows = []
    prev_end = 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        first = max(prev_end, begin + 1)
        if first < end:
            windows.append((begin, first, end))
        prev_end = end
        if end == seq_len:
            break
    return windows


def perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    text: str,
    max_length: int = 512,
    stride: int = 512,
    max_tokens: int | None = None,
    progress: bool | None = None,
    desc: str = "perplexity",
) -> float:
    """Sliding-window perplexity of a causal LM on ``text``.

    The text is tokenized once (with the tokenizer's default special tokens,
    e.g. a BOS token if it adds one) and optionally truncated to the first
    ``max_tokens`` tokens.  Windows of at most ``max_length`` tokens start every
    ``stride`` tokens; in each window only the tokens not already scored by the
    previous window are scored, each conditioned on the tokens before it in
    the same window (the usual Hugging Face recipe).  With ``stride ==
    max_length`` (default) the windows do not overlap and the first token of
    each window is not scored.  The result is
    ``exp(sum of token negative log-likelihoods / number of scored tokens)``,
    with log-softmax computed in float32.  Batch size 1, no sampling, under
    :func:`torch.inference_mode`: repeated calls give the same value.

    Cost: about ``ceil(n_tokens / stride)`` forward passes of ``max_length``
    tokens (the default reference text is ~5.6k tokens, ~7 s for a 135M bf16
    model on 2 cores).

    Args:
        model: a ``*ForCausalLM`` model returning ``.logits`` of shape
            ``(1, seq, vocab)``.
        tokenizer: the matching tokenizer (callable returning ``input_ids``).
        text: the evaluation text.
        max_length: window length in tokens (> 1).
        stride: step between window starts in tokens (1 <= stride <= max_length).
        max_tokens: score only the first ``max_tokens`` tokens; ``None`` = all.
        progress: a tqdm bar over the windows on stderr; ``None`` follows transformers' switch
            (``transformers.utils.logging.disable_progress_bar``).
        desc: the bar's label.

    Returns:
        The perplexity as a Python ``float`` (>= 1 up to rounding; ``inf`` if
        a token gets zero probability).

    Raises:
        ValueError: invalid window arguments, or fewer than 2 tokens to score.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride must be in [1, max_length={max_length}], got {stride}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 or None, got {max_tokens}")

    ids = _encode(tokenizer, text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    seq_len = ids.numel()
    if seq_len < 2:
        raise ValueError(f"Need at least 2 tokens to compute perplexity, the text has {seq_len}")
    ids = ids.to(_model_device(model))

    windows = _windows(seq_len, max_length, stride)
    nll_sum = 0.0
    n_scored = 0
    with _eval_mode(model), torch.inference_mode(), _bar(len(windows), desc, "window", progress) as bar:
        for begin, first, end in windows:
            window = ids[begin:end].unsqueeze(0)
            logits = model(input_ids=window, use_cache=False).logits
            # logits[:, j] predicts window token j + 1.
            pred = logits[0, first - begin - 1 : end - begin - 1].float()
            target = window[0, first - begin : end - begin]
            nll_sum += F.cross_entropy(pred, target, reduction="sum").item()
            n_scored += end - first
            bar.update()
    if n_scored == 0:
        raise ValueError("No token was scored; use more text or a larger max_length")
    return math.exp(nll_sum / n_scored)


def decode_perplexity(model: torch.nn.Module, tokenizer: Any, text: str, max_tokens: int = 512) -> float:
    """Perplexity of a causal LM on the first ``max_tokens`` tokens of ``text``, fed one token per forward pass through
    a KV cache, as decoding runs: every product is a one-row decode step, so this scores what decode-only settings
    change (``HfQuantConfig(decode_activations="int8")``), which :func:`perplexity`'s whole windows never reach.

    Token ``i`` is scored from the logits of the step that fed token ``i - 1`` (all tokens but the first);
    ``exp(mean negative log-likelihood)``, log-softmax in float32, batch 1, under :func:`torch.inference_mode`.
    Cost: ``max_tokens`` forward passes (about 8 s for 512 tokens of SmolLM2-135M on 2 cores).

    Args:
        model: a ``*ForCausalLM`` model that takes a ``cache`` and returns ``.logits`` (1, 1, vocab).
        tokenizer: the matching tokenizer.
        text: the evaluation text.
        max_tokens: tokens fed (>= 2); fewer when the text is shorter.

    Returns:
        The perplexity as a Python ``float``.

    Raises:
        ValueError: ``max_tokens < 2`` or fewer than 2 tokens in the text.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    ids = _encode(tokenizer, text)[:max_tokens]
    if ids.numel() < 2:
        raise ValueError(f"Need at least 2 tokens to compute perplexity, the text has {ids.numel()}")
    ids = ids.to(_model_device(model))
    from transformers import DynamicCache

    nll_sum = 0.0
    with _eval_mode(model), torch.inference_mode():
        cache = DynamicCache(config=model.config)
        for i in range(ids.numel() - 1):
            logits = model(input_ids=ids[i : i + 1].unsqueeze(0), cache=cache, use_cache=True).logits
            nll_sum += F.cross_entropy(logits[0, -1:].float(), ids[i + 1 : i + 2], reduction="sum").item()
    return math.exp(nll_sum / (ids.numel() - 1))


def _generation_kwargs(tokenizer: Any, model: torch.nn.Module) -> dict:
    """Greedy settings that also silence "pad_token_id not set" warnings."""
    kwargs: dict[str, Any] = {"do_sample": False}
    gen_cfg = getattr(model, "generation_config", None)
    if getattr(gen_cfg, "pad_token_id", None) is None:
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        if pad is not None:
            kwargs["pad_token_id"] = pad
    # Greedy decoding: drop sampling knobs so generate() does not warn about them.
    kwargs.update(temperature=None, top_p=None, top_k=None)
    return kwargs


class _TimingStreamer:
    """Minimal ``generate(streamer=...)`` consumer recording when each step arrives.

    ``generate`` calls ``put`` once with the prompt ids, then once per decoding
    step with the new token(s), then ``end``.
    """

    def __init__(self, on_token: Any = None) -> None:
        self.times: list[float] = []
        self._saw_prompt = False
        self._on_token = on_token

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        self.times.append(time.perf_counter())  # first, so that the bar's drawing is not timed
        if self._on_token is not None:
            self._on_token()

    def end(self) -> None:
        pass


def decode_tokens_per_second(
    model: torch.nn.Module,
    tokenizer: Any,
    prompt: str,
    new_tokens: int = 64,
    repeats: int = 3,
    warmup: bool = True,
    progress: bool | None = None,
    desc: str = "decode speed",
) -> float:
    """Greedy batch-1 decode throughput in generated tokens per second, prefill excluded.

    ``model.generate`` runs with ``do_sample=False`` and
    ``max_new_tokens = new_tokens`` and ``eos_token_id=None`` (so nothing stops it early: no EOS check, as in
    llama.cpp's token loop; ``min_new_tokens`` would mask the EOS logit over the whole vocabulary at every step,
    0.43 ms per step on SmolLM2-135M, a cost of the measurement rather than of decoding)
    and a streamer that timestamps every generated token.  The first token comes
    out of the prefill pass over the prompt, so the clock starts when it arrives:
    the rate is ``(new_tokens - 1) / (t_last_token - t_first_token)``, i.e. pure
    decode steps (each a forward pass of one token with the KV cache, plus the
    per-step overhead of ``generate``).  The best (highest) rate of ``repeats``
    runs is returned; ``warmup`` adds one untimed short run first.

    Args:
        model: a causal LM supporting ``generate``.
        tokenizer: the matching tokenizer.
        prompt: raw prompt text (no chat template applied).
        new_tokens: tokens generated per run (>= 2).
        repeats: timed runs (>= 1).
        warmup: do an untimed ``min(new_tokens, 8)``-token run first.
        progress: a tqdm bar over the generated tokens of every run (warm-up included) on stderr; ``None`` follows
            transformers' switch.
        desc: the bar's label.

    Returns:
        Tokens per second as a Python ``float``.

    Raises:
        ValueError: ``new_tokens < 2``, ``repeats < 1`` or an empty prompt encoding.
        RuntimeError: ``generate`` did not produce ``new_tokens`` tokens.
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (one prefill token + decode tokens), got {new_tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    enc = tokenizer(prompt, return_tensors="pt")
    if enc["input_ids"].numel() == 0:
        raise ValueError("The prompt encodes to zero tokens")
    device = _model_device(model)
    inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    gen_kwargs = _generation_kwargs(tokenizer, model)

    total = (min(new_tokens, 8) if warmup else 0) + repeats * new_tokens
    bar = _bar(total, desc, "token", progress)

    def run(n: int) -> _TimingStreamer:
        streamer = _TimingStreamer(bar.update)
        model.generate(**inputs, **gen_kwargs, eos_token_id=None, max_new_tokens=n, streamer=streamer)
        return streamer

    best = 0.0
    with _eval_mode(model), torch.inference_mode(), bar:
        if warmup:
            run(min(new_tokens, 8))
        for i in range(repeats):
            streamer = run(new_tokens)
            if len(streamer.times) != new_tokens:
                raise RuntimeError(f"generate produced {len(streamer.times)} tokens instead of {new_tokens}")
            elapsed = streamer.times[-1] - streamer.times[0]
            rate = (new_tokens - 1) / elapsed if elapsed > 0 else math.inf
            logger.debug("decode run %d: %.2f tok/s", i, rate)
            best = max(best, rate)
    return best


def generate_answer(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy answer of ``model`` to ``prompt``.

    When the tokenizer has a chat template the prompt is sent as a single user
    message with the generation prompt appended; otherwise the raw prompt is
    used.  Decoding is greedy (``do_sample=False``) and stops at EOS or after
    ``max_new_tokens`` tokens.

    Args:
        model: a causal LM supporting ``generate``.
        tokenizer: the matching tokenizer.
        prompt: the question / instruction text.
        max_new_tokens: upper bound on generated tokens (>= 1).

    Returns:
        Only the newly generated text, special tokens removed, stripped of
        surrounding whitespace.

    Raises:
        ValueError: ``max_new_tokens < 1``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    device = _model_device(model)
    inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    with _eval_mode(model), torch.inference_mode():
        out = model.generate(**inputs, **_generation_kwargs(tokenizer, model), max_new_tokens=max_new_tokens)
    new_ids = out[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_ids, skip_special_tokens=True).strip()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Files of which a folder holding a tokenizer has at least one (fast, slow SentencePiece, or BPE tokenizers)."""


def _tokenizer_folder(folder: Path, tokenizer: str | os.PathLike | None) -> Path:
    """Where the tokenizer of the model in `folder` is read: `tokenizer` when given (a folder or a Hub repo id), else
    `folder` itself.

    Raises:
        FileNotFoundError: `folder` has none of TOKENIZER_FILES and no `tokenizer` was given (transformers would
            blame a missing sentencepiece or tiktoken instead: it then tries to convert a slow tokenizer there is
            none of).
    """
    if tokenizer is not None:
        return resolve_source(tokenizer)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer files in {folder} (none of {', '.join(TOKENIZER_FILES)}); pass --tokenizer FOLDER_OR_REPO "
            "(tokenizer= from Python) naming the tokenizer of the model it was made from, or copy those files into it"
        )
    return folder


def _kind(qconfig: dict | None, dtype: str) -> str:
    """What a measured row's label says a model is: "hfquant int8" / "hfquant int4" for hfquant's integer formats,
    "hfquant iq4_xs" (the config's `format`) for a block format, else the float `dtype`."""
    if not qconfig or qconfig.get("quant_method") != "hfquant":
        return dtype
    return f"hfquant {format_name(qconfig.get('format', 'int'), qconfig['bits'])}"


def _measured_row(
    source: str | os.PathLike, role: str, text: str, prompt: str, settings: dict
) -> tuple[dict[str, Any], int]:
    """One model's row of `evaluate` and the tokens of `text` it scores: loaded from `source` on the CPU, measured,
    and released. `settings`: max_tokens, max_length, new_tokens, repeats, progress, tokenizer.

    Raises:
        ValueError: not a causal LM.
        FileNotFoundError: no tokenizer in the folder, and none given.
    """
    folder = resolve_source(source)
    config = AutoConfig.from_pretrained(folder)
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures or []):
        raise ValueError(f"{source} is a {config.architectures}, not a causal LM; eval measures causal LMs only")
    qconfig = getattr(config, "quantization_config", None)
    qconfig = qconfig if isinstance(qconfig, dict) else (qconfig.to_dict() if qconfig is not None else None)
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_folder(folder, settings.get("tokenizer")))
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()
    tokens = int(tokenizer(text, return_tensors="pt")["input_ids"].shape[1])
    tokens = min(tokens, settings["max_tokens"]) if settings["max_tokens"] else tokens
    dtype = dtype_name(model.dtype)
    label = f"{'this model' if role == 'quantized' else Path(str(source)).name} ({_kind(qconfig, dtype)})"
    logger.info("measuring %s", label)
    max_length = settings["max_length"]
    row = {
        "label": label,
        # a folder's name, never its absolute path: this file is meant for the Hub, not machine-specific
        "path": Path(str(source)).expanduser().name if Path(str(source)).expanduser().exists() else str(source),
        "perplexity": perplexity(
            model,
            tokenizer,
            text,
            max_length=max_length,
            stride=max_length,
            max_tokens=settings["max_tokens"],
            progress=settings["progress"],
            desc=f"perplexity, {label}",
        ),
        "tokens_per_second": decode_tokens_per_second(
            model,
            tokenizer,
            prompt,
            new_tokens=settings["new_tokens"],
            repeats=settings["repeats"],
            progress=settings["progress"],
            desc=f"decode speed, {label}",
        ),
    }
    del model
    gc.collect()
    return row, tokens


def evaluate(
    path: str | os.PathLike,
    baseline: str | os.PathLike | None = None,
    text_file: str | os.PathLike | None = None,
    max_tokens: int | None = None,
    max_length: int = 512,
    new_tokens: int = 64,
    repeats: int = 3,
    prompt: str = DEFAULT_PROMPT,
    max_chars: int | None = DEFAULT_REFERENCE_CHARS,
    progress: bool | None = None,
    tokenizer: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Perplexity and decode tokens/s of the causal LM `path` (and of `baseline`), one model in memory at a time:
    `perplexity` on the first `max_chars` characters of `text_file` (default: CPython's pydoc topics, the text of
    `reference_text`) in windows of `max_length` tokens, and `decode_tokens_per_second` of `prompt`. `path` and
    `baseline` are local folders or Hub repo ids; each model's tokenizer is read from its folder, or from `tokenizer`
    (a folder or repo id) when given.

    Args:
        max_chars: characters of the text scored, from its start (default `DEFAULT_REFERENCE_CHARS`, 11 windows of
            512 tokens with the SmolLM2 tokenizer); None scores all of it (the pydoc topics: about 465k characters,
            some 200 windows per model).
        progress: tqdm bars (per perplexity window, per generated token) on stderr; None follows transformers'
            switch (`transformers.utils.logging.disable_progress_bar`).

    Returns a JSON-native dict: text (what was scored, with its slice), characters (scored), tokens, max_length,
    new_tokens, device, and results (one row per model: label, path, perplexity, tokens_per_second).

    Raises:
        ValueError: a model is not a causal LM, `max_chars` < 1, or the text is too short.
        OSError: a path or the text file cannot be read; FileNotFoundError naming a folder without tokenizer files
            when `tokenizer` is None.
    """
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be >= 1 or None (the whole text), got {max_chars}")
    if text_file is not None:
        text = Path(text_file).read_text(encoding="utf-8")
        name = f"`{Path(text_file).name}`"
    else:
        text = _reference_corpus()
        name = f"CPython's `pydoc_data.topics` (Python {platform.python_version()})"
    if max_chars is None or max_chars >= len(text):
        text_name = f"{name}, all {len(text)} characters"
    else:
        text_name = f"{name}, first {max_chars} of {len(text)} characters"
        text = text[:max_chars]
    settings = dict(
        max_tokens=max_tokens,
        max_length=max_length,
        new_tokens=new_tokens,
        repeats=repeats,
        progress=progress,
        tokenizer=tokenizer,
    )
    measured = [
        _measured_row(source, role, text, prompt, settings)
        for role, source in (("quantized", path), ("baseline", baseline))
        if source is not None
    ]
    return {
        "text": text_name,
        "characters": len(text),
        "tokens": measured[0][1],  # as the quantized model's tokenizer counts them
        "max_length": max_length,
        "new_tokens": new_tokens,
        "device": f"CPU ({torch.get_num_threads()} threads, torch {torch.__version__})",
        "results": [row for row, _ in measured],
    }

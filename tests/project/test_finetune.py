"""scripts/finetune.py as a tool: a few LoRA steps on a user's text over a tiny quantized Llama, the adapter published
whole in the folder named, and loaded back over the same quantized model; its refusals before any work."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "finetune.py"


@pytest.fixture(scope="module")
def finetune():
    spec = importlib.util.spec_from_file_location("finetune_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llama(float_checkpoint):
    path = float_checkpoint("llama", torch.bfloat16, vocab_size=257)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from hfquant.evaluation import reference_text

    path = tmp_path_factory.mktemp("data") / "notes.txt"
    path.write_text(reference_text(1500), encoding="utf-8")
    return path


def test_finetune_writes_an_adapter_that_reloads_over_the_quantized_model(finetune, llama, text_file, tmp_path, capfd):
    from transformers import AutoModelForCausalLM

    import hfquant.peft
    from hfquant import HfQuantConfig

    out = tmp_path / "adapter"
    argv = ["--model", str(llama), "--data", str(text_file), "--out", str(out), "--steps", "3", "--seq-len", "32"]
    argv += ["--batch", "2", "--rank", "4", "--target-modules", "q_proj,v_proj", "--bits", "8", "--no-progress"]
    assert finetune.main(argv) == 0
    printed = capfd.readouterr()
    assert f"wrote {out}: 3 steps" in printed.out and "%|" not in printed.err  # --no-progress: no bar
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # staged beside it, renamed, nothing left
    assert {"adapter_config.json", "adapter_model.safetensors", "finetune.json"} <= {p.name for p in out.iterdir()}
    record = json.loads((out / "finetune.json").read_text())
    assert (record["steps"], record["lora"]["r"], record["lora"]["target_modules"]) == (3, 4, ["q_proj", "v_proj"])
    assert record["quantization_config"]["bits"] == 8 and record["mean_training_loss"] > 0

    qconfig = HfQuantConfig(**{k: v for k, v in record["quantization_config"].items() if k != "quant_method"})
    base = AutoModelForCausalLM.from_pretrained(llama, quantization_config=qconfig, dtype=torch.bfloat16)
    ids = torch.arange(0, 40).reshape(1, 40)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    tuned = hfquant.peft.load_adapter(base, str(out))
    wrapped = {name.partition(".lora_B")[0] for name, _ in tuned.named_parameters() if "lora_B" in name}
    assert wrapped and all(name.endswith(("q_proj", "v_proj")) for name in wrapped)
    # lora_B starts at zero: nonzero values are the trained ones, read back from the folder
    assert any(p.abs().max() > 0 for name, p in tuned.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        assert not torch.equal(tuned(input_ids=ids).logits, plain)

    # an existing --out is refused before any training, and kept
    before = (out / "finetune.json").read_bytes()
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        finetune.main(argv)
    assert (out / "finetune.json").read_bytes() == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "compare", "--data", "x.txt"], "--preset compare has fixed settings; --data apply"),
        (["--data", "x.txt"], "fine-tuning needs --data (the text) and --out"),
        (["--data", "x.txt", "--out", "a", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["--data", "x.txt", "--out", "a", "--eval-seqs", "-1"], "--eval-seqs must be >= 0, got -1"),
    ],
)
def test_finetune_refuses_bad_arguments(finetune, argv, message, capsys):
    with pytest.raises(SystemExit):
        finetune.main(argv)
    assert message in capsys.readouterr().err


def test_finetune_reads_rows_of_a_jsonl_file_and_names_a_missing_column(finetune, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "first row"}\n\n{"text": "second", "id": 2}\n', encoding="utf-8")
    assert finetune.load_texts(str(data)) == ["first row", "second"]
    with pytest.raises(SystemExit, match=r"row 0 of .*rows.jsonl has no column 'body' \(it has \['text'\]\)"):
        finetune.load_texts(str(data), text_column="body")

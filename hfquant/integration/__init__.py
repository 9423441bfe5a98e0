"""Layer 4, transformers integration: the `HfQuantizer` hooks and their registration (`quantizer`), what a load
decides before the weights (`load_plan`, with `embeddings` and `folding`) and records while they stream in
(`load_report`, the tensors made by `quantize_weights`), the checks around a load (`checks`), `dequantize`,
transformers' checkpoint key renaming (`conversions`) and the meta-device model skeleton (`skeleton`). The only code
that imports transformers' private loading modules. Never imports the commands (Hub, cards, CLI)."""

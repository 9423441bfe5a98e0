"""Layer 4, transformers integration: the `HfQuantizer` hooks and their registration (`quantizer`), transformers'
checkpoint key renaming (`conversions`) and the meta-device model skeleton (`skeleton`). The only code that imports
transformers' private loading modules. Never imports the commands (Hub, cards, CLI)."""

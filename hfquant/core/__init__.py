"""Layer 0, the math: round-to-nearest quantization (`rtn`), int4 packing (`packing`) and the stored format of a
quantized weight (`format`). Plain torch; imports nothing from the rest of hfquant but `hfquant.config`."""

"""Layer 1, the matmuls: which kernel runs a quantized layer (`kernels`) and hfquant's own C kernels (`native`).
Imports only `hfquant.core`."""

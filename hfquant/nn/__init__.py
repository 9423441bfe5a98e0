"""Layer 2, the modules: `QuantLinear`, `QuantEmbedding`, `QuantExperts`, `FloatLinear`, norm dtype adapters, and
swapping them into a (meta-device) model (`replace`). Imports `hfquant.core` and `hfquant.ops`."""

"""Layer 5, checkpoint folders made from checkpoint folders, file to file and published atomically: `convert` (a float
checkpoint quantized tensor by tensor, `jobs` running the quantization in this process or in workers), `export`
(an hfquant checkpoint as compressed-tensors pack-quantized, or as one GGUF file through `export_gguf`) and
`importing` (compressed-tensors pack-quantized as an hfquant checkpoint). `hfquant.convert`,
`hfquant.export_checkpoint` and `hfquant.import_checkpoint` are its entry points."""

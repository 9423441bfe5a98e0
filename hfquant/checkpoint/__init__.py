"""Layer 3, checkpoint files: the only code that reads or writes them. Reading safetensors (`files`: `safe_open`,
one dtype table, the index, file names), the stored-tensor schema (`schema`), sha256 sums (`checksums`), atomic
publishing of folders (`publish`) and releasing read pages (`streaming`). Imports the layers below."""

"""Layer 3, checkpoint files: the only code that reads or writes them. Reading safetensors (`files`: `safe_open`,
one dtype table, the index, file names), the stored-tensor schema (`schema`), sha256 sums (`checksums`), atomic
publishing of folders (`publish`) and releasing read pages (`streaming`); for checkpoints written file to file, the
output shards (`sharding`), the small files copied along (`copying`), where a source comes from (`source`: a folder
or a Hub download) and its config.json checked (`model_config`). Imports the layers below."""

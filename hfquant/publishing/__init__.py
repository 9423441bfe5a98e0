"""Layer 6, putting a checkpoint in front of people: its model card (`cards`: huggingface_hub's `ModelCard` from the
Jinja template and the folder's files, sizes from `hfquant.inspection`) and the Hub (`hub`: one commit per push, and
`push_to_hub` of a loaded model with the card)."""

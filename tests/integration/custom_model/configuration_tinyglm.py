"""Config of TinyGLM, a ChatGLM-shaped test model loaded with trust_remote_code=True (no weights are committed)."""

from transformers import PretrainedConfig


class TinyGLMConfig(PretrainedConfig):
    model_type = "tinyglm"

    def __init__(
        self,
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=128,
        layernorm_epsilon=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.ffn_hidden_size = ffn_hidden_size
        self.layernorm_epsilon = layernorm_epsilon
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

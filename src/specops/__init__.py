"""specops: evaluate speculative-decoding drafters against the target SGLang serves."""

__version__ = "0.1.0"

"""Text in and out: tokenizers, chat templates, sampling."""

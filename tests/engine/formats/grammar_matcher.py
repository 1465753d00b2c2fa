"""llama.cpp's own grammar sampler over a real vocabulary, as a yes/no matcher of texts."""

from __future__ import annotations

import ctypes

import numpy as np


class VocabGrammars:
    """A vocabulary loaded alone (no weights) to compile grammars and feed them tokens."""

    def __init__(self, path: str):
        import llama_cpp

        self.llama = llama_cpp
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp could not read the vocabulary of {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self._one = (llama_cpp.llama_token_data * 1)()
        self._arr = llama_cpp.llama_token_data_array(data=self._one, size=1, selected=-1, sorted=False)

    def close(self) -> None:
        """Free the vocabulary."""
        self.llama.llama_model_free(self.model)

    def compile(self, grammar):
        """llama.cpp's sampler for the grammar (asserts that llama.cpp parsed it)."""
        sampler = self.llama.llama_sampler_init_grammar(self.vocab, grammar.gbnf.encode(), grammar.root.encode())
        assert sampler, "llama.cpp could not parse the grammar:\n" + grammar.gbnf
        return sampler

    def tokens(self, text: str) -> list[int]:
        """text's tokens, special tokens parsed."""
        data = text.encode()
        out = (self.llama.llama_token * (len(data) + 8))()
        n = self.llama.llama_tokenize(self.vocab, data, len(data), out, len(out), False, True)
        assert n >= 0
        return list(out[:n])

    def accepts(self, grammar, text: str) -> bool:
        """Whether the grammar admits text token by token (a prefix of a longer sentence counts)."""
        sampler = self.compile(grammar)
        try:
            for token in self.tokens(text):
                self._one[0].id, self._one[0].logit, self._one[0].p = token, 0.0, 0.0
                self._arr.size, self._arr.selected = 1, -1
                self.llama.llama_sampler_apply(sampler, ctypes.byref(self._arr))
                if not np.isfinite(self._one[0].logit):
                    return False
                self.llama.llama_sampler_accept(sampler, token)
            return True
        finally:
            self.llama.llama_sampler_free(sampler)

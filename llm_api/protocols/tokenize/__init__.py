"""vLLM's tokenizer routes (``tokenize``, ``detokenize``, ``tokenizer_info``): ``schema``, ``translate``
(the contract), ``encoder`` (the answers), ``route``."""

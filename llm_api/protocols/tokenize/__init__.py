"""vLLM's tokenizer routes (``tokenize``, ``detokenize``, ``tokenizer_info``)."""

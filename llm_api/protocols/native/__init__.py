"""The native API (``POST /predictions/<model>``, gRPC): ``schema``, ``translate`` (the contract), ``encoder``
(text chunks and the end-of-stream marker, or JSON lines), ``route``."""

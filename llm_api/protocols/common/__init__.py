"""What every API folder of ``llm_api.protocols`` shares, so it is written once:

* ``sampling``: ``to_sampling_params``, the one place a request body's generation controls become the
  engine's ``SamplingParams`` (tests/test_architecture.py checks that nothing else builds one), and
  ``check_token_range``, the token-limit check of the OpenAI-shaped APIs.
* ``checks``: the rules every API that takes them applies alike: ``tool_choice`` keywords, a response
  format or tools' plan applied to the request with the ``ignore_eos`` refusal and, under a reasoning
  parser, the constraint moved to the answer after the think block.
* ``openai``: the pieces of OpenAI's wire format that chat, completions and the Responses API share (content
  types, the 400 of a pydantic error, the model check, ``v1/models``) and the body fields chat and
  completions share; ``openai_call``: the encoder of chat and completions (one class, its ``kind`` picks
  the shape).
* ``fields``: the field rules of the bodies, as pydantic types (every API's ``schema`` declares its fields with
  them), and pydantic's errors as ``ApiError``; ``validation``: bodies (and form fields carrying JSON) decoded
  as strict JSON (``decode_json``).
"""

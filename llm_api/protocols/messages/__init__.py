"""Anthropic's Messages API (``v1/messages``, ``v1/messages/count_tokens``): ``translate`` has the contract."""

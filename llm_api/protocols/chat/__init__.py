"""OpenAI chat completions (``POST v1/chat/completions``): its route."""

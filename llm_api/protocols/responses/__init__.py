"""The OpenAI Responses API (``v1/responses``): its routes."""

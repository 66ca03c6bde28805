"""Schemathesis hooks for tests/test_server_fuzz.py: keep every generated request cheap on a CPU.

The spec allows up to 2048 new tokens (and defaults of 16 to 256); a fuzzed request asking for that
many would take minutes here. Token counts are capped at 4 before sending; everything else (types,
ranges, unknown fields, bad JSON) is sent as generated. (An earlier run found extreme but valid
temperature, top_p and repetition_penalty values breaking the sampler: tests/test_sampling.py keeps them.)
"""

import schemathesis

CAP = 4
TOKEN_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens")


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if not isinstance(body, dict) or "cancel" in body or str(getattr(case, "path", "")).endswith("count_tokens"):
        return  # (a cancel, and a token count, generate nothing: a token limit there is refused)
    for key in TOKEN_FIELDS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > CAP:
            body[key] = CAP
    if not any(k in body for k in TOKEN_FIELDS):
        body["max_tokens" if "model" in body else "max_new_tokens"] = CAP

"""Speculative decoding by n-gram prompt lookup (no draft model).

A sequence that is decoding proposes up to k tokens by looking its own last n-gram up earlier in its
prompt + output (``ngram``); the scheduler schedules the last real token and the draft as one 1 + k token
query (``drafter`` decides who drafts and keeps the acceptance counts); the model runner returns a logits
row for each of those positions; ``verify`` accepts the longest prefix of the draft that the target
distribution agrees with (greedy: argmax equality; sampled: rejection sampling) plus one more token, so
the output has the distribution it has without speculation. Rejected tokens leave no trace: the
scheduler advances ``num_computed_tokens`` only over accepted positions (the K/V slots after them are
overwritten by the next step, and their blocks are never registered in the prefix cache), and the
verifier only ever feeds accepted tokens to grammar matchers and penalty counts. docs/architecture.md
("Speculative decoding") walks through a step.
"""

"""What the scheduler is built with (pure Python, no torch): ``SchedulerConfig``.

The limits of a step and of a request (``max_num_seqs`` sequences running, ``max_num_batched_tokens``
tokens computed in one step, ``max_model_len`` tokens one request may reach, ``max_loras`` adapters at
once) and the operator's priority grants, which rank one key's requests against other keys'
(``llm_api.engine.scheduler`` says how). The engine builds it, and replaces it between steps when it raises
the token budget (``llm_api.engine.step_budget``). It lives apart from the scheduler so that the
scheduler's precedence rules (``llm_api.engine.precedence``), which read these limits, need not import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int  # most tokens (prompt + output) one request may reach; fits in the block pool
    max_loras: int = 0  # LoRA adapters running at once (MAX_LORAS); 0: no adapters are served
    # Owner -> its grant N (LLM_API_KEY's "key priority=N"): its requests rank max(N, min(priority, 0)) against
    # other owners' (Request.rank); an owner without one ranks 0 whatever its priorities.
    priority_grants: Mapping[str, int] = field(default_factory=dict)

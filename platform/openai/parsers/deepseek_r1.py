"""``deepseek_r1``: DeepSeek-R1 style ``<think>...</think>`` (vLLM's ``DeepSeekR1ReasoningParser``).

Start-up refusal: ``<think>`` and ``</think>`` must be vocabulary tokens. The output is
a thought until ``</think>``, then the answer; the opening ``<think>`` is optional (R1's
template puts it in the prompt). Non-streamed: ``(thought, answer)``; no ``</think>``
means it is all thought. Streamed: the end token's id in a step splits it.
"""

from __future__ import annotations

from collections.abc import Sequence

from loramux.platform.openai.parsers.reasoning_parser import THINK_END, THINK_START
from loramux.platform.openai.parsers.thinking import ThinkingTokensReasoningParser
from loramux.platform.openai.parsers.types import DeltaMessage


class DeepSeekR1ReasoningParser(ThinkingTokensReasoningParser):
    start_token = THINK_START
    end_token = THINK_END

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        delta = super().extract_reasoning_streaming(
            previous_text,
            current_text,
            delta_text,
            previous_token_ids,
            current_token_ids,
            delta_token_ids,
        )
        if (
            delta is None
            or self.start_token_id in previous_token_ids
            or self.start_token_id in delta_token_ids
        ):
            return delta
        # no <think> generated: the text is thought until </think>
        if self.end_token_id in delta_token_ids:
            return self._split_at_end(delta_text)
        if self.end_token_id in previous_token_ids:
            return DeltaMessage(content=delta_text)
        return DeltaMessage(reasoning=delta_text)
